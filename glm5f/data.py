"""Training data: sources of global batches {input_ids, labels, position_ids[, attention_mask]} of [B, S].

Sources: `synthetic` (seeded random bigram language), `text` (the embedded corpus), `json_file` (JSONL of text,
prompt/response or pre-tokenized ids; streamed), `preset_pt` (fixed batches from torch.save), `hf_datasets` (a
dataset saved to disk; streamed), `chat` (conversations rendered by a chat template, see glm5f/chat.py; chat records
are read by json_file and hf_datasets too). Documents are packed into rows of seq_len: positions restart at each
document and attention stays inside it. Every source has state_dict() / load_state_dict(); a step's global batch
depends only on the source and its state, never on how it is later split over micro-batches or ranks.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
import zlib
from importlib import resources

import torch

from glm5f import chat as chat_data
from glm5f.tokens import (IGNORE_INDEX, ByteTokenizer, Example, FileTokenizer, check_vocab, has_target,  # noqa: F401
                          make_tokenizer)


# ---- examples -----------------------------------------------------------------------------------------------------

def text_example(tok, text: str) -> Example:
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text) + \
          ([tok.eos_id] if tok.eos_id is not None else [])
    return Example(ids, list(ids))


def prompt_example(tok, prompt: str, response: str) -> Example:
    head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)
    tail = tok.encode(response) + ([tok.eos_id] if tok.eos_id is not None else [])
    return Example(head + tail, [IGNORE_INDEX] * len(head) + tail)


def check_string_fields(rec: dict, fields: tuple[str, ...], where: str) -> None:
    """A ValueError naming `where` (file:line), the field and the JSON type found unless each field is a string
    (a null response would otherwise train on the text "None", a number on its digits)."""
    for name in fields:
        if not isinstance(rec[name], str):
            found = chat_data.json_type(rec[name])
            raise ValueError(f"{where}: field {name!r} must be a string, found {found} ({json.dumps(rec[name])[:40]}); "
                             f"fix the record (\"\" for an empty {name}) or remove it")


def record_example(tok, rec, where: str, chat=None, chat_only: bool = False) -> Example:
    """An Example from one JSON record: {"text"}, {"prompt", "response"}, {"input_ids"[, "labels"]}, or a chat
    record ({"messages"} or {"conversations"}: `chat()` is the run's glm5f.chat.ChatData); `chat_only`
    (--data.type chat): any other record is an error."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    if chat_only and "messages" not in rec and "conversations" not in rec:
        raise ValueError(f"{where}: --data.type chat reads chat records ('messages' or 'conversations'), found keys "
                         f"{sorted(rec)[:5]} (a record of another kind would train on every one of its tokens); fix "
                         f"or remove it, or read the mixed file with --data.type json_file")
    if "messages" in rec or "conversations" in rec:
        if chat is None:
            raise ValueError(f"{where}: a chat record ('messages' or 'conversations'), but no chat template was "
                             f"given to read it; pass chat=glm5f.chat.run_chat_data(...)")
        return chat().example(rec, where)
    if "input_ids" in rec:
        ids = rec["input_ids"]
        labels = rec.get("labels", ids)
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"{where}: input_ids must be a list of integers")
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise ValueError(f"{where}: labels must be a list as long as input_ids ({len(ids)})")
        return Example(list(ids), list(labels))
    if "prompt" in rec and "response" in rec:
        check_string_fields(rec, ("prompt", "response"), where)
        return prompt_example(tok, rec["prompt"], rec["response"])
    if "text" in rec:
        check_string_fields(rec, ("text",), where)
        return text_example(tok, rec["text"])
    raise ValueError(f"{where}: a record needs 'text', 'prompt' and 'response', 'input_ids', or 'messages' or "
                     f"'conversations' (a chat); "
                     f"found keys {sorted(rec)}")


HELD_OUT_EVERY = 20  # every 20th document of the embedded corpus is held out for evaluation, never trained on


def embedded_documents(part: str | None = None) -> list[str]:
    """The corpus shipped with glm5f (see glm5f/assets/SOURCE.md): all of it, or its "train" or "eval" part
    (every HELD_OUT_EVERY-th document, counting from the HELD_OUT_EVERY-th, is "eval")."""
    with resources.files("glm5f").joinpath("assets/corpus.txt.gz").open("rb") as raw:
        docs = gzip.decompress(raw.read()).decode("utf-8").split("\f\n")
    held = lambda i: i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1  # noqa: E731
    if part is None:
        return docs
    if part not in ("train", "eval"):
        raise ValueError(f"part must be None, 'train' or 'eval', got {part!r}")
    return [d for i, d in enumerate(docs) if held(i) == (part == "eval")]


class JsonlReader:
    """The records of a JSONL file (gzip-compressed if its name ends in .gz), read one line at a time. A record's
    location is (byte offset, line number, record index), its payload the line's bytes; a .gz file seeks by
    decompressing from its start, so resuming in one costs a pass over what was already read."""

    START = (0, 1, 0)

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data.path {path!r}: no such file (expected a JSONL file, one record per line)")
        self.path, self._file = path, None
        self.seek(self.START)

    def _open(self):
        return gzip.open(self.path, "rb") if self.path.endswith(".gz") else open(self.path, "rb")

    def seek(self, loc) -> None:
        """Read on from location `loc` (a record's start, or START)."""
        if self._file is None:
            self._file = self._open()
        self._file.seek(loc[0])
        self.next_loc = tuple(loc)

    def read(self):
        """(location, payload) of the next record, skipping blank lines; None at the end of the file."""
        pos, line, index = self.next_loc
        while raw := self._readline(line):
            if raw.strip():
                self.next_loc = (pos + len(raw), line + 1, index + 1)
                return (pos, line, index), raw
            pos, line = pos + len(raw), line + 1
        self.next_loc = (pos, line, index)
        return None

    def _readline(self, line: int) -> bytes:
        """The next line of the file; a ValueError naming the file and line when a .gz file is cut short or is
        not gzip data (gzip raises a bare EOFError / BadGzipFile)."""
        try:
            return self._file.readline()
        except EOFError:
            raise ValueError(f"{self.path}:{line}: the gzip file ends in the middle of its data (truncated, e.g. "
                             f"an interrupted download or copy); re-create or re-download it") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise ValueError(f"{self.path}:{line}: not readable gzip data ({e}); a file named .gz must be gzip "
                             f"compressed, or rename it without .gz") from None

    def where(self, loc) -> str:
        return f"{self.path}:{loc[1]}"

    def parse(self, loc, payload: bytes):
        try:
            return json.loads(payload)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.where(loc)}: not valid JSON ({e.msg} at column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.where(loc)}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None

    def relocate(self, locs) -> tuple[list, tuple]:
        """For a file that changed since `locs` were taken: the locations its records with the same indices have
        now (None for an index past its end), and the location of its end; one pass over the file."""
        wanted, found = {loc[2] for loc in locs}, {}
        scan = JsonlReader(self.path)
        while (got := scan.read()) is not None:
            if got[0][2] in wanted:
                found[got[0][2]] = got[0]
        return [found.get(loc[2]) for loc in locs], scan.next_loc

    def payloads(self, locs) -> list[bytes]:
        """The lines at `locs`, read in one forward pass over the file (and the reader back at next_loc)."""
        out = {}
        with self._open() as f:
            for loc in sorted(set(locs)):
                f.seek(loc[0])
                out[loc] = f.readline()
        self._file.close()
        self._file = None
        self.seek(self.next_loc)
        return [out[loc] for loc in locs]


class DatasetReader:
    """The rows of one split of a datasets.save_to_disk directory, memory-mapped and read one at a time. A row's
    location is (row, row, row); it carries no payload (the row is read again from the dataset)."""

    START = (0, 0, 0)

    def __init__(self, path: str, split: str | None):
        try:
            import datasets
        except ImportError as e:
            raise ImportError("--data.type hf_datasets needs the `datasets` package: "
                              "pip install 'glm5f[datasets]'") from e
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data.path {path!r}: no dataset saved there (datasets' save_to_disk output)")
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split is None and len(ds) != 1:
                raise ValueError(f"{path} holds splits {list(ds)}: choose one with --data.split")
            ds = ds[split or next(iter(ds))]
        self.path, self.ds = path, ds
        self.seek(self.START)

    def seek(self, loc) -> None:
        self.next_loc = tuple(loc)

    def read(self):
        row = self.next_loc[0]
        if row >= len(self.ds):
            return None
        self.next_loc = (row + 1,) * 3
        return (row,) * 3, None

    def where(self, loc) -> str:
        return f"{self.path}[{loc[0]}]"

    def parse(self, loc, payload):
        return self.ds[loc[0]]

    def relocate(self, locs) -> tuple[list, tuple]:
        """As JsonlReader.relocate: a row keeps its index while the dataset has it."""
        return [tuple(loc) if loc[0] < len(self.ds) else None for loc in locs], (len(self.ds),) * 3

    def payloads(self, locs) -> list:
        return [None] * len(locs)


MIB = 1 << 20


def fingerprint(path: str) -> list[dict]:
    """What a data path held: for each of its files (the file, or every file under a directory), its path, size
    and a SHA-256 of its first and last MiB and size. Cheap on any size; a data state records it so a resume can
    tell that the data changed under it."""
    import hashlib

    files = [path] if not os.path.isdir(path) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
    out = []
    for file in files:
        size = os.path.getsize(file)
        h = hashlib.sha256(str(size).encode())
        with open(file, "rb") as f:
            h.update(f.read(MIB))
            if size > MIB:
                f.seek(max(MIB, size - MIB))
                h.update(f.read(MIB))
        out.append({"path": os.path.relpath(file, path) if file != path else os.path.basename(path),
                    "bytes": size, "sha256": h.hexdigest()})
    return out


class DataChanged(ValueError):
    """The data a checkpoint's position refers to is not the data there now."""


def check_same_files(saved: list[dict] | None, path: str, allow_changed: bool, warn=lambda message: None) -> bool:
    """Compare a data state's fingerprint (`saved`; None: a checkpoint from before fingerprints, not checked)
    with `path` now: a DataChanged naming what changed unless allow_changed (then a warning, and True)."""
    if saved is None:
        return False
    now = {f["path"]: f for f in fingerprint(path)}
    before = {f["path"]: f for f in saved}
    changes = [f"{n} is new" for n in sorted(set(now) - set(before))] + \
              [f"{n} is gone" for n in sorted(set(before) - set(now))]
    for n in sorted(set(now) & set(before)):
        a, b = before[n], now[n]
        if a["bytes"] != b["bytes"]:
            changes.append(f"{n} had {a['bytes']} bytes, now {b['bytes']}")
        elif a["sha256"] != b["sha256"]:
            changes.append(f"{n} has the same size ({a['bytes']} bytes) but other content at its start or end")
    if not changes:
        return False
    what = f"the data at {path} changed since the checkpoint was saved ({'; '.join(changes[:3])})"
    if allow_changed:
        warn(f"{what}; resuming at the saved position as it is (--data.allow_changed: the same record numbers)")
        return True
    raise DataChanged(f"{what}: the saved data position may no longer point at the records it did. Resume with "
                      f"--data.allow_changed to take the position as it is, or start a new run (another "
                      f"--checkpoint.dir; --model.init_from an export of this one keeps its weights)")


class RecordNotes:
    """What the first records of a dataset say about it: how many were read, how many hold input_ids, and where
    the ones with an empty response or text and the ones with nothing to learn (skipped) are (the first, and a
    count)."""

    def __init__(self):
        self.records, self.tokenized = 0, 0
        self.empty: dict[str, list] = {}  # "response" / "text" -> [records where it is empty, the first one]
        self.notes: dict[str, list] = {}  # an Example's note -> [count, where the first one is]
        self.untrained, self.first_untrained = 0, None

    def add(self, rec: dict, where: str, ex: Example) -> None:
        self.records += 1
        if ex.note:  # skipped or cut for a reason of its own (a chat record), said once by that note
            self.notes.setdefault(ex.note, [0, where])[0] += 1
        elif not has_target(ex):
            self.untrained += 1
            self.first_untrained = self.first_untrained or where
        self.tokenized += "input_ids" in rec
        field = "response" if "prompt" in rec and "response" in rec else "text" if "text" in rec else None
        if "input_ids" not in rec and field and not str(rec[field]).strip() and has_target(ex):
            self.empty.setdefault(field, [0, where])[0] += 1

    def warn(self, complete: bool, tokenizer_path: str | None, warn) -> None:
        """Warn once about records with an empty response or text, and about a --model.tokenizer_path that no record
        uses (all hold input_ids); `complete`: the notes cover the whole dataset."""
        counted = f"{self.records}" if complete else f"the first {self.records}"
        if self.untrained and self.untrained < self.records:
            warn(f"{self.untrained} of {counted} records have no token to learn (at most one token, or every "
                 f"label {IGNORE_INDEX}; the first at {self.first_untrained}): they are skipped")
        for field, (count, first) in self.empty.items():
            warn(f"{count} of {counted} records have an empty {field} (the first at {first}); each trains only on "
                 f"its end-of-sequence token")
        if tokenizer_path and self.records and self.tokenized == self.records:
            warn(f"--model.tokenizer_path {tokenizer_path} is not used: every record holds input_ids already")
        for note, (count, first) in self.notes.items():
            warn(f"{count} of {counted} records {note} (the first at {first})")


# ---- sources ------------------------------------------------------------------------------------------------------

def nothing_to_learn(name: str, records: int) -> str:
    if not records:
        return f"{name}: the dataset is empty (no records)"
    return (f"{name}: nothing to learn: none of its {records} records has a token to predict (each has at most one "
            f"token, or every label {IGNORE_INDEX}); training on it would report loss 0. Check the data's fields "
            f"(a response to learn, labels not all {IGNORE_INDEX})")


def check_first_batch(batch: dict[str, torch.Tensor], step: int, source: str) -> None:
    """Before the first step: a ValueError when the batch holds no target token (every label IGNORE_INDEX past
    each document's first token), which would "train" to loss 0.0000 on nothing."""
    labels = batch["labels"][:, 1:]
    if not bool((labels != IGNORE_INDEX).any()):
        raise ValueError(f"{source}: the batch of step {step + 1} holds no token to learn (every label is "
                         f"{IGNORE_INDEX} or the first of its document), so the loss would be 0 and nothing "
                         f"trained; check the labels of the data")


class RowPacker:
    """Rows of seq_len cut from a sequence of examples, packed back to back (or one example per row, truncated and
    padded, when pack=False). A subclass says which example is current (`_current`) and moves on (`_advance`);
    `offset` is how far into the current example the rows have come."""

    def _row(self):
        ids, labels, pos = [], [], []
        while len(ids) < self.S:
            ex = self._current()
            take = min(self.S - len(ids), len(ex.ids) - self.offset)
            ids += ex.ids[self.offset:self.offset + take]
            lab = ex.labels[self.offset:self.offset + take]
            if self.offset == 0 and lab:
                lab = [IGNORE_INDEX] + lab[1:]  # the first token of a document is not predicted from another
            labels += lab
            pos += range(self.offset, self.offset + take)
            self.offset += take
            if self.offset >= len(ex.ids) or not self.pack:
                self._advance()
            if not self.pack:
                break
        n = len(ids)
        valid = [1] * n + [0] * (self.S - n)
        return (ids + [self.pad_id] * (self.S - n), labels + [IGNORE_INDEX] * (self.S - n),
                pos + list(range(n, self.S)), valid)

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = [self._row() for _ in range(self.B)]
        batch = {"input_ids": torch.tensor([r[0] for r in rows]), "labels": torch.tensor([r[1] for r in rows]),
                 "position_ids": torch.tensor([r[2] for r in rows])}
        if not self.pack:
            batch["attention_mask"] = torch.tensor([r[3] for r in rows])
        return batch


class PackedSource(RowPacker):
    """Rows of seq_len cut from the examples (all in memory) in a seeded per-epoch order, packed back to back (or
    one example per row, truncated and padded, when pack=False)."""

    def __init__(self, examples: list[Example], batch_size: int, seq_len: int, seed: int, pad_id: int,
                 pack: bool = True, name: str = "data"):
        if not examples or not any(ex.ids for ex in examples):
            raise ValueError(f"{name}: the dataset is empty (no examples with tokens)")
        self.examples, self.B, self.S, self.seed, self.pad_id, self.pack = \
            examples, batch_size, seq_len, seed, pad_id, pack
        self.epoch, self.index, self.offset = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()

    def _current(self) -> Example:
        return self.examples[self._order[self.index]]

    def _advance(self):
        self.index, self.offset = self.index + 1, 0
        if self.index == len(self.examples):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.offset = state["epoch"], state["index"], state["offset"]
        self._order = self._permutation(self.epoch)


def shuffle_draw(seed: int, n: int) -> int:
    """The n-th 64-bit draw of seed's stream (SplitMix64): a pure function of (seed, n), so a shuffle's random
    state is one counter."""
    mask, golden = 2**64 - 1, 0x9E3779B97F4A7C15
    z = (seed * 0xBF58476D1CE4E5B9 + (n + 1) * golden) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class StreamSource(RowPacker):
    """Rows of seq_len packed from the records of a reader (JsonlReader, DatasetReader), read lazily: memory holds
    at most `shuffle_buffer` records' payloads, whatever the corpus size.

    Order: each epoch reads the records from the start; each is drawn from a buffer of up to shuffle_buffer of
    them (a uniform pick, refilled from the reader), and at the end of the data the buffer drains before the next
    epoch starts, so every epoch is a permutation of the records (shuffle_buffer 1: the file's order). A record is
    checked (JSON, keys, vocabulary: errors name its file:line, or its index in the file) as it enters the buffer,
    and the first buffer is filled here, so a small dataset is checked whole before training; the buffer keeps
    only the record's line (a dataset row: nothing), which is parsed and tokenized again when drawn. The state is
    the reader's location, the buffered records' locations (not their content), the count of draws made and the
    current record with the offset into it, so a resumed source goes on exactly where it stopped. Every rank
    streams the whole data and builds the same global batch; each then takes its own rows of it. `held_out` N
    (--eval.split_fraction 1/N): every N-th record, counting from the N-th, is the "eval" `part`, the others
    "train"; the source reads only its part.
    """

    def __init__(self, reader, tok, vocab_size: int, batch_size: int, seq_len: int, seed: int, pack: bool = True,
                 shuffle_buffer: int = 10_000, name: str = "data", tokenizer_path: str | None = None,
                 warn=lambda message: None, chat=None, allow_changed: bool = False, chat_only: bool = False,
                 held_out: int = 0, part: str = "train"):
        if shuffle_buffer < 1:
            raise ValueError(f"--data.shuffle_buffer must be >= 1 (1: no shuffling), got {shuffle_buffer}")
        self.reader, self.tok, self.V, self.name, self.chat = reader, tok, vocab_size, name, chat
        self.chat_only, self.held_out, self.part = chat_only, held_out, part
        self.files, self.allow_changed, self.warn = fingerprint(reader.path), allow_changed, warn
        self.B, self.S, self.seed, self.pad_id, self.pack, self.size = \
            batch_size, seq_len, seed, tok.pad_id, pack, shuffle_buffer
        self.epoch, self.draws, self.at_end, self.epoch_tokens = 0, 0, False, False
        self.buffer: list[tuple] = []  # (location, payload) of the records read but not yet drawn
        self.current, self.offset = None, 0  # (location, Example) being cut into rows
        notes = RecordNotes()
        self._fill(notes)
        notes.warn(self.at_end, tokenizer_path, warn)
        if self.at_end and not any(has_target(self._example(loc, payload)) for loc, payload in self.buffer):
            raise ValueError(nothing_to_learn(name, notes.records))

    def _example(self, loc, payload, notes=None) -> Example:
        rec = self.reader.parse(loc, payload)
        ex = record_example(self.tok, rec, self.reader.where(loc), self.chat, self.chat_only)
        check_vocab([ex], self.V, self.name, first=loc[2])
        if notes is not None:
            notes.add(rec, self.reader.where(loc), ex)
        return ex

    def _fill(self, notes=None) -> None:
        while not self.at_end and len(self.buffer) < self.size:
            got = self.reader.read()
            if got is None:
                self.at_end = True
            elif self.held_out and (got[0][2] % self.held_out == self.held_out - 1) != (self.part == "eval"):
                continue  # the other part of a --eval.split_fraction split
            else:
                self._example(*got, notes)
                self.buffer.append(got)

    def _current(self) -> Example:
        while self.current is None:
            self._fill()
            if not self.buffer:  # the epoch is over
                if not self.epoch_tokens:
                    raise ValueError(nothing_to_learn(self.name, self.draws))
                self.epoch, self.at_end, self.epoch_tokens = self.epoch + 1, False, False
                self.reader.seek(self.reader.START)
                continue
            j = shuffle_draw(self.seed, self.draws) % len(self.buffer)
            self.draws += 1
            self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
            loc, payload = self.buffer.pop()
            ex = self._example(loc, payload)
            if has_target(ex):  # a record with nothing to learn is skipped (RecordNotes counts them)
                self.current, self.epoch_tokens = (loc, ex), True
        return self.current[1]

    def _advance(self):
        self.current, self.offset = None, 0

    def state_dict(self) -> dict:
        locs = lambda items: torch.tensor([loc for loc, _ in items], dtype=torch.long).reshape(-1, 3)  # noqa: E731
        return {"epoch": self.epoch, "draws": self.draws, "at_end": self.at_end, "epoch_tokens": self.epoch_tokens,
                "next": torch.tensor(self.reader.next_loc), "buffer": locs(self.buffer),
                "current": locs([self.current] if self.current else []), "offset": self.offset,
                "files": self.files}

    def load_state_dict(self, state: dict) -> None:
        """Go on where `state` stopped; a DataChanged when the data's files differ from those it was saved on
        (see check_same_files). With allow_changed, changed files are taken at the same record numbers (a record
        number past their end: at their end)."""
        changed = check_same_files(state.get("files"), self.reader.path, self.allow_changed, self.warn)
        self.epoch, self.draws, self.at_end, self.epoch_tokens, self.offset = \
            state["epoch"], state["draws"], state["at_end"], state["epoch_tokens"], state["offset"]
        buffer = [tuple(loc) for loc in state["buffer"].tolist()]
        current = [tuple(loc) for loc in state["current"].tolist()]
        following = tuple(state["next"].tolist())
        if changed:  # --data.allow_changed: byte offsets into another file mean nothing; record numbers do
            n = len(buffer)
            moved, end = self.reader.relocate(buffer + current + [following])
            buffer = [loc for loc in moved[:n] if loc is not None]
            current = [loc for loc in moved[n:-1] if loc is not None]
            following = moved[-1] or end
        self.reader.seek(following)
        payloads = self.reader.payloads(buffer + current)
        self.buffer = list(zip(buffer, payloads[:len(buffer)]))
        self.current = (current[0], self._example(current[0], payloads[-1])) if current else None
        if changed and (self.current is None or self.offset >= len(self.current[1].ids)):
            self.current, self.offset = None, 0  # no record there now, or a shorter one: go on with the next


class SyntheticSource:
    """Seeded random sequences from a fixed sparse bigram table (four successors per token): learnable, and a
    pure function of (seed, step). Held-out sequences start at step HELD_OUT_STEP, which training never reaches."""

    HELD_OUT_STEP = 10**12

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int, seed: int, step: int = 0):
        self.B, self.S, self.V, self.seed, self.step = batch_size, seq_len, vocab_size, seed, step
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=g)

    def next_batch(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step + 1)
        self.step += 1
        choice = torch.randint(0, 4, (self.B, self.S), generator=g)
        ids = torch.empty(self.B, self.S, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.V, (self.B,), generator=g)
        for t in range(1, self.S):
            ids[:, t] = self.successors[ids[:, t - 1], choice[:, t]]
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(self.S).expand(self.B, -1)}

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def load_batches(path: str):
    """What torch.save wrote to `path`, read with weights_only (tensors, lists, dicts; never arbitrary pickles).
    A missing file or one that is not such a torch.save is a FileNotFoundError / ValueError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data.path {path!r}: no such file (expected torch.save of a list of batches)")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, KeyError, EOFError... on a foreign file
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = f"it holds a Python object ({found.group(1)}), not only tensors" if found else \
            "not a file written by torch.save"
        raise ValueError(f"--data.path {path}: cannot read it as --data.type preset_pt batches: {why}. Save a list "
                         f"of dicts of tensors: torch.save([{{'input_ids': ids_BxS, 'labels': labels_BxS}}, ...], "
                         f"path)") from None


class PresetSource:
    """Fixed batches saved with torch.save (a list of dicts of [B, S] tensors), replayed in order, cycling;
    `shapes`: their distinct [B, S] (what --data.batch_size and --data.seq_len are for the other sources)."""

    KEYS = ("input_ids", "labels", "attention_mask", "position_ids")

    def __init__(self, path: str, vocab_size: int, allow_changed: bool = False, warn=lambda message: None):
        batches = load_batches(path)
        self.path, self.files, self.allow_changed, self.warn = path, fingerprint(path), allow_changed, warn
        if not isinstance(batches, (list, tuple)) or not batches:
            raise ValueError(f"{path}: expected a non-empty list of batches, found {type(batches).__name__}")
        for i, b in enumerate(batches):
            if not isinstance(b, dict) or "input_ids" not in b:
                raise ValueError(f"{path}: batch {i} must be a dict with at least 'input_ids'")
            unknown = set(b) - set(self.KEYS)
            if unknown:
                raise ValueError(f"{path}: batch {i} has unknown keys {sorted(unknown)}; allowed: {self.KEYS}")
            ids = b["input_ids"]
            square = (len(ids), 1, ids.shape[-1], ids.shape[-1]) if ids.ndim == 2 else None
            if ids.ndim != 2 or any(b[k].shape != ids.shape and not (k == "attention_mask" and
                                                                     tuple(b[k].shape) == square) for k in b):
                raise ValueError(f"{path}: batch {i}: every tensor must be [batch, seq] like input_ids "
                                 f"{list(ids.shape)} (attention_mask may also be [batch, 1, seq, seq])")
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
                raise ValueError(f"{path}: batch {i} has token ids outside [0, vocab_size={vocab_size})")
            labels = b.get("labels", ids)
            wrong = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))]
            if wrong.numel():
                raise ValueError(f"{path}: batch {i} has label {int(wrong[0])} outside [0, vocab_size={vocab_size}) "
                                 f"(use {IGNORE_INDEX} where no loss is taken): fix the labels or raise "
                                 f"--model.vocab_size")
        self.batches, self.index = list(batches), 0
        self.shapes = list(dict.fromkeys(tuple(b["input_ids"].shape) for b in self.batches))  # [B, S]s, in order

    def next_batch(self) -> dict[str, torch.Tensor]:
        b = dict(self.batches[self.index % len(self.batches)])
        self.index += 1
        b.setdefault("labels", b["input_ids"].clone())
        if "position_ids" not in b:
            b["position_ids"] = torch.arange(b["input_ids"].shape[1]).expand_as(b["input_ids"])
        return {k: v if k == "attention_mask" and v.ndim == 4 else v.long() for k, v in b.items()}

    def state_dict(self) -> dict:
        return {"index": self.index, "files": self.files}

    def load_state_dict(self, state: dict) -> None:
        check_same_files(state.get("files"), self.path, self.allow_changed, self.warn)
        self.index = state["index"]


def make_eval_source(kind: str, *, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0,
                     path: str | None = None, split: str | None = None, train_path: str | None = None,
                     train_split: str | None = None, tokenizer_path: str | None = None, pack: bool = True,
                     shuffle_buffer: int = 10_000, chat_template: str | None = None, train_on: str = "assistant",
                     held_out: float = 0.0):
    """The held-out data of a run of `--data.type kind`: `path` (default the training data's `train_path`) and
    `split` when given, in that data type's format (JSONL for text and synthetic runs); else the held-out part of
    the embedded text, of the chat sample or of the synthetic stream. None when there is none (json_file,
    hf_datasets, preset_pt without a path or split; chat with a --data.path) unless `held_out`
    (--eval.split_fraction) holds out a part of the training records (of `train_split` for hf_datasets)."""
    common = dict(vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len, seed=seed,
                  tokenizer_path=tokenizer_path, pack=pack, shuffle_buffer=shuffle_buffer,
                  chat_template=chat_template, train_on=train_on)
    if path is not None or split is not None:
        eval_kind = "json_file" if kind in ("text", "synthetic") else kind
        try:
            return make_source(eval_kind, path=path or train_path, split=split, warn=lambda message: None, **common)
        except FileNotFoundError as e:  # the readers name the training flag; this file came from --eval.path
            raise FileNotFoundError(str(e).replace("--data.path", "--eval.path") if path else str(e)) from None
    if held_out and train_path is not None:
        return make_source(kind, path=train_path, split=train_split, warn=lambda message: None, held_out=held_out,
                           part="eval", **common)
    if kind == "synthetic":
        return SyntheticSource(batch_size, seq_len, vocab_size, seed, step=SyntheticSource.HELD_OUT_STEP)
    if kind == "text":  # the training source has checked the tokenizer against the model
        tok = make_tokenizer(tokenizer_path)
        examples = [text_example(tok, d) for d in embedded_documents("eval")]
        return PackedSource(examples, batch_size, seq_len, seed, tok.pad_id, pack, "embedded corpus (held out)")
    if kind == "chat" and train_path is None:
        return sample_source("eval", vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len, seed=seed,
                             tokenizer_path=tokenizer_path, pack=pack, chat_template=chat_template,
                             train_on=train_on, warn=lambda message: None)
    return None


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


def infer_data_type(path: str | None) -> str:
    """The --data.type that reads `path` when none is given: text without a path; json_file for a .jsonl, .json
    (or either .gz) file; preset_pt for a .pt file; hf_datasets for a datasets.save_to_disk directory. A
    ValueError when the path says none of these."""
    if path is None:
        return "text"
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, n)) for n in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json")):
            return "hf_datasets"
        shards = sorted(n for n in os.listdir(path) if n.endswith(JSONL_SUFFIXES))
        fix = (f"it holds {len(shards)} JSONL file(s) ({', '.join(shards[:3])}{', ...' if len(shards) > 3 else ''}) "
               f"and --data.path reads one: concatenate them (cat {path}/*.jsonl > all.jsonl) and pass that file"
               if shards else "pass a .jsonl file, a .pt file or a saved dataset, or name its type with --data.type")
        raise ValueError(f"--data.path {path} is a directory but not a datasets.save_to_disk output (no "
                         f"dataset_info.json or dataset_dict.json in it); {fix}")
    if path.endswith(JSONL_SUFFIXES):
        return "json_file"
    if path.endswith(".pt"):
        return "preset_pt"
    raise ValueError(f"cannot tell the type of --data.path {path} from its name (expected .jsonl, .jsonl.gz, .pt "
                     f"or a datasets.save_to_disk directory); pass --data.type json_file, preset_pt or hf_datasets")


def check_path_fits(kind: str, path: str | None, flag: str = "--data.path") -> None:
    """A ValueError when --data.type `kind` would not read `path`: text and synthetic read no path (it would be
    ignored), json_file and preset_pt read a file, hf_datasets a directory; a .pt file is not JSONL and a JSONL
    file not torch.save batches."""
    if path is None:
        return
    if kind in ("text", "synthetic"):
        raise ValueError(f"--data.type {kind} reads no file, so {flag} {path} would be ignored; drop --data.type "
                         f"(the type then follows from the path) or pass the type that reads it")
    fix = "pass the --data.type that reads it, or leave --data.type out (it then follows from the path)"
    if kind in ("json_file", "preset_pt") and os.path.isdir(path):
        raise ValueError(f"--data.type {kind} reads a file, but {flag} {path} is a directory; {fix}")
    if kind == "hf_datasets" and os.path.isfile(path):
        raise ValueError(f"--data.type hf_datasets reads a datasets.save_to_disk directory, but {flag} {path} is "
                         f"a file; {fix}")
    if kind == "json_file" and path.endswith(".pt"):
        raise ValueError(f"--data.type json_file reads JSONL, but {flag} {path} is a .pt file; {fix}")
    if kind == "preset_pt" and path.endswith(JSONL_SUFFIXES):
        raise ValueError(f"--data.type preset_pt reads torch.save batches, but {flag} {path} is JSON; {fix}")


def print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def warnings_as_lines() -> None:
    """Print Python warnings (glm5f's, and its libraries') as one `warning:` line each, without the category and
    source line Python adds; for the command-line scripts."""
    import warnings

    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: print_warning(
        str(message))


def make_source(kind: str, *, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, path: str | None = None,
                tokenizer_path: str | None = None, pack: bool = True, split: str | None = None, warn=print_warning,
                shuffle_buffer: int = 10_000, chat_template: str | None = None, train_on: str = "assistant",
                allow_changed: bool = False, held_out: float = 0.0, part: str = "train"):
    """The data source of `--data.type kind` for a model of vocab_size. What looks like a mistake in the data
    (an empty response, an unused tokenizer) is passed to `warn`, one line each. json_file and hf_datasets are
    streamed, shuffled by a buffer of `shuffle_buffer` records (see StreamSource); so is chat with a path. Chat
    records (any of these but preset_pt) are rendered with `chat_template` (see glm5f.chat) and trained on the
    tokens `train_on` names. `held_out` (--eval.split_fraction): the streamed records are split into a "train"
    and an "eval" `part` (every round(1 / held_out)-th record) and the source reads one."""
    if tokenizer_path and kind in ("synthetic", "preset_pt"):
        warn(f"--model.tokenizer_path {tokenizer_path} is not used: --data.type {kind} does not tokenize text")
    if kind == "synthetic":
        return SyntheticSource(batch_size, seq_len, vocab_size, seed)
    if kind == "preset_pt":
        if path is None:
            raise ValueError("--data.type preset_pt needs --data.path FILE (torch.save of a list of batches)")
        return PresetSource(path, vocab_size, allow_changed, warn)
    tok = make_tokenizer(tokenizer_path)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}: "
                         f"raise --model.vocab_size to at least {tok.vocab_size}")
    chat = chat_data.run_chat_data(tokenizer_path, chat_template, train_on, seq_len, vocab_size, warn)
    if kind == "chat" and path is None:
        return sample_source("train", vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len,
                                       seed=seed, tokenizer_path=tokenizer_path, pack=pack, chat=chat(), warn=warn)
    if kind == "text":
        examples = [text_example(tok, d) for d in embedded_documents("train")]
        name = "embedded corpus"
    elif kind in ("json_file", "hf_datasets", "chat"):
        if path is None:
            raise ValueError(f"--data.type {kind} needs --data.path")
        reader = DatasetReader(path, split) if kind == "hf_datasets" else JsonlReader(path)
        return StreamSource(reader, tok, vocab_size, batch_size, seq_len, seed, pack, shuffle_buffer, path,
                            tokenizer_path, warn, chat, allow_changed, chat_only=kind == "chat",
                            held_out=round(1 / held_out) if held_out else 0, part=part)
    else:
        raise ValueError(f"unknown --data.type {kind!r}")
    check_vocab(examples, vocab_size, name)
    return PackedSource(examples, batch_size, seq_len, seed, tok.pad_id, pack, name)


def sample_source(part: str, *, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0,
                  tokenizer_path: str | None = None, pack: bool = True, chat: chat_data.ChatData | None = None,
                  chat_template: str | None = None, train_on: str = "assistant", warn=lambda message: None):
    """The shipped chat sample's "train" or "eval" part as a PackedSource."""
    chat = chat or chat_data.run_chat_data(tokenizer_path, chat_template, train_on, seq_len, vocab_size)()
    notes, examples = RecordNotes(), []
    for where, rec in chat_data.sample_records(part):
        ex = chat.example(rec, where)
        notes.add(rec, where, ex)
        examples.append(ex)
    notes.warn(True, None, warn)
    name = f"chat sample ({part})"
    check_vocab(examples, vocab_size, name)
    return PackedSource([ex for ex in examples if ex.ids], batch_size, seq_len, seed, chat.fmt.tok.pad_id, pack, name)

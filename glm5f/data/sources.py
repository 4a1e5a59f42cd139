"""The data sources a run reads, one per --data.type (make_source, make_eval_source): streamed and shuffled
records, the embedded corpus and chat sample, preset_pt batches and the synthetic language, with their states.
"""

from __future__ import annotations

import torch

from glm5f.data import chat as chat_data
from glm5f.data.notes import RecordNotes, nothing_to_learn, print_warning
from glm5f.data.files import open_reader
from glm5f.data.packing import PackedSource, RowPacker
from glm5f.data.readers import (DatasetReader, check_same_files, embedded_documents, fingerprint, load_batches,
                                record_example, text_example)
from glm5f.data.tokens import IGNORE_INDEX, Example, check_vocab, has_target, make_tokenizer


def shuffle_draw(seed: int, n: int) -> int:
    """The n-th 64-bit draw of seed's stream (SplitMix64): a pure function of (seed, n), so a shuffle's random
    state is one counter."""
    mask, golden = 2**64 - 1, 0x9E3779B97F4A7C15
    z = (seed * 0xBF58476D1CE4E5B9 + (n + 1) * golden) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class StreamSource(RowPacker):
    """Rows of seq_len packed from the records of a reader (`files.open_reader`, DatasetReader), read lazily: memory
    holds at most `shuffle_buffer` records' payloads, whatever the corpus size.

    Order: each epoch reads the records from the start; each is drawn from a buffer of up to shuffle_buffer of
    them (a uniform pick, refilled from the reader), and at the end of the data the buffer drains before the next
    epoch starts, so every epoch is a permutation of the records (shuffle_buffer 1: the file's order). A record is
    checked (JSON, keys, vocabulary: errors name its file:line, or its index in the file) as it enters the buffer,
    and the first buffer is filled here, so a small dataset is checked whole before training; the buffer keeps
    only the record's line (a parquet row: the record; a dataset row: nothing), which is parsed and tokenized again
    when drawn. The state is
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


def model_tokenizer(tokenizer_path: str | None, vocab_size: int):
    """The run's tokenizer (`make_tokenizer`), refused in one line when it has more ids than the model."""
    tok = make_tokenizer(tokenizer_path)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}: "
                         f"raise --model.vocab_size to at least {tok.vocab_size}")
    return tok


def make_source(kind: str, *, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, path: str | None = None,
                tokenizer_path: str | None = None, pack: bool = True, split: str | None = None, warn=print_warning,
                shuffle_buffer: int = 10_000, chat_template: str | None = None, train_on: str = "assistant",
                allow_changed: bool = False, held_out: float = 0.0, part: str = "train"):
    """The data source of `--data.type kind` for a model of vocab_size (an objective's own data types, e.g. DPO's
    preference pairs, are read by its row's `source`). What looks like a mistake in the data
    (an empty response, an unused tokenizer) is passed to `warn`, one line each. json_file and hf_datasets are
    streamed, shuffled by a buffer of `shuffle_buffer` records (see StreamSource); so is chat with a path. Chat
    records (any of these but preset_pt) are rendered with `chat_template` (see glm5f.data.chat) and trained on the
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
    tok = model_tokenizer(tokenizer_path, vocab_size)
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
        reader = DatasetReader(path, split) if kind == "hf_datasets" else open_reader(path)
        return StreamSource(reader, tok, vocab_size, batch_size, seq_len, seed, pack, shuffle_buffer, path,
                            tokenizer_path, warn, chat, allow_changed, chat_only=kind == "chat",
                            held_out=round(1 / held_out) if held_out else 0, part=part)
    else:
        raise ValueError(f"unknown --data.type {kind!r}")
    check_vocab(examples, vocab_size, name)
    return PackedSource(examples, batch_size, seq_len, seed, tok.pad_id, pack, name)


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

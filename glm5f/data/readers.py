"""The file formats data is read from: records (text, prompt/response, ids, chat) as Examples, JSONL files and
saved datasets record by record, preset_pt batches, the embedded corpus; the type a path takes; file fingerprints.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from importlib import resources

import torch

from glm5f.data import chat as chat_data
from glm5f.data.tokens import IGNORE_INDEX, Example


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
    record ({"messages"} or {"conversations"}: `chat()` is the run's glm5f.data.chat.ChatData); `chat_only`
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
                             f"given to read it; pass chat=glm5f.data.chat.run_chat_data(...)")
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


def chat_prompt(rec, where: str):
    """The record with a `prompt` given as a list of messages (TRL's conversational rows, verl's RL rows) read as
    its `messages`; a ValueError naming `where` when it gives `messages` too. Any other record as it is."""
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), list):
        return rec
    if "messages" in rec:
        raise ValueError(f"{where}: the record gives its prompt twice ('prompt' and 'messages'); keep one")
    return {("messages" if k == "prompt" else k): v for k, v in rec.items()}


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


def relocate_by_index(scan, locs) -> tuple[list, tuple]:
    """(the locations a fresh reader `scan` of the data as it is now gives the records with the indices of `locs`,
    None for an index past its end; the location of its end), in one pass over the data."""
    wanted, found = {loc[2] for loc in locs}, {}
    while (got := scan.read()) is not None:
        if got[0][2] in wanted:
            found[got[0][2]] = got[0]
    return [found.get(loc[2]) for loc in locs], scan.next_loc


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

    @staticmethod
    def where_in(path: str, loc) -> str:
        return f"{path}:{loc[1]}"

    def where(self, loc) -> str:
        return self.where_in(self.path, loc)

    @staticmethod
    def parse_line(where: str, payload: bytes):
        try:
            return json.loads(payload)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None

    def parse(self, loc, payload: bytes):
        return self.parse_line(self.where(loc), payload)

    def relocate(self, locs) -> tuple[list, tuple]:
        """For a file that changed since `locs` were taken: the locations its records with the same indices have
        now (None for an index past its end), and the location of its end; one pass over the file."""
        return relocate_by_index(JsonlReader(self.path), locs)

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


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)


def data_kind(name: str) -> str | None:
    """"jsonl" or "parquet" for a data file's name (by its suffix), None for another file."""
    return "parquet" if name.endswith(PARQUET_SUFFIXES) else "jsonl" if name.endswith(JSONL_SUFFIXES) else None


def infer_data_type(path: str | None) -> str:
    """The --data.type that reads `path` when none is given: text without a path; json_file for a JSON-lines
    (.jsonl, .json, either .gz) or parquet file or a folder of them; preset_pt for a .pt file; hf_datasets for a
    datasets.save_to_disk directory. A ValueError when the path says none of these."""
    if path is None:
        return "text"
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, n)) for n in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json")):
            return "hf_datasets"
        if any(data_kind(n) for n in os.listdir(path)):
            return "json_file"
        raise ValueError(f"--data.path {path} is a directory but not a datasets.save_to_disk output (no "
                         f"dataset_info.json or dataset_dict.json in it) and holds no data file (.jsonl, .jsonl.gz, "
                         f".json, .json.gz or .parquet); pass such a file or a folder of them, a .pt file or a saved "
                         f"dataset, or name its type with --data.type")
    if data_kind(path):
        return "json_file"
    if path.endswith(".pt"):
        return "preset_pt"
    raise ValueError(f"cannot tell the type of --data.path {path} from its name (expected .jsonl, .jsonl.gz, "
                     f".parquet, .pt or a datasets.save_to_disk directory); pass --data.type json_file, preset_pt "
                     f"or hf_datasets")


def check_path_fits(kind: str, path: str | None, flag: str = "--data.path") -> None:
    """A ValueError when --data.type `kind` would not read `path`: text and synthetic read no path (it would be
    ignored), preset_pt reads a file, hf_datasets a directory; a .pt file is not records and a JSON-lines or parquet
    file not torch.save batches."""
    if path is None:
        return
    if kind in ("text", "synthetic"):
        raise ValueError(f"--data.type {kind} reads no file, so {flag} {path} would be ignored; drop --data.type "
                         f"(the type then follows from the path) or pass the type that reads it")
    fix = "pass the --data.type that reads it, or leave --data.type out (it then follows from the path)"
    if kind == "preset_pt" and os.path.isdir(path):
        raise ValueError(f"--data.type {kind} reads a file, but {flag} {path} is a directory; {fix}")
    if kind == "hf_datasets" and os.path.isfile(path):
        raise ValueError(f"--data.type hf_datasets reads a datasets.save_to_disk directory, but {flag} {path} is "
                         f"a file; {fix}")
    if kind == "json_file" and path.endswith(".pt"):
        raise ValueError(f"--data.type json_file reads JSON lines or parquet, but {flag} {path} is a .pt file; {fix}")
    if kind == "preset_pt" and data_kind(path):
        raise ValueError(f"--data.type preset_pt reads torch.save batches, but {flag} {path} is "
                         f"{'parquet' if data_kind(path) == 'parquet' else 'JSON'}; {fix}")


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


def file_changes(saved: list[dict], path: str) -> list[str]:
    """What differs between a fingerprint `saved` (`fingerprint`'s) and `path` now, one phrase per file ([]: the
    same files)."""
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
    return changes


def check_same_files(saved: list[dict] | None, path: str, allow_changed: bool, warn=lambda message: None) -> bool:
    """Compare a data state's fingerprint (`saved`; None: a checkpoint from before fingerprints, not checked)
    with `path` now: a DataChanged naming what changed unless allow_changed (then a warning, and True)."""
    changes = [] if saved is None else file_changes(saved, path)
    if not changes:
        return False
    what = f"the data at {path} changed since the checkpoint was saved ({'; '.join(changes[:3])})"
    if allow_changed:
        warn(f"{what}; resuming at the saved position as it is (--data.allow_changed: the same record numbers)")
        return True
    raise DataChanged(f"{what}: the saved data position may no longer point at the records it did. Resume with "
                      f"--data.allow_changed (or --checkpoint.allow_changed data.path) to take the position as it is, "
                      f"or start a new run (another --checkpoint.dir; --model.init_from an export of this one keeps "
                      f"its weights)")

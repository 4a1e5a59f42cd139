"""Where records are read from: a JSON-lines file, a parquet file, or a folder of either read as one stream;
`open_reader` gives the reader a source streams, `file_records` every record with the place that names it.
"""

from __future__ import annotations

import bisect
import os

from glm5f.data.readers import JsonlReader, data_kind, relocate_by_index

FORMATS = ".jsonl, .jsonl.gz, .json, .json.gz or .parquet"


def parquet_module(path: str):
    """pyarrow.parquet, or an ImportError saying which extra installs it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"--data.path {path} is parquet, which glm5f reads with pyarrow, not installed here: "
                          f"pip install 'glm5f[parquet]' (or pyarrow), or convert the file to JSON lines") from None
    return pq


def without_nulls(value):
    """A parquet value as a JSON record holds it: an object's null fields dropped (a parquet file has one schema, so
    a field a record lacks is stored as null), at every depth; lists keep their null entries."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


class ParquetReader:
    """The rows of a parquet file as records (`without_nulls`), one row group held at a time. A row's location is
    (row, row, row), the row counting from 0 as pyarrow and pandas index them; its payload is the record."""

    START = (0, 0, 0)

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data.path {path!r}: no such file (expected a parquet file)")
        pq = parquet_module(path)
        try:
            self._file = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError... on a file that is not parquet
            raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e}); re-create it, or name "
                             f"a JSON-lines file without .parquet") from None
        meta = self._file.metadata
        self.path, self.rows = path, meta.num_rows
        self._starts = [0]
        for g in range(meta.num_row_groups):
            self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        self._group, self._table = None, None
        self.seek(self.START)

    def _record(self, row: int) -> dict:
        g = bisect.bisect_right(self._starts, row) - 1
        if g != self._group:
            self._group, self._table = g, self._file.read_row_group(g)
        return without_nulls(self._table.slice(row - self._starts[g], 1).to_pylist()[0])

    def seek(self, loc) -> None:
        self.next_loc = (loc[0],) * 3

    def read(self):
        row = self.next_loc[0]
        if row >= self.rows:
            return None
        self.next_loc = (row + 1,) * 3
        return (row,) * 3, self._record(row)

    @staticmethod
    def where_in(path: str, loc) -> str:
        return f"{path}:row {loc[0]}"

    def where(self, loc) -> str:
        return self.where_in(self.path, loc)

    def parse(self, loc, payload):
        return payload

    def relocate(self, locs) -> tuple[list, tuple]:
        """As JsonlReader.relocate: a row keeps its index while the file has it."""
        return [tuple(loc) if loc[0] < self.rows else None for loc in locs], (self.rows,) * 3

    def payloads(self, locs) -> list:
        got = {loc[0]: self._record(loc[0]) for loc in sorted(set(map(tuple, locs)))}
        return [got[loc[0]] for loc in locs]


def data_files(path: str, what: str = "records") -> list[str]:
    """The files --data.path `path` names: the file itself, or the files of a folder whose names end in .parquet or
    a JSON-lines suffix, sorted by name (other files, e.g. a README, are not data); a folder holding no such file or
    both kinds is a ValueError, a path that is not there a FileNotFoundError."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--data.path {path!r}: no such file or folder (expected a JSON-lines or parquet "
                                f"file of {what}, or a folder of them)")
    names = sorted(n for n in os.listdir(path) if data_kind(n) and os.path.isfile(os.path.join(path, n)))
    if not names:
        raise ValueError(f"--data.path {path}: the folder holds no data file (expected {what} in files named "
                         f"{FORMATS}); pass a file, or a folder of such files")
    kinds = {data_kind(n): n for n in names}
    if len(kinds) > 1:
        raise ValueError(f"--data.path {path}: the folder mixes JSON-lines files ({kinds['jsonl']}) and parquet files "
                         f"({kinds['parquet']}), and reads as one stream of one kind; move one kind to another folder")
    return [os.path.join(path, n) for n in names]


def file_reader(file: str):
    return ParquetReader(file) if data_kind(file) == "parquet" else JsonlReader(file)


class FolderReader:
    """The records of a folder's data files (`data_files`) read one file after another, as one stream. A location is
    (file number * FILE_STRIDE + the record's offset in its file (a byte or a row), its line or row in the file, its
    record index over the folder)."""

    FILE_STRIDE = 1 << 40

    def __init__(self, path: str, what: str = "records"):
        self.path, self.files = path, data_files(path, what)
        self.parquet = data_kind(self.files[0]) == "parquet"
        self.START = (0, (ParquetReader if self.parquet else JsonlReader).START[1], 0)
        self.seek(self.START)

    def _split(self, loc) -> tuple[int, tuple]:
        i, offset = divmod(loc[0], self.FILE_STRIDE)
        return i, (offset, loc[1], 0)

    def seek(self, loc) -> None:
        self._i, inner = self._split(loc)
        self._reader, self._index = file_reader(self.files[self._i]), loc[2]
        self._reader.seek(inner)

    @property
    def next_loc(self) -> tuple:
        offset, line, _ = self._reader.next_loc
        return (self._i * self.FILE_STRIDE + offset, line, self._index)

    def read(self):
        while (got := self._reader.read()) is None:
            if self._i + 1 == len(self.files):
                return None
            self._i, self._reader = self._i + 1, file_reader(self.files[self._i + 1])
        (offset, line, _), payload = got
        self._index += 1
        return (self._i * self.FILE_STRIDE + offset, line, self._index - 1), payload

    def where(self, loc) -> str:
        i, inner = self._split(loc)
        return (ParquetReader if self.parquet else JsonlReader).where_in(self.files[i], inner)

    def parse(self, loc, payload):
        return payload if self.parquet else JsonlReader.parse_line(self.where(loc), payload)

    def relocate(self, locs) -> tuple[list, tuple]:
        """As JsonlReader.relocate, over the folder's files as they are now; one pass over them."""
        return relocate_by_index(FolderReader(self.path), locs)

    def payloads(self, locs) -> list:
        """The payloads at `locs`, each file's read by a reader of its own (this one stays where it is)."""
        out, by_file = {}, {}
        for loc in map(tuple, locs):
            by_file.setdefault(self._split(loc)[0], []).append(loc)
        for i, mine in sorted(by_file.items()):
            got = file_reader(self.files[i]).payloads([self._split(loc)[1] for loc in mine])
            out.update(zip(mine, got))
        return [out[tuple(loc)] for loc in locs]


def open_reader(path: str, what: str = "records"):
    """The reader of --data.path `path`: a JsonlReader or ParquetReader for a file (by its name: .parquet is parquet,
    any other name JSON lines), a FolderReader for a folder (see `data_files`)."""
    return FolderReader(path, what) if os.path.isdir(path) else file_reader(path)


def file_records(path: str, what: str):
    """(where, record) of each record of --data.path `path` (`open_reader`; `what`: its records' kind, for the
    errors), where "file:line" for JSON lines and "file:row N" for parquet: a ValueError naming it for a line that
    is not JSON, and one when the path holds no record."""
    reader, found = open_reader(path, what), False
    while (got := reader.read()) is not None:
        found = True
        yield reader.where(got[0]), reader.parse(*got)
    if not found:
        raise ValueError(f"{path}: no {what}")


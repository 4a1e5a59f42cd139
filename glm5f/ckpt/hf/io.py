"""Safetensors files read and written with plain file I/O: the files of a checkpoint, their headers, a part of a
tensor read straight into its destination, a file written one tensor at a time.

Not memory-mapped: a rank loading its shards brings only their bytes into its memory, and export writes a file
tensor by tensor. The format is an 8-byte header length, a JSON header, then the tensors' bytes.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import torch

from glm5f.core.config import read_json
from glm5f.parallel.layout import full_tensor

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (sharded via model.safetensors.index.json, or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "a safetensors index with a 'weight_map'").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise FileNotFoundError(f"{index} names shard files that are not there: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}: expected a Transformers checkpoint directory")
    return [os.path.join(path, f) for f in files]


def inventory(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str, int]]:
    """{key: (file, shape, dtype string, byte offset of its data in the file)} from the safetensors headers only."""
    inv = {}
    for fn in files:
        header, start = _read_header(fn)
        for k, h in header.items():
            if k in inv:
                raise ValueError(f"tensor {k!r} appears in both {inv[k][0]} and {fn}")
            inv[k] = (fn, tuple(h["shape"]), h["dtype"], start + h["data_offsets"][0])
    return inv


def _header_json(fn: str) -> tuple[dict, int]:
    """(a safetensors file's header as its JSON says, its length in bytes); a ValueError for a bad length."""
    with open(fn, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= min(os.path.getsize(fn) - 8, 1 << 30):
            raise ValueError("bad header length")
        return json.loads(f.read(n)), n


def _read_header(fn: str) -> tuple[dict, int]:
    """A safetensors file's header {key: {"dtype", "shape", "data_offsets"}} and the byte its data starts at."""
    try:
        header, n = _header_json(fn)
        header.pop("__metadata__", None)
        for k, h in header.items():
            if h["dtype"] not in DTYPES:
                raise ValueError(f"tensor {k!r} has dtype {h['dtype']}, which glm5f does not read")
            h["shape"], h["data_offsets"] = [int(d) for d in h["shape"]], [int(o) for o in h["data_offsets"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{fn}: not a readable safetensors file ({e}); re-export or re-download it") from None
    return header, 8 + n


def read_metadata(fn: str) -> dict[str, str]:
    """The "__metadata__" strings of a safetensors file's header ({} when it has none)."""
    try:
        return _header_json(fn)[0].get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{fn}: not a readable safetensors file ({e}); delete it or write it again") from None


def read_part(f, shape: tuple[int, ...], dtype: torch.dtype, begin: int, part: tuple[slice, ...],
               dest: torch.Tensor) -> None:
    """Copy the part (one [start, stop) slice per dim) of the row-major tensor at byte `begin` of the open file f
    into dest: one read per contiguous run of its bytes, straight into dest where its dtype and layout allow."""
    direct = dest.dtype == dtype and dest.is_contiguous() and dest.device.type == "cpu"
    out = dest if direct else torch.empty([sl.stop - sl.start for sl in part], dtype=dtype)
    read_into(f, shape, begin, part, out)
    if not direct:
        dest.copy_(out)


def read_into(f, shape: tuple[int, ...], begin: int, part: tuple[slice, ...], out: torch.Tensor) -> None:
    """`read_part` into a contiguous CPU tensor of the file's dtype."""
    if out.numel() == 0:
        return
    flat = out.reshape(-1).view(torch.uint8).numpy()
    if not shape:
        runs, size = [0], out.element_size()
    else:
        k = len(shape)  # dims k.. are whole: each index of dims < k - 1 is one run over dim k - 1's slice
        while k > 1 and (part[k - 1].start, part[k - 1].stop) == (0, shape[k - 1]):
            k -= 1
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        size = (part[k - 1].stop - part[k - 1].start) * strides[k - 1] * out.element_size()
        runs = [sum(i * strides[d] for d, i in enumerate(idx)) + part[k - 1].start * strides[k - 1]
                for idx in itertools.product(*(range(sl.start, sl.stop) for sl in part[:k - 1]))]
    for n, offset in enumerate(runs):
        f.seek(begin + offset * out.element_size())
        if f.readinto(memoryview(flat)[n * size:(n + 1) * size]) != size:
            raise ValueError(f"{f.name}: the file ends inside a tensor (truncated); re-export or re-download it")


def write_safetensors(fn: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]], tensors,
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file of `entries` (key, shape, dtype), taking each tensor from the iterator `tensors`
    as its bytes are due (one at a time in memory); `metadata` (strings) joins the header's "__metadata__"."""
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for key, shape, dt in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        header[key] = {"dtype": _DTYPE_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(fn, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for (key, shape, dt), t in zip(entries, tensors):
            assert tuple(t.shape) == tuple(shape) and t.dtype == dt, (key, t.shape, t.dtype)
            if t.numel():
                f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A leaf's whole value, detached, on the CPU, contiguous (a DTensor leaf is gathered)."""
    return full_tensor(t).detach().to("cpu").contiguous()

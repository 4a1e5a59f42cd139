"""Training checkpoints: params and optimizer state through torch.distributed.checkpoint (DCP), beside them the
step, RNG states, data position and the resolved config.

Layout of a run directory: checkpoints/step_00000010/ (DCP shards, extra.pt, meta.json, manifest.json),
checkpoints/latest (the name of the newest complete checkpoint). A checkpoint is written into a temporary
directory and renamed when complete; `latest` is replaced after that; so a killed save leaves the previous
checkpoint as latest. manifest.json, written last, holds each file's size and CRC-32: a resume checks them.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from glm5f.config import GLM5Config, read_json
from glm5f.parallel import nonfinite_counts
from glm5f.params import abstract_params, flatten, map_with_path

PREFIX = "step_"
MANIFEST = "manifest.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _quiet_dcp(fn, *args, **kwargs):
    with warnings.catch_warnings():  # DCP warns that it runs without a process group, which is what we want
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save(run_dir: str, step: int, state: dict, extra: dict, meta: dict, keep: int = 3) -> str:
    """Write checkpoint `step` of `state` (a tree of tensors or DTensors; collective under torch.distributed),
    with `extra` (small tensors/ints, loaded with weights_only) and `meta` (JSON). Keeps the `keep` newest
    (keep <= 0 keeps all), so never the newest one. Refuses (ValueError, before writing anything) a state with
    NaN or inf in it: every kept checkpoint, the newest above all, is one to resume from. Returns its path.

    A save that fails (a full disk, an I/O error) or is interrupted (Ctrl-C, a signal's exception) removes its
    partial folder and leaves the previous checkpoint `latest`; an OSError becomes a SaveError (a ValueError)
    naming the cause (for a full disk: about how much was needed and how much is free); an interruption is
    re-raised as it came."""
    root = os.path.join(run_dir, "checkpoints")
    tmp = os.path.join(root, f".tmp-{PREFIX}{step:08d}")
    try:
        return _save(run_dir, step, state, extra, meta, keep)
    except BaseException as e:
        if _rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        interrupted = _behind(e, lambda x: not isinstance(x, Exception))  # Ctrl-C, a signal's stop
        if interrupted is not None and interrupted is not e:
            raise interrupted from None  # DCP wraps what a rank raised in a CheckpointException
        cause = _behind(e, lambda x: isinstance(x, OSError))
        if cause is None:
            raise
        before = latest(run_dir)
        kept = f"{before} is still the latest checkpoint" if before else "no checkpoint was written before it"
        if cause.errno == errno.ENOSPC:
            free = shutil.disk_usage(root if os.path.isdir(root) else run_dir).free
            why = f"no space left on device: {_needed(state, before)}, {_size(free)} are free there now"
            fix = "free some space (or lower --checkpoint.keep) and resume with --checkpoint.resume latest"
        else:
            why = f"{cause.strerror or cause} ({errno.errorcode.get(cause.errno, cause.errno)})"
            fix = "fix the cause and resume with --checkpoint.resume latest"
        raise SaveError(f"could not write checkpoint step {step} to {root}: {why}. The partial checkpoint was "
                        f"removed and {kept}; {fix}") from None


class SaveError(ValueError):
    """A checkpoint could not be written (the message names the cause); the previous one is kept."""


def _behind(e: BaseException, match) -> BaseException | None:
    """The exception behind `e` that `match`es: itself, one in its cause/context chain, or one a rank reported in
    a DCP CheckpointException; None when there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dcp.CheckpointException):  # a BaseException: look at what the ranks raised
            for failure in e.failures.values():
                found = _behind(failure[0] if isinstance(failure, tuple) else failure, match)
                if found is not None:
                    return found
        elif match(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def _needed(state: dict, before: str | None) -> str:
    """How much room a checkpoint of `state` takes: as much as the previous one (`before`) on disk, else the bytes
    of its tensors (whole tensors: every rank's shards, which all go to the same folder)."""
    if before is not None:
        used = sum(os.path.getsize(os.path.join(before, n)) for n in os.listdir(before))
        return f"a checkpoint takes about {_size(used)} (as {os.path.basename(before)} does)"
    tensors = sum(t.numel() * t.element_size() for t in flatten(state).values())  # a DTensor's numel is global
    return f"a checkpoint takes at least {_size(tensors)} (its tensors)"


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _save(run_dir: str, step: int, state: dict, extra: dict, meta: dict, keep: int) -> str:
    bad = list(nonfinite_counts(state))
    if bad:
        raise ValueError(f"refusing to save checkpoint {step}: non-finite values in {', '.join(bad[:3])}"
                         f"{', ...' if len(bad) > 3 else ''}; the checkpoints already in {run_dir} are kept")
    root = os.path.join(run_dir, "checkpoints")
    name = f"{PREFIX}{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    _quiet_dcp(dcp.save, state, checkpoint_id=tmp)
    if _rank() == 0:
        torch.save(extra, os.path.join(tmp, "extra.pt"))
        _write_atomic(os.path.join(tmp, "meta.json"), json.dumps({"step": step, **meta}, indent=2, default=str))
        _write_manifest(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, "latest"), name + "\n")
        _prune(root, keep, name)
    _barrier()
    return final


def _complete(root: str) -> list[str]:
    names = [n for n in os.listdir(root) if n.startswith(PREFIX)] if os.path.isdir(root) else []
    return sorted(n for n in names if os.path.isfile(os.path.join(root, n, "meta.json")))


def _prune(root: str, keep: int, newest: str) -> None:
    for n in os.listdir(root):
        if n.startswith(".tmp-") and n != f".tmp-{newest}":
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)  # left by a killed save
    if keep > 0:
        for n in _complete(root)[:-keep]:
            if n != newest:
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def remove_partial_saves(run_dir: str) -> list[str]:
    """Remove the .tmp-step_* folders a killed save left in RUN/checkpoints (call it holding the run's lock, as
    glm5f.rundir.RunLock does, so no save is running); returns a line for each one removed."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    lines = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(f".tmp-{PREFIX}") and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            lines.append(f"removed {path}: a checkpoint a previous run did not finish writing (it was stopped "
                         f"during the save)")
    return lines


def resolve(path: str) -> str:
    """A checkpoint directory, or the latest checkpoint of a run directory; FileNotFoundError naming what is
    missing otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory (expected a run directory or a checkpoint in one)")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = latest(path)
    if found is None and os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise FileNotFoundError(f"{path} is a PEFT adapter directory (adapters without their base), not a glm5f "
                                f"run or checkpoint: use the LoRA run's directory, or its merged export "
                                f"(--checkpoint.export_hf, or scripts/convert.py RUN OUT --merge-lora)")
    if found is None and os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} is a Transformers checkpoint, not a glm5f run or checkpoint: it needs no "
                                f"conversion (generate.py and --model.init_from read it as it is)")
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (neither {path}/meta.json nor "
                                f"{path}/checkpoints/{PREFIX}*/meta.json); train with --checkpoint.dir {path} first")
    return found


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run directory (by its `latest` marker), or None."""
    root = os.path.join(run_dir, "checkpoints")
    marker = os.path.join(root, "latest")
    if os.path.isfile(marker):
        with open(marker) as f:
            name = f.read().strip()
        if os.path.isfile(os.path.join(root, name, "meta.json")):
            return os.path.join(root, name)
    done = _complete(root)
    return os.path.join(root, done[-1]) if done else None


def last_line(run_dir: str) -> str:
    """Where a stopped run can go on from: its newest complete checkpoint and the flag, or that it has none."""
    found = latest(run_dir)
    return (f"the last checkpoint is {found}: resume from it with --checkpoint.resume latest" if found else
            f"no checkpoint was written in {run_dir}")


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _write_manifest(ckpt: str) -> None:
    """manifest.json: the size and CRC-32 of every file of checkpoint directory `ckpt` (all ranks' shards, read
    back from disk), written atomically after all of them."""
    names = sorted(n for n in os.listdir(ckpt) if n != MANIFEST and os.path.isfile(os.path.join(ckpt, n)))
    files = {n: {"bytes": os.path.getsize(os.path.join(ckpt, n)), "crc32": _crc32(os.path.join(ckpt, n))}
             for n in names}
    _write_atomic(os.path.join(ckpt, MANIFEST), json.dumps({"files": files}, indent=1))


def verify(path: str) -> str | None:
    """What is wrong with checkpoint `path`'s files against its manifest ('extra.pt is missing', ...); None when
    they all match, or when it has no manifest (written before manifests existed: nothing to check)."""
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return None
    try:
        files = read_json(os.path.join(path, MANIFEST), "a checkpoint manifest")["files"]
    except (ValueError, KeyError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, not the {want['bytes']} it was saved with"
        if _crc32(file) != want["crc32"]:
            return f"{name} does not match its CRC-32 in {MANIFEST} (corrupted)"
    return None


def newest_complete(root: str) -> str | None:
    """The newest checkpoint under `root` (a run's checkpoints/) whose files match its manifest, or None."""
    for name in reversed(_complete(root)):
        if verify(os.path.join(root, name)) is None:
            return os.path.join(root, name)
    return None


def _choose(run_dir: str, resume: str) -> tuple[str | None, str | None]:
    if resume == "latest":
        first = latest(run_dir)
        problem = first and verify(first)
        if not problem:
            return first, None
        good = newest_complete(os.path.dirname(first))
        if good is None:
            raise ValueError(f"checkpoint {first} is damaged ({problem}) and no other checkpoint in "
                             f"{os.path.dirname(first)} is complete: start over with --checkpoint.overwrite")
        return good, f"checkpoint {first} is damaged ({problem}): resuming from {good}, the newest complete one"
    problem = verify(resume)
    if not problem:
        return resume, None
    good = newest_complete(os.path.dirname(os.path.normpath(resume)))
    raise ValueError(f"checkpoint {resume} is damaged: {problem}. " +
                     (f"Resume from the newest complete checkpoint instead: --checkpoint.resume {good}" if good else
                      "No checkpoint beside it is complete: start over with --checkpoint.overwrite"))


def choose(run_dir: str, resume: str) -> tuple[str | None, str | None]:
    """The checkpoint --checkpoint.resume `resume` continues from (None: no checkpoint yet), checked against its
    manifest, and a line to print when 'latest' fell back to an older one. A damaged explicit checkpoint is a
    ValueError naming the bad file and the checkpoint to pass instead. Rank 0 decides, for every rank."""
    result = [None]
    if _rank() == 0:
        try:
            result[0] = _choose(run_dir, resume)
        except ValueError as e:
            result[0] = e
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], ValueError):
        raise result[0]
    return result[0]


def read_meta(path: str) -> dict:
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json): pass a checkpoint directory "
                                f"such as RUN/checkpoints/{PREFIX}00000010, or 'latest'")
    return read_json(meta_file, "the checkpoint's meta.json (step, model and run config)")


def load_params(path: str) -> tuple[GLM5Config, dict]:
    """(model config, full params) of training checkpoint `path`, in this one process whatever layout saved it
    (DCP reshards); the optimizer state is not read. Params keep the run's master dtype (fp32, fp64 in fp64 runs).
    A LoRA run's checkpoint: its base (`load_lora_base`, in the run's --lora.base_dtype) with the adapters merged."""
    meta = read_meta(path)
    if "model" not in meta:
        raise ValueError(f"{path}/meta.json has no model config: not a glm5f training checkpoint")
    problem = verify(path)
    if problem:
        good = newest_complete(os.path.dirname(os.path.normpath(path)))
        raise ValueError(f"checkpoint {path} is damaged: {problem}" +
                         (f". The newest complete checkpoint beside it is {good}" if good else ""))
    if "lora_base" in meta:
        from glm5f.lora import merge

        cfg, base = load_lora_base(path)
        spec, adapters = load_adapters(path)
        return cfg, merge(base, adapters, spec)
    cfg = GLM5Config.from_hf(meta["model"])
    master = torch.float64 if meta.get("run", {}).get("train", {}).get("dtype") == "float64" else torch.float32
    params = map_with_path(lambda p, t: torch.empty(t.shape, dtype=t.dtype), abstract_params(cfg, master))
    _quiet_dcp(dcp.load, {"params": params}, checkpoint_id=path)
    return cfg, params


def load(path: str, state: dict) -> dict:
    """Fill `state` (same tree as saved, any sharding) in place from checkpoint `path`; returns its extra."""
    read_meta(path)
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=path)
        return torch.load(os.path.join(path, "extra.pt"), weights_only=True)
    except (Exception, dcp.CheckpointException) as e:  # damaged, no manifest: DCP or torch.load fails part-way
        if isinstance(e, dcp.CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]  # (exception, stack) of the first rank that failed
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}".rstrip(": ")
        raise ValueError(f"cannot read checkpoint {path} ({why}); it may be damaged: resume from an older one in "
                         f"{os.path.dirname(os.path.normpath(path))}") from None


# ---- LoRA: adapters beside a base named by path and fingerprint ---------------------------------------------------

_MIX = (-7046029254386353131, -4658895280553007687)  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 as int64


def _leaf_fingerprint(t: torch.Tensor, block_elems: int = 1 << 22) -> torch.Tensor:
    """int64 sum (wrapping, so its order does not matter) over this rank's elements of a leaf of (the element's
    bits + 1) times a mix of its global flat index: a DTensor's shard counts at its global offset, a replica only
    on the first rank holding it, so the sum over ranks is the whole leaf's whatever the layout."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset, local = tuple(t.shape), (0,) * t.ndim, t
    if isinstance(t, DTensor):
        coord = t.device_mesh.get_coordinate()
        if any(isinstance(pl, Replicate) and c for pl, c in zip(t.placements, coord)):
            return torch.zeros((), dtype=torch.int64, device=t.to_local().device)
        _, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        local = t.to_local()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
    flat = local.contiguous().view(bits).to(torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=local.device)
    if flat.numel() == 0:
        return total
    strides = torch.empty(shape, device="meta").stride() if shape else ()
    rows = max(1, block_elems // max(1, math.prod(flat.shape[1:]))) if flat.ndim else 1
    for start in range(0, flat.shape[0] if flat.ndim else 1, rows):
        part = flat[start:start + rows] if flat.ndim else flat
        idx = torch.zeros(part.shape, dtype=torch.int64, device=part.device)
        for d in range(part.ndim):
            first = offset[d] + (start if d == 0 else 0)
            pos = torch.arange(first, first + part.shape[d], dtype=torch.int64, device=part.device) * strides[d]
            idx = idx + pos.view([-1 if e == d else 1 for e in range(part.ndim)])
        h = (idx + 1) * _MIX[0]
        h = (h ^ (h >> 31)) * _MIX[1]
        total = total + ((part + 1) * h).sum()
    return total


def fingerprint(params: dict, total=lambda t: t) -> str:
    """A hex digest of a params tree's paths, shapes, dtypes and values that does not depend on how its leaves are
    sharded (each rank hashes its shards, `total`, Layout.sum, adds them over ranks); collective."""
    flat = flatten(params)
    sums = total(torch.stack([_leaf_fingerprint(t) for t in flat.values()])) if flat else torch.zeros(0)
    head = "".join(f"{p}:{tuple(t.shape)}:{t.dtype};" for p, t in flat.items()).encode()
    digest = zlib.crc32(sums.cpu().numpy().tobytes(), zlib.crc32(head))
    return f"{digest:08x}-{len(flat)}"


def load_adapters(path: str):
    """(LoraSpec, flat adapters {"<module>.lora_A": tensor, ...}) of a LoRA run's checkpoint `path` (or a run
    directory's latest), in this one process whatever layout saved it, in the run's master dtype."""
    from glm5f.lora import LoraSpec, adapter_shapes

    path = resolve(path)
    meta = read_meta(path)
    lo = (meta.get("run") or {}).get("lora") or {}
    if not lo.get("rank") or "model" not in meta:
        raise ValueError(f"{path} is not a checkpoint of a LoRA run (its meta.json has no lora.rank): convert it "
                         f"without --peft / --merge-lora")
    spec = LoraSpec(lo["rank"], float(lo["alpha"]), float(lo["dropout"]), lo["targets"])
    cfg = GLM5Config.from_hf(meta["model"])
    master = torch.float64 if meta["run"].get("train", {}).get("dtype") == "float64" else torch.float32
    adapters = {p: torch.empty(shape, dtype=master) for p, shape in adapter_shapes(abstract_params(cfg), spec).items()}
    _quiet_dcp(dcp.load, {"adapters": adapters}, checkpoint_id=path)
    return spec, adapters



def load_lora_base(path: str) -> tuple[GLM5Config, dict]:
    """(model config, the frozen base) of a LoRA run's checkpoint `path`, rebuilt from what names it (the run's
    --model.init_from, or its preset initialised with its --train.seed) in the dtype the run stored it in, and
    checked against the fingerprint the checkpoint recorded (a ValueError when it changed)."""
    from glm5f.hf.load import load_hf
    from glm5f.params import init_params

    path = resolve(path)
    meta = read_meta(path)
    run, recorded = meta.get("run") or {}, meta.get("lora_base")
    if recorded is None:
        raise ValueError(f"{path} is not a checkpoint of a LoRA run (its meta.json names no lora_base)")
    train = run.get("train") or {}
    master = torch.float64 if train.get("dtype") == "float64" else torch.float32
    dtype = getattr(torch, (run.get("lora") or {}).get("base_dtype") or str(master).replace("torch.", ""))
    init_from = (run.get("model") or {}).get("init_from")
    cfg = GLM5Config.from_hf(meta["model"])
    if init_from:
        if not os.path.isdir(init_from):
            raise FileNotFoundError(f"{path} holds adapters for the base {init_from}, which is not there now: "
                                    f"convert where that checkpoint is")
        _, base = load_hf(init_from, dtype=dtype)
    else:
        base = init_params(cfg, train.get("seed", 0), dtype)
    found = fingerprint(base)
    if found != recorded["fingerprint"]:
        raise ValueError(f"{path} holds adapters trained on the base {recorded['source']} (fingerprint "
                         f"{recorded['fingerprint']}), but that base now has fingerprint {found}: it changed since "
                         f"the run, so the adapters do not belong to it")
    return cfg, base

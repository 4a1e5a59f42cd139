"""Training checkpoints: params and optimizer state through torch.distributed.checkpoint (DCP), beside them the
step, RNG states, data position and the resolved config.

Layout of a run directory: checkpoints/step_00000010/ (DCP shards, extra.pt, meta.json, manifest.json),
checkpoints/latest (the name of the newest complete checkpoint). A checkpoint is written into a temporary
directory and renamed when complete; `latest` is replaced after that; so a killed save leaves the previous
checkpoint as latest. manifest.json, written last, holds each file's size and CRC-32: only a checkpoint whose
files match it is resumed.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from glm5f.core.config import GLM5Config, read_json
from glm5f.parallel.layout import nonfinite_counts
from glm5f.core.params import abstract_params, flatten, map_with_path

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
    glm5f.run.rundir.RunLock does, so no save is running); returns a line for each one removed."""
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
    done = _complete(os.path.join(path, "checkpoints"))  # load_params says why one without a manifest is refused
    found = latest(path) or (os.path.join(path, "checkpoints", done[-1]) if done else None)
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


def _marked(root: str) -> str | None:
    """The checkpoint name the `latest` marker of `root` (a run's checkpoints/) holds, or None."""
    marker = os.path.join(root, "latest")
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return f.read().strip()


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run directory (the one its `latest` marker names, else the newest by
    step) that has a manifest, or None. Its files are not read here: `verify` (which `choose` and `load_params`
    call) checks them against the manifest."""
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in _complete(root) if os.path.isfile(os.path.join(root, n, MANIFEST))]
    marked = _marked(root)
    if marked in names:
        return os.path.join(root, marked)
    return os.path.join(root, names[-1]) if names else None


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


NO_MANIFEST = (f"it has no {MANIFEST} to check its files against: it was written before checkpoints had manifests, "
               f"or copied without it")


def verify(path: str) -> str | None:
    """What makes checkpoint `path` untrustworthy ('extra.pt is missing', a size or CRC-32 that differs from its
    manifest, NO_MANIFEST when it has none); None only when every file matches its manifest."""
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return NO_MANIFEST
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


def _state(problem: str) -> str:
    """How a checkpoint with `problem` (from `verify`) is described: unverified or damaged."""
    return f"cannot be verified ({problem})" if problem == NO_MANIFEST else f"is damaged ({problem})"


def newest_complete(root: str) -> str | None:
    """The newest checkpoint under `root` (a run's checkpoints/) that `verify` passes, or None."""
    for name in reversed(_complete(root)):
        if verify(os.path.join(root, name)) is None:
            return os.path.join(root, name)
    return None


def _choose(run_dir: str, resume: str, trust_unverified: bool) -> tuple[str | None, str | None]:
    unverified_ok = (lambda problem: trust_unverified and problem == NO_MANIFEST)
    trusted = (f"resuming from {{}} unchecked: it has no {MANIFEST} (--checkpoint.trust_unverified); the "
               f"checkpoints this run writes have one")
    if resume == "latest":
        root = os.path.join(run_dir, "checkpoints")
        names = _complete(root)
        if not names:
            return None, None
        marked = _marked(root)
        order = ([marked] if marked in names else []) + [n for n in reversed(names) if n != marked]
        skipped = []
        for name in order:
            path = os.path.join(root, name)
            problem = verify(path)
            if problem is None or unverified_ok(problem):
                note = trusted.format(path) if problem else None
                if skipped:
                    why = "; ".join(f"checkpoint {p} {_state(q)}" for p, q in skipped)
                    note = f"{why}: resuming from {path}, the newest {'usable' if problem else 'verified'} one" + \
                        (f" ({note})" if note else "")
                return path, note
            skipped.append((path, problem))
        first, problem = skipped[0]
        fix = (f"if you trust it, resume it with --checkpoint.resume {first} --checkpoint.trust_unverified, or start "
               f"over with --checkpoint.overwrite" if problem == NO_MANIFEST else
               "start over with --checkpoint.overwrite")
        others = "no other checkpoint" if len(skipped) == 1 else f"none of the {len(skipped) - 1} older ones"
        raise ValueError(f"checkpoint {first} {_state(problem)} and {others} in {root} can be verified: {fix}")
    problem = verify(resume)
    if problem is None:
        return resume, None
    if unverified_ok(problem):
        return resume, trusted.format(resume)
    good = newest_complete(os.path.dirname(os.path.normpath(resume)))
    instead = (f"Resume from the newest verified checkpoint instead: --checkpoint.resume {good}" if good else
               "No checkpoint beside it can be verified: start over with --checkpoint.overwrite")
    if problem == NO_MANIFEST:
        instead = f"If you trust it, resume it unchecked with --checkpoint.trust_unverified. {instead}"
    raise ValueError(f"checkpoint {resume} {_state(problem)}. {instead}")


def choose(run_dir: str, resume: str, trust_unverified: bool = False) -> tuple[str | None, str | None]:
    """The checkpoint --checkpoint.resume `resume` continues from (None: no checkpoint yet) and a line to print
    about it (None: nothing to say). Only a checkpoint that `verify` passes is taken: 'latest' falls back from a
    damaged or unverifiable one to the newest verified one, saying which and why; an explicit one that fails is a
    ValueError naming what is wrong and what to pass instead. `trust_unverified` (--checkpoint.trust_unverified)
    takes a checkpoint without a manifest (one written before manifests existed) unchecked, never a damaged one.
    Rank 0 decides, for every rank."""
    result = [None]
    if _rank() == 0:
        try:
            result[0] = _choose(run_dir, resume, trust_unverified)
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
        fix = f". The newest verified checkpoint beside it is {good}" if good else ""
        if problem == NO_MANIFEST:
            run = os.path.dirname(os.path.dirname(os.path.normpath(path)))
            fix += (f". If you trust it, export it through train.py, which can take it unchecked: python train.py "
                    f"--config {os.path.join(run, 'config.yaml')} --checkpoint.resume {path} "
                    f"--checkpoint.trust_unverified --train.steps {meta.get('step')} --checkpoint.export_hf OUT")
        raise ValueError(f"checkpoint {path} {_state(problem)}{fix}")
    if "lora_base" in meta:
        from glm5f.model.lora import merge

        cfg, base = load_lora_base(path)
        spec, adapters = load_adapters(path)
        return cfg, merge(base, adapters, spec)
    cfg = GLM5Config.from_hf(meta["model"])
    master = torch.float64 if meta.get("run", {}).get("train", {}).get("dtype") == "float64" else torch.float32
    params = map_with_path(lambda p, t: torch.empty(t.shape, dtype=t.dtype), abstract_params(cfg, master))
    _quiet_dcp(dcp.load, {"params": params}, checkpoint_id=path)
    return cfg, params


def read_extra(path: str) -> dict:
    """Checkpoint `path`'s extra (what `save` got as `extra`)."""
    return torch.load(os.path.join(path, "extra.pt"), weights_only=True)


def load(path: str, state: dict) -> dict:
    """Fill `state` (same tree as saved, any sharding) in place from checkpoint `path` (one `choose` took);
    returns its extra. A checkpoint whose files do not read back (damaged past what its manifest could catch, or
    taken unverified) is a ValueError saying so, not the reader's own advice."""
    read_meta(path)
    try:
        _quiet_dcp(dcp.load, state, checkpoint_id=path)
        return read_extra(path)
    except (Exception, dcp.CheckpointException) as e:  # damaged, no manifest: DCP or torch.load fails part-way
        if isinstance(e, dcp.CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]  # (exception, stack) of the first rank that failed
        first = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e) or "Weights only" in first:
            why = "its data does not unpickle: the bytes of a file were changed after it was saved"
        else:  # a key or shape that does not fit, a short read: torch's first line names it
            why = f"{type(e).__name__}: {first[:200]}".rstrip(": ")
        raise ValueError(f"cannot read checkpoint {path}: {why}. It is damaged (or not this run's): resume from an "
                         f"older one in {os.path.dirname(os.path.normpath(path))}") from None


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
    from glm5f.model.lora import LoraSpec, adapter_shapes

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
    from glm5f.ckpt.hf.load import load_hf
    from glm5f.core.params import init_params

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

"""What a run or a script checks before it allocates anything or starts a process: the memory it will hold against
what the machine has available, its local processes against the cores, and the files its ranks would read.

A check refuses only what cannot fit: the figure it compares is a lower bound of the memory plan's (glm5f.run.plan:
`least_total`, the plan's state and update lines exactly and the activations every layer keeps), and it refuses
only past `MARGIN` times the memory available, so a run the plan says fits is never refused.
"""

from __future__ import annotations

import os

import torch

from glm5f.data.chat import resolve_tokenizer
from glm5f.ckpt.checkpoint import read_meta
from glm5f.core.config import GLM5Config
from glm5f.data.files import open_reader
from glm5f.data.readers import DatasetReader, load_batches
from glm5f.model.decode import init_cache
from glm5f.train.optim import make_optimizer
from glm5f.core.params import abstract_params, flatten
from glm5f.run.plan import GB, least_total, process_rss_bytes, run_shape

MARGIN = 1.25  # refuse past 1.25 x what is available: the plan's figures are within 20% of the peaks measured
PROCESSES_PER_CORE = 8  # more local processes than this many a CPU core only take turns on it

# cgroup v2, then v1: (the limit, what is charged now, memory.stat's line of reclaimable page cache)
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                 "total_inactive_file"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max" (no limit)
        return None


def cgroup_room() -> int | None:
    """Bytes this process's cgroup may still charge before its memory limit (its reclaimable page cache counted as
    free, as MemAvailable counts it); None without a limit."""
    for limit_file, usage_file, cache_line in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 says "no limit" with a huge number
            continue
        cache = 0
        try:
            with open(os.path.join(os.path.dirname(usage_file), "memory.stat")) as f:
                cache = next((int(line.split()[1]) for line in f if line.split()[0] == cache_line), 0)
        except (OSError, ValueError, IndexError):
            pass
        return max(0, limit - usage + cache)
    return None


def host_available() -> tuple[int | None, str]:
    """(bytes of host memory a new allocation can take now, where the figure comes from): /proc/meminfo's
    MemAvailable (free memory plus the page cache it can drop), or the room under this process's cgroup memory
    limit where that is less; (None, why) where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.strip()}
    except (OSError, ValueError, IndexError):
        meminfo = {}
    found = meminfo.get("MemAvailable")
    room = cgroup_room()
    if room is not None and (found is None or room < found):
        return room, "the room under this process's cgroup memory limit"
    return found, "MemAvailable in /proc/meminfo" if found is not None else "no /proc/meminfo"


def available_memory(device: torch.device, opened: bool = True) -> tuple[int | None, str]:
    """(bytes `device` can still allocate, where the figure comes from): on the CPU `host_available`; on a GPU its
    free memory (torch.cuda.mem_get_info, which opens the GPU in this process: `opened`), or, not `opened`, its
    total memory (for a launcher whose workers will use it); None on other devices."""
    if device.type == "cpu":
        return host_available()
    if device.type == "cuda" and opened:
        return torch.cuda.mem_get_info(device)[0], f"free memory of {device} (torch.cuda.mem_get_info)"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"total memory of {device}"
    return None, f"no memory figure for {device.type}"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or a launcher's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def size(n: int) -> str:
    """Bytes as decimal GB (as the memory plan counts them), or MB under a tenth of a GB."""
    return f"{n / GB:,.2f} GB" if n >= GB / 10 else f"{n / 10**6:,.1f} MB"


def check_fits(need: int, device: torch.device, what: str, parts: str, fix: str, opened: bool = True) -> None:
    """A ValueError, one line, when `need` bytes on `device` are past MARGIN x what it has available
    (`available_memory`): what needs them (`what`: the subject and its verb, e.g. "this run needs"), the figure and
    its `parts`, the limit and where it comes from, and `fix`; nothing when the device gives no figure."""
    available, source = available_memory(device, opened)
    if available is not None and need > MARGIN * available:
        raise ValueError(f"{what} at least {size(need)} ({parts}), but {device} has {size(available)} "
                         f"available ({source}); {fix}")


def run_need(cfg, model_cfg: GLM5Config, local: int, spawned: bool) -> tuple[int, tuple[str, str], dict]:
    """(bytes the `local` ranks of train.py `Config` `cfg` on this machine need at least, what needs them and
    their parts for `check_fits`, one rank's `plan.least_total`): per rank the lower bound of its memory plan (for
    preset_pt data, whose batches' shapes are the file's, without activations), and for each process still to be
    `spawned` the runtime this one holds now (a worker imports what it imports)."""
    least = least_total(model_cfg, run_shape(cfg), make_optimizer(cfg.optim, model_cfg),
                        activations=cfg.data.type != "preset_pt")
    runtime = process_rss_bytes() if spawned else 0
    per_rank = least["total"] + runtime
    parts = (f"{size(least['update'])} of parameters, gradients and optimizer state in the update, "
             f"{size(least['activations'])} of activations every layer keeps for the backward"
             + (f", {size(runtime)} of runtime a process" if spawned else ""))
    who = (f"the {local} local ranks need", f"{size(per_rank)} each: {parts}") if local > 1 else \
        ("this run needs", parts)
    return local * per_rank, who, least


def check_run(cfg, device: torch.device, local: int, spawned: bool, rank: int = 0,
              flag: str = "--train.skip_memory_check") -> None:
    """Before a train.py run allocates anything or starts a process: a ValueError when the `local` ranks of
    `Config` `cfg` on this machine (started by this process when `spawned`, else this process is local rank
    `rank`) need more memory than `device` has available, or are more than PROCESSES_PER_CORE a CPU core. On a
    GPU each rank has its own: one rank's need against its GPU's free memory (its total, for spawned ranks)."""
    model_cfg = GLM5Config.from_hf(cfg.model.init_from) if cfg.model.init_from else cfg.model.build()
    on_host = device.type == "cpu"
    cores = usable_cores()
    if local > PROCESSES_PER_CORE * cores:
        raise ValueError(f"--parallel.dp_shard x --parallel.cp = {cfg.parallel.world} ranks would run {local} "
                         f"processes on this machine, which has {cores} CPU core(s) (more than "
                         f"{PROCESSES_PER_CORE} a core only take turns): spread them over machines (torchrun "
                         f"--nnodes N --nproc_per_node {cores}) or lower --parallel.dp_shard / --parallel.cp; {flag} "
                         f"starts them anyway")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0 if spawned else rank)
    ranks = local if on_host else 1  # on a GPU each rank has its own
    need, who, least = run_need(cfg, model_cfg, ranks, spawned and on_host)
    state, acts = least["update"], least["activations"]
    if acts > state:
        fix = ("lower --data.batch_size or --data.seq_len, raise --train.grad_accum, turn on "
               "--train.activation_checkpointing, or split the sequence over more ranks (--parallel.cp)")
    elif need > 2 * ranks * state:  # the processes' runtime more than their state: fewer on this machine
        fix = "start fewer ranks on this machine: spread them over machines (torchrun --nnodes N)"
    else:
        fix = ("shard it over more ranks or machines (`python train.py --plan search --parallel.device_memory_gb GB` "
               "with these flags lists the meshes that fit GB a device), train LoRA adapters (--lora.rank 16 "
               "--lora.base_dtype bfloat16) or a smaller model")
    check_fits(need, device, *who, f"{fix}; `python train.py --plan table` with these flags shows where the memory "
                                  f"goes; {flag} starts it anyway", opened=not spawned)


def check_inputs(cfg) -> None:
    """The files the ranks of train.py `Config` `cfg` would read first, opened here (in the launching process,
    before any rank starts): the tokenizer and chat template (`chat.resolve_tokenizer`), --data.path and
    --eval.path with the reader of their data type; each problem is the error the rank would raise."""
    resolve_tokenizer(cfg.model.tokenizer_path, cfg.model.init_from, cfg.data.chat_template)
    d = cfg.data
    open_data(d.type, d.path, d.split)
    if cfg.eval.path is not None:
        try:  # make_eval_source reads --eval.path as JSONL for text and synthetic runs
            open_data("json_file" if d.type in ("text", "synthetic") else d.type, cfg.eval.path, cfg.eval.split)
        except FileNotFoundError as e:  # the readers name the training flag
            raise FileNotFoundError(str(e).replace("--data.path", "--eval.path")) from None


def open_data(kind: str, path: str | None, split: str | None) -> None:
    """Open `path` as --data.type `kind` reads it (its reader's error when it cannot), reading no record."""
    if path is None:
        return
    if kind in ("json_file", "chat"):
        open_reader(path)
    elif kind == "hf_datasets":
        DatasetReader(path, split)
    elif kind == "preset_pt":
        load_batches(path)


def weight_bytes(cfg: GLM5Config, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in `dtype` (the router and indexer heads in fp32 whatever it is)."""
    return sum(t.nbytes for t in flatten(abstract_params(cfg, dtype)).values())


def cache_bytes(cfg: GLM5Config, batch: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of the decode cache of `batch` rows and `capacity` positions (`decode.init_cache`)."""
    cache = init_cache(cfg, batch, capacity, dtype, "meta")
    return sum(t.nbytes for layer in cache.layers for t in layer.values())


def checkpoint_weights(path: str) -> tuple[GLM5Config, torch.dtype]:
    """(model config, the dtype its weights load in) of train.py checkpoint `path`, from its meta.json alone: as
    `checkpoint.load_params` holds them, in the run's master dtype (fp64 in fp64 runs, else fp32), a LoRA run's
    base in its --lora.base_dtype."""
    meta = read_meta(path)
    if "model" not in meta:
        raise ValueError(f"{path}/meta.json has no model config: not a glm5f training checkpoint")
    run = meta.get("run") or {}
    master = "float64" if (run.get("train") or {}).get("dtype") == "float64" else "float32"
    base = (run.get("lora") or {}).get("base_dtype") if "lora_base" in meta else None
    return GLM5Config.from_hf(meta["model"]), getattr(torch, base or master)

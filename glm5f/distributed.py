"""Several processes: FSDP/DP, context parallelism (CP) and expert parallelism (EP) as explicit DTensor specs.

The spec of each leaf comes from the one table of what each leaf is, `params.LEAF_KINDS`, which names the logical
axis of each of its dims (embed, heads, mlp, experts, ...); `MESH_RULES` maps logical axes to mesh axes, and
`placements` derives the leaf's DTensor placements from them. Layer code never names a mesh axis.

Meshes: "fsdp" is every rank (world = dp_shard x cp); "dp" x "cp" splits the world for the data; "edp" x "ep"
splits it for experts (ep consecutive ranks share one copy of all experts, each owning n_routed_experts / ep).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from einops import rearrange, repeat
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from glm5f import preempt
from glm5f.params import Region, leaf_kind, map_with_path
from glm5f.parallel import Layout

# Logical axis -> the mesh axes that may shard it, in order: each dim of a leaf takes the first of its axis's mesh
# axes that no earlier dim took. "fsdp": stored sharded, gathered for the forward, the gradient reduce-scattered
# (over every rank; on a leaf with an "ep" dim, over the edp ranks sharing one copy of its experts). "ep": the
# routed experts, stored and computed sharded (each rank runs its own experts).
MESH_RULES = {
    "experts": ("ep",),
    "vocab": ("fsdp",), "embed": ("fsdp",), "heads": ("fsdp",), "mlp": ("fsdp",), "router": ("fsdp",),
    "q_lora": ("fsdp",), "kv_lora": ("fsdp",), "latent": ("fsdp",),
    "index_heads": ("fsdp",), "index_dim": ("fsdp",),
    "lora_rank": (),  # a LoRA factor's rank dim: small, replicated; its other dims shard as its weight's
    # GLM-5.3: KDA heads (x head dim) and head dim; the small mHC mixing rows, short-convolution taps and pool
    # positions stay replicated
    "linear_heads": ("fsdp",), "linear_dim": ("fsdp",), "hc": (), "conv": (), "pool": (),
}
GATHERED = ("fsdp",)  # the mesh axes a leaf is gathered over for the forward


class Spec(NamedTuple):
    """How one parameter is laid out: its mesh, its placements as stored, as gathered for the forward, and the
    placements its gradient arrives in from the gathered (local) tensor."""

    mesh: DeviceMesh
    stored: list
    gathered: list
    grads: list


@functools.lru_cache(maxsize=None)
def placements(axes: tuple[str, ...]) -> tuple[str, list, list, list]:
    """(mesh name, placements as stored, as gathered for the forward, of the gathered tensor's gradient) of a leaf
    whose dims have the logical `axes` (its `params.LEAF_KINDS` entry), by MESH_RULES. A leaf with an "ep" dim
    lives on the "experts" mesh (edp x ep: its fsdp shard is over edp), any other on "fsdp" (every rank)."""
    taken: dict[str, int] = {}  # mesh axis -> the dim it shards
    for dim, axis in enumerate(axes):
        if axis not in MESH_RULES:
            raise ValueError(f"the logical axis {axis!r} has no row in distributed.MESH_RULES: add one")
        mesh_axis = next((m for m in MESH_RULES[axis] if m not in taken), None)
        if mesh_axis is not None:
            taken[mesh_axis] = dim
    mesh, mesh_axes = ("experts", ("fsdp", "ep")) if "ep" in taken else ("fsdp", ("fsdp",))
    stored = [Shard(taken[m]) if m in taken else Replicate() for m in mesh_axes]
    gathered = [Replicate() if m in GATHERED else pl for m, pl in zip(mesh_axes, stored)]
    grads = [Partial() if m in GATHERED else pl for m, pl in zip(mesh_axes, stored)]
    return mesh, stored, gathered, grads


def cp_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Sequence indices held by CP rank `rank`: chunks rank and 2cp-1-rank of 2cp equal chunks (each rank gets
    an equal share of the causal attention work)."""
    return torch.tensor(cp_position_list(seq_len, cp, rank))


def cp_position_list(seq_len: int, cp: int, rank: int) -> list[int]:
    """`cp_positions` as host integers."""
    c = seq_len // (2 * cp)
    return [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def mesh_shapes(dp_shard: int, cp: int, ep: int) -> dict[str, tuple[int, ...]]:
    """The shape of each named mesh of a dp_shard x cp run with ep expert ranks (what DistLayout builds; the
    memory plan reads it to size shards without a process group)."""
    world = dp_shard * cp
    return {"fsdp": (world,), "data": (dp_shard, cp), "experts": (world // ep, ep)}


class DistLayout(Layout):
    """A rank of dp_shard x cp processes (torch.distributed already initialised), with ep expert groups."""

    def __init__(self, dp_shard: int, cp: int, ep: int, device: torch.device):
        self.device, self.dp, self.cp, self.ep = device, dp_shard, cp, ep
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.is_main = self.rank == 0
        kind = device.type
        shapes = mesh_shapes(dp_shard, cp, ep)
        self.meshes = {"fsdp": init_device_mesh(kind, shapes["fsdp"], mesh_dim_names=("fsdp",)),
                       "data": init_device_mesh(kind, shapes["data"], mesh_dim_names=("dp", "cp")),
                       "experts": init_device_mesh(kind, shapes["experts"], mesh_dim_names=("edp", "ep"))}
        # A flattened ("edp_ep") view lets DTensor reduce over both expert dims in one all_reduce (the gradient
        # norm of an expert leaf) instead of two in a row, which it warns about on every rank.
        self.meshes["experts"]._flatten("edp_ep")
        self.dp_rank, self.cp_rank = divmod(self.rank, cp)
        self.cp_group = self.meshes["data"].get_group("cp")
        self.ep_group = self.meshes["experts"].get_group("ep")
        self.stall_watch: StallWatch | None = None

    def step_done(self, step: int) -> None:
        if self.stall_watch is not None:
            self.stall_watch.step_done(step)

    # ---- parameters
    def param_specs(self, params: dict, prefix: str = "") -> dict:
        """The spec tree: for each leaf of `params` (the subtree at dotted path `prefix`), its Spec (mesh, stored /
        gathered / gradient placements)."""
        return map_with_path(lambda path, _: self._spec(f"{prefix}.{path}" if prefix else path), params)

    def _spec(self, path: str) -> Spec:
        """The Spec of the leaf at dotted `path`, from its logical axes."""
        mesh, stored, gathered, grads = placements(leaf_kind(path).axes)
        return Spec(self.meshes[mesh], stored, gathered, grads)

    def local_params(self, make: Callable[[Region], dict]) -> dict:
        """Params made rank-locally: `make(region)` builds only the part `region(path, shape)` of each leaf (its
        rank's shard: FSDP rows, its EP experts), e.g. `init_params(..., region=region)` or
        `load_hf(..., region=region)`; they become the DTensors `shard_params` would. No rank holds the whole
        model."""
        shapes = {}

        def region(path, shape):
            s = self._spec(path)
            shapes[path] = torch.Size(shape)
            size, offset = compute_local_shape_and_global_offset(shape, s.mesh, s.stored)
            return tuple(slice(o, o + n) for o, n in zip(offset, size))

        def wrap(path, t):
            s = self._spec(path)
            return DTensor.from_local(t, s.mesh, s.stored, run_check=False, shape=shapes[path],
                                      stride=torch.empty(shapes[path], device="meta").stride())
        return map_with_path(wrap, make(region))

    def shard_params(self, params: dict) -> dict:
        return map_with_path(lambda path, t, s: distribute_tensor(t.to(self.device), s.mesh, s.stored),
                             params, self.param_specs(params), is_leaf=lambda x: isinstance(x, Spec))

    def gather(self, tree: dict, prefix: str = "") -> dict:
        def gather(path, t, s):
            return t.redistribute(s.mesh, s.gathered).to_local(grad_placements=s.grads)
        return map_with_path(gather, tree, self.param_specs(tree, prefix), is_leaf=lambda x: isinstance(x, Spec))

    def sum(self, t: torch.Tensor, group=None) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=group)
        return t

    def seq_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.cp == 1 else self.sum(t, self.cp_group)

    # ---- data
    def share(self, B: int, S: int) -> tuple[slice, torch.Tensor | None]:
        rows = slice(self.dp_rank * B // self.dp, (self.dp_rank + 1) * B // self.dp)
        return rows, None if self.cp == 1 else cp_positions(S, self.cp, self.cp_rank)

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's keys over the CP group into global sequence order (gradients flow back)."""
        return self._in_order(local)

    def chunks(self, local: torch.Tensor) -> torch.Tensor:
        return self._in_order(local)

    def _in_order(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's [B, S, ...] of the positions `share` gives it, all-gathered over the CP group into the
        [B, S cp, ...] of the whole sequence in order (gradients flow back)."""
        if self.cp == 1:
            return local
        held = torch.cat([cp_positions(local.shape[1] * self.cp, self.cp, r) for r in range(self.cp)])
        parts = funcol.all_gather_single_autograd(local.contiguous(), gather_dim=1, group=self.cp_group)
        return funcol.wait_tensor(parts).index_select(1, torch.argsort(held).to(local.device))

    # ---- experts
    def experts(self, p: dict, x_MxD: torch.Tensor, counts_E: torch.Tensor, ffn: Callable) -> torch.Tensor:
        """Rows sorted by expert go to the rank owning their expert, are computed there grouped, and come back
        in the same order (all-to-all both ways, differentiable)."""
        if self.ep == 1:
            return ffn(p, x_MxD, counts_E)
        ep, group = self.ep, self.ep_group
        # rows for each (destination rank, its local expert) and what every source sends us
        send_counts_RxE = rearrange(counts_E, "(r e) -> r e", r=ep)
        recv_counts_RxE = torch.empty_like(send_counts_RxE)
        dist.all_to_all_single(recv_counts_RxE, send_counts_RxE.contiguous(), group=group)
        send_splits = send_counts_RxE.sum(1).tolist()
        recv_splits = recv_counts_RxE.sum(1).tolist()
        rows = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_MxD.contiguous(), recv_splits, send_splits,
                                                                    group))
        # received rows come grouped by source rank, then by expert: regroup by expert for the grouped GEMM
        local_expert_RxE = repeat(torch.arange(recv_counts_RxE.shape[1], device=rows.device), "e -> r e", r=ep)
        expert_of_row = torch.repeat_interleave(local_expert_RxE.flatten(), recv_counts_RxE.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        y_sorted = ffn(p, rows.index_select(0, order), recv_counts_RxE.sum(0))
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(y, send_splits, recv_splits, group))


# ---- launch -------------------------------------------------------------------------------------------------------

def backend_for(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def check_device(device: torch.device, flag: str = "--device") -> torch.device:
    """`device`, or a ValueError saying it is not there (cuda without a GPU or a CUDA build of torch, npu without
    torch_npu's device) and what to pass instead."""
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"{flag} {device} asks for a GPU, but {why}; pass {flag} cpu (or auto), or run where "
                         f"a GPU is visible (CUDA_VISIBLE_DEVICES, a CUDA build of torch)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {device}: there are only {torch.cuda.device_count()} GPUs (cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1})")
    return device


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_process(device: torch.device, timeout_s: int = 600) -> torch.device:
    """Join the process group described by the environment (torchrun's variables); returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type == "npu":
        device = torch.device("npu", local_rank)
        torch.npu.set_device(device)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type != "cpu" else None)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when its launcher dies, even by SIGKILL: the kernel's parent-death signal on Linux, and a
    thread that exits once the parent pid changes (elsewhere, or if the parent died before prctl took effect)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _worker(local_rank: int, world: int, port: int, fn, args, parent_pid: int | None = None,
            report_dir: str | None = None):
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        _run_worker(local_rank, fn, args, report_dir)
    except SystemExit as e:  # a stop (a signal, an error the launcher reports): its code, and nothing more
        if not isinstance(e.code, int):
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code)  # not through torch's C++ teardown, which warns of the collective the stop left unwaited


def _run_worker(local_rank: int, fn, args, report_dir: str | None) -> None:
    try:
        fn(*args)
    except SystemExit:  # a stop with its exit code
        raise
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) or preempt.interrupted():  # Ctrl-C, or a peer that stopped on it:
            raise SystemExit(preempt.SIGNAL_EXIT[signal.SIGINT]) from None  # the launcher says it, once
        if isinstance(e, preempt.StopNow) or preempt.stopped_now():  # a second SIGTERM, or a peer that stopped
            raise SystemExit(preempt.SIGNAL_EXIT[signal.SIGTERM]) from None
        if isinstance(e, ValueError) and report_dir is not None:  # a message for the user: the launcher says it
            with open(os.path.join(report_dir, str(local_rank)), "w") as f:
                f.write(str(e))
            raise SystemExit(REPORTED_EXIT) from None
        if report_dir is not None and os.listdir(report_dir):  # a peer reported an error and stopped first
            raise SystemExit(REPORTED_EXIT) from None
        timeout = collective_timeout(e)
        if timeout:
            print(f"error: [rank {local_rank}] {timeout}", file=sys.stderr, flush=True)
            raise SystemExit(TIMEOUT_EXIT) from None
        print(f"[rank {local_rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


TIMEOUT_EXIT = 124  # a worker's exit code after a collective timed out (collective_timeout)
REPORTED_EXIT = 3  # a worker's exit code after it reported an error for the user (a ValueError) to the launcher


class RankError(ValueError):
    """An error for the user (a ValueError: bad input, a failed save) that a worker of `spawn` reported: the
    launcher raises it once, with the message of the lowest rank that reported one, and no traceback."""


def collective_timeout(e: BaseException) -> str | None:
    """For a collective that timed out waiting for another rank (gloo's and NCCL's timeout errors): a line naming
    the rank that stopped answering when the error says it, the run directory's last checkpoint and what to do;
    None for any other error."""
    import re

    text = str(e)
    if not re.search(r"[Tt]imed out|[Tt]imeout|DistBackendError", text + type(e).__name__):
        return None
    found = re.search(r"(?:from|to|peer|rank)[ :]+(\d+)", text)
    who = f"rank {found.group(1)} stopped answering" if found else "another rank stopped answering"
    return (f"a collective timed out after --parallel.timeout_s: {who} (hung, stopped or dead; "
            f"{text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__})")


def _wait_stopping(processes) -> int | None:
    """Wait while the workers run or stop together on a signal (exit codes 130/143, see glm5f.preempt); the
    stop's exit code once all have stopped so, None as soon as one fails otherwise (or all end with 0), for
    ProcessContext.join to handle (which stops the others at once)."""
    from multiprocessing.connection import wait

    while True:
        codes = [p.exitcode for p in processes]
        if any(c not in (None, 0, 130, 143) for c in codes):
            return None
        if all(c is not None for c in codes):
            return max(codes) if any(codes) else None
        wait([p.sentinel for p, c in zip(processes, codes) if c is None], timeout=1.0)


def _stop_workers(processes, signum: int, wait_s: float = 60.0) -> None:
    """Send `signum` to the workers still running (one that already got it from the terminal ignores it) and wait
    up to `wait_s` for them to end; SIGKILL the ones that do not."""
    for p in processes:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(p.pid, signum)
    _join_or_kill(processes, wait_s)


def _join_or_kill(processes, wait_s: float) -> None:
    """Wait up to `wait_s` in all for the processes to end; SIGKILL the ones that do not."""
    deadline = time.monotonic() + wait_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _silent_after_timeout(processes, grace_s: float = 5.0) -> list[int]:
    """When a worker ended on a collective timeout (TIMEOUT_EXIT): the workers still running `grace_s` later, the
    ones that stopped answering (killed now); [] otherwise."""
    if not any(p.exitcode == TIMEOUT_EXIT for p in processes):
        return []
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    silent = [i for i, p in enumerate(processes) if p.exitcode is None]
    for i in silent:
        os.kill(processes[i].pid, signal.SIGKILL)
        processes[i].join()
    return silent


class StallWatch:
    """While a multi-process run trains: every rank's thread beats (a counter in the process group's store) every
    `beat_s` seconds (2, or a 20th of the timeout); when this rank's step has run longer than half of `timeout_s`
    (the collective timeout) and three times its longest step so far, the lowest rank still beating prints one
    line naming the ranks whose beat stopped (a rank hung, stopped or dead makes the others' collectives wait for
    it), before the timeout stops the run. The first step (compiling, warming up) is not watched. A context
    manager: the thread ends and is joined on exit, before the process group (and its store) is destroyed; a
    thread still inside a store call then would abort the process."""

    def __init__(self, timeout_s: float):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.timeout_s, self.beat_s = timeout_s, min(2.0, timeout_s / 20)
        self.step, self.since, self.longest, self.said = 0, time.monotonic(), 0.0, False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="stall-watch")

    def __enter__(self) -> "StallWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.beat_s + 30)  # a store call in flight ends within the store's own timeout

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        self.longest = max(self.longest, now - self.since) if self.step else 0.0
        self.step, self.since, self.said = step, now, False

    def _beats(self) -> list[int]:
        return [int(self.store.add(f"glm5f/beat/{r}", 0)) for r in range(self.world)]

    def _watch(self) -> None:
        try:
            while not self.stopping.is_set():
                self.store.add(f"glm5f/beat/{self.rank}", 1)
                if self.stopping.wait(self.beat_s):
                    return
                waited = time.monotonic() - self.since
                if self.said or not self.step or waited < max(self.timeout_s / 2, 3 * self.longest):
                    continue
                before = self._beats()
                for _ in range(3):  # long enough for every live rank to beat at least once
                    self.store.add(f"glm5f/beat/{self.rank}", 1)
                    if self.stopping.wait(self.beat_s):
                        return
                silent = [r for r, (a, b) in enumerate(zip(before, self._beats())) if a == b]
                answering = [r for r in range(self.world) if r not in silent]
                self.said = True
                if answering and self.rank == min(answering) and time.monotonic() - self.since < self.timeout_s:
                    who = (f"rank(s) {', '.join(map(str, silent))} stopped answering (hung, stopped or dead)" if silent
                           else "every rank is alive (waiting in different collectives, or a step this slow)")
                    print(f"warning: step {self.step + 1} has run {waited:.0f} s, more than half of "
                          f"--parallel.timeout_s {self.timeout_s}: {who}; at {self.timeout_s} s of waiting the run "
                          f"stops", file=sys.stderr, flush=True)
        except Exception:  # the store went away (the run is ending): nothing left to watch
            return


def silent_ranks(grace_s: float = 5.0) -> tuple[list[int], list[int]] | None:
    """After a collective timed out in this rank (under torchrun, where no launcher of ours watches the ranks):
    (the ranks whose collective timed out too within `grace_s`, the others: those that stopped answering), told
    through the process group's store; None when the store does not answer either."""
    rank, world = dist.get_rank(), dist.get_world_size()
    key = "glm5f/timed_out/{}".format
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(key(rank), "1")
        deadline = time.monotonic() + grace_s
        while True:
            answered = [r for r in range(world) if store.check([key(r)])]
            if len(answered) == world or time.monotonic() > deadline:
                return answered, [r for r in range(world) if r not in answered]
            time.sleep(0.2)
    except (RuntimeError, ValueError):  # DistStoreError, a store that has gone
        return None


def _reported_error(processes, report_dir: str, grace_s: float = 10.0) -> RankError | None:
    """When a worker ended reporting an error (REPORTED_EXIT): the others get `grace_s` to end as well (they
    usually meet the same error, or the collective of the one that left), then are killed; the RankError of the
    lowest rank that reported. None when no worker reported one."""
    if not any(p.exitcode == REPORTED_EXIT for p in processes):
        return None
    _join_or_kill(processes, grace_s)
    first = min(os.listdir(report_dir), key=int)
    with open(os.path.join(report_dir, first)) as f:
        return RankError(f.read())


class WorkerFailure(RuntimeError):
    """A worker process of a multi-process run failed or died (the others were stopped)."""


def spawn(fn, world: int, *args) -> None:
    """Run fn(*args) in `world` local processes joined into one process group. If any worker fails or dies,
    the others are stopped and this raises: a RankError with the message of a worker's ValueError (the lowest
    rank's), a WorkerFailure with the worker's exit status otherwise. A SIGTERM to this process reaches the workers
    as preempt.FORWARDED."""
    import torch.multiprocessing as mp

    report_dir = tempfile.mkdtemp(prefix="glm5f-errors-")
    ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args, os.getpid(), report_dir), nprocs=world,
                             join=False, start_method="spawn")

    def forward(signum, frame):  # SIGTERM to the launcher: every worker finishes its step and saves
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, preempt.FORWARDED)
    before = signal.signal(signal.SIGTERM, forward) if threading.current_thread() is threading.main_thread() else None
    try:
        try:
            stopped = _wait_stopping(ctx.processes)
        except KeyboardInterrupt:  # Ctrl-C: every worker stops (and removes a partial save) before the line
            _stop_workers(ctx.processes, signal.SIGINT)
            raise
        if stopped == preempt.SIGNAL_EXIT[signal.SIGINT]:  # the workers got Ctrl-C: main says where to resume
            raise KeyboardInterrupt
        if stopped:  # every worker stopped on a signal, after one checkpoint (rank 0 said where): exit as they did
            raise SystemExit(stopped)
        reported = _reported_error(ctx.processes, report_dir)
        if reported is not None:
            raise reported
        silent = _silent_after_timeout(ctx.processes)
        if silent:
            raise WorkerFailure(f"worker(s) {', '.join(map(str, silent))} stopped answering: the others' collective "
                                f"timed out after --parallel.timeout_s waiting for them, and they were still running "
                                f"(hung or stopped), so all {world} workers were stopped")
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        raise WorkerFailure(f"worker {e.error_index} died with exit code {e.exit_code}; all {world} workers "
                           f"were stopped") from e
    except mp.ProcessRaisedException as e:
        raise WorkerFailure(f"a worker process failed (its traceback is above); all {world} workers were "
                           f"stopped") from e
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
        shutil.rmtree(report_dir, ignore_errors=True)

"""Starting the processes of a multi-process run: local workers (`spawn`) or torchrun's, joined into one process
group (`init_process`), their exit codes, signals passed on to them, and the watch for a rank that stopped answering.

`spawn` runs a function in `world` local processes that die with their launcher; a worker's error for the user (a
ValueError) comes back as one `RankError`, a collective timeout as TIMEOUT_EXIT naming the ranks that stopped
answering (`collective_timeout`, `silent_ranks` under torchrun), and a SIGTERM to the launcher reaches every worker
as `preempt.FORWARDED`. `StallWatch` warns, before the timeout, of a step that waits on a rank that hung.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from glm5f.run import preempt


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


# How `spawn` starts its workers: "spawn", a fresh interpreter each; or "forkserver", each forked from one server
# process that imported FORKSERVER_PRELOAD once (started at the first call, it lives as long as this process), which
# is cheaper when one process spawns many times (the test suite does). A forked worker is given this process's
# environment and stdout/stderr of the moment, as a spawned one has them (multiprocessing passes sys.path and the
# working directory to both).
START_METHOD = "spawn"
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "glm5f"]


class _Surroundings:
    """The launcher's environment and file descriptors 1 and 2, set up again in a worker forked from the fork
    server (which holds those of the moment it started); picklable only while a worker is being started (the
    descriptors travel as `DupFd`s)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _enter_surroundings, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2))


def _enter_surroundings(environ: dict, stdout, stderr) -> None:
    """Runs in the worker as its arguments are unpickled, before the function it runs is unpickled."""
    os.environ.clear()
    os.environ.update(environ)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, passed in ((1, stdout), (2, stderr)):
        new = passed.detach()
        os.dup2(new, fd)
        os.close(new)


def _worker(local_rank: int, surroundings: None, world: int, port: int, fn, args, parent_pid: int | None = None,
            report_dir: str | None = None):
    if parent_pid is not None:  # 0: forked by the fork server, which ends with the launcher
        _die_with_parent(parent_pid or os.getppid())
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
    text = str(e)
    if not re.search(r"[Tt]imed out|[Tt]imeout|DistBackendError", text + type(e).__name__):
        return None
    found = re.search(r"(?:from|to|peer|rank)[ :]+(\d+)", text)
    who = f"rank {found.group(1)} stopped answering" if found else "another rank stopped answering"
    return (f"a collective timed out after --parallel.timeout_s: {who} (hung, stopped or dead; "
            f"{text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__})")


def _wait_stopping(processes) -> int | None:
    """Wait while the workers run or stop together on a signal (exit codes 130/143, see glm5f.run.preempt); the
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
    forked = START_METHOD == "forkserver"
    if forked:
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    ctx = mp.start_processes(_worker, args=(_Surroundings() if forked else None, world, free_port(), fn, args,
                                            0 if forked else os.getpid(), report_dir),
                             nprocs=world, join=False, start_method=START_METHOD)

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

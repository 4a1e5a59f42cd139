"""Stopping a run on a signal: on SIGTERM every rank finishes its step, all save one checkpoint together and the run
exits with a line saying where it stopped; a second SIGTERM, or the grace period running out, stops without saving.
On Ctrl-C (SIGINT) every process stops at once, a save it interrupts removing its partial folder, and one line says
where the run can resume.

The handler only sets a flag (`requested`); the train loop calls `should_stop(layout)` after each step, which
agrees on it over all ranks (an all_reduce), so all ranks stop after the same step. The launcher of a multi-process
run passes a SIGTERM it gets on to its workers as FORWARDED, so a SIGTERM to the whole process group (a scheduler's)
reaches each worker once from each source, and counts as one.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading

import torch

SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal's number, as a shell reports it
FORWARDED = signal.SIGUSR2  # a launcher passing on the SIGTERM it got (glm5f.run.launch.spawn)

# per source (a SIGTERM sent to this process, one its launcher passed on), how many SIGTERMs came
_state = {"signum": None, "grace_s": None, "sigint": False, "stop_now": None, signal.SIGTERM: 0, FORWARDED: 0}


class Preempted(Exception):
    """The run stopped after step `step` on signal `signum`, having saved `checkpoint` (None: nothing to resume
    from). main prints `message(argv)`."""

    def __init__(self, step: int | None, checkpoint: str | None, signum: int = signal.SIGTERM):
        super().__init__(f"stopped after step {step} on {signal.Signals(signum).name}")
        self.step, self.checkpoint, self.signum = step, checkpoint, signum

    def message(self, argv: list[str]) -> str:
        where = f"after step {self.step}" if self.step is not None else "before its first step"
        return (f"stopped {where} on {signal.Signals(self.signum).name}: saved {self.checkpoint}; resume with: "
                f"{resume_command(argv)}")


class StopNow(BaseException):
    """Stop at once, without saving: a second SIGTERM, or --checkpoint.preempt_grace_s ran out (a BaseException,
    so no `except Exception` on the way swallows it; a save it interrupts removes its partial folder)."""


def resume_command(argv: list[str]) -> str:
    """The command line that continues the run of `argv` (train.py's flags) from its latest checkpoint."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--checkpoint.resume" or a.startswith("--checkpoint.resume="):
            skip = a == "--checkpoint.resume"
            continue
        if a in ("--checkpoint.overwrite", "--checkpoint.overwrite=True"):
            continue
        out.append(a)
    return shlex.join(["python", "train.py", *out, "--checkpoint.resume", "latest"])


def _on_sigterm(signum, frame) -> None:
    """SIGTERM, sent to this process or passed on by its launcher (FORWARDED): the first asks to stop; a second from
    the same source stops now. A SIGTERM to the process group reaches a worker from both sources: one request.
    Once stopping now, later ones (the rest of a process group's, the launcher's copies) are ignored, so the
    cleanup that started (a partial save removed) is not cut short."""
    if _state["stop_now"] is not None:
        return
    _state[signum] += 1
    if _state[signum] > 1:
        _stop_now("by a second SIGTERM")
    if _state["signum"] is None:
        _state["signum"] = signal.SIGTERM
        grace = _state["grace_s"]
        if grace:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, grace)


def _stop_now(why: str) -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    _state["stop_now"] = StopNow(why)
    raise _state["stop_now"]


def stopped_now() -> "StopNow | None":
    """The StopNow this process raised inside `handling` (an error that follows is its consequence: a peer that
    stopped on the same signals), or None."""
    return _state["stop_now"]


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt once; further SIGINTs (a terminal's to every process of the run, the launcher's
    forwarded one) are ignored, so the cleanup it starts (a partial save removed) is not cut short."""
    if not _state["sigint"]:
        _state["sigint"] = True
        raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this process got Ctrl-C (SIGINT) inside `handling` (an error that follows is its consequence: a
    peer that stopped on it)."""
    return _state["sigint"]


def _on_alarm(signum, frame) -> None:
    _stop_now(f"as the grace period after SIGTERM (--checkpoint.preempt_grace_s {_state['grace_s']}) ran out")


@contextlib.contextmanager
def handling(grace_s: float | None = None, launched: bool = False):
    """Within it, SIGTERM sets the stop flag (see `should_stop`) instead of killing the process; a second SIGTERM,
    or `grace_s` seconds after the first, raise StopNow; the first SIGINT raises KeyboardInterrupt and later ones
    are ignored. `launched`: a worker of glm5f.run.launch.spawn, whose launcher passes its SIGTERMs on as
    FORWARDED. Restores the previous handlers on leaving. Outside the main thread (no signals there) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.update({"signum": None, "grace_s": grace_s, "sigint": False, "stop_now": None, signal.SIGTERM: 0,
                   FORWARDED: 0})
    handlers = {signal.SIGTERM: _on_sigterm, signal.SIGINT: _on_sigint, **({FORWARDED: _on_sigterm} if launched else {})}
    before = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    alarm = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        for signum, handler in before.items():
            signal.signal(signum, handler)
        _state["signum"] = None


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _state["signum"]


def should_stop(layout) -> bool:
    """Whether the run stops and saves now: any rank got SIGTERM (agreed over all ranks with one all_reduce, so
    every rank saves the same step). Call it after each step, in every rank."""
    flag = torch.tensor(0.0 if _state["signum"] is None else 1.0, device=layout.device)
    return bool(layout.sum(flag) > 0)


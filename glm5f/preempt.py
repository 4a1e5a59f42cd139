"""Stopping a run on a signal: on SIGTERM every rank finishes its step, all save one checkpoint together and the run
exits with a line saying where it stopped; a second SIGTERM, or the grace period running out, stops without saving.
On Ctrl-C (SIGINT) every process stops at once, a save it interrupts removing its partial folder, and one line says
where the run can resume.

The handler only sets a flag (`requested`); the train loop calls `should_stop(layout)` after each step, which
agrees on it over all ranks (an all_reduce), so all ranks stop after the same step.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading

import torch

SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + the signal's number, as a shell reports it

_state = {"signum": None, "grace_s": None, "sigint": False}


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
    if _state["signum"] is not None:
        raise StopNow("by a second SIGTERM")
    _state["signum"] = signum
    grace = _state["grace_s"]
    if grace:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, grace)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt once; further SIGINTs (a terminal's to every process of the run, the launcher's
    forwarded one) are ignored, so the cleanup it starts (a partial save removed) is not cut short."""
    _state["sigint"] = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this process got Ctrl-C (SIGINT) inside `handling` (an error that follows is its consequence: a
    peer that stopped on it)."""
    return _state["sigint"]


def _on_alarm(signum, frame) -> None:
    raise StopNow(f"as the grace period after SIGTERM (--checkpoint.preempt_grace_s {_state['grace_s']}) ran out")


@contextlib.contextmanager
def handling(grace_s: float | None = None):
    """Within it, SIGTERM sets the stop flag (see `should_stop`) instead of killing the process; a second SIGTERM,
    or `grace_s` seconds after the first, raise StopNow; the first SIGINT raises KeyboardInterrupt and later ones
    are ignored. Restores the previous handlers on leaving. Outside the main thread (no signals there) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.update(signum=None, grace_s=grace_s, sigint=False)
    before = signal.signal(signal.SIGTERM, _on_sigterm)
    before_int = signal.signal(signal.SIGINT, _on_sigint)
    alarm = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
        _state["signum"] = None


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _state["signum"]


def should_stop(layout) -> bool:
    """Whether the run stops and saves now: any rank got SIGTERM (agreed over all ranks with one all_reduce, so
    every rank saves the same step). Call it after each step, in every rank."""
    flag = torch.tensor(0.0 if _state["signum"] is None else 1.0, device=layout.device)
    return bool(layout.sum(flag) > 0)


def interrupted_line(why: str, run_dir: str, argv: list[str]) -> str:
    """The one line a run stopped at once (Ctrl-C, StopNow) prints: why, its last checkpoint, how to resume."""
    from glm5f.checkpoint import latest

    last = latest(run_dir)
    if last is None:
        return f"stopped {why}: no checkpoint was written in {run_dir}; start again with the same command"
    return f"stopped {why}: the last checkpoint is {last}; resume with: {resume_command(argv)}"

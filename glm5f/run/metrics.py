"""Run metrics: a console progress line, metrics.jsonl in the run directory, and a PNG of the loss curve."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time


def number(x: float, digits: int = 4) -> str:
    """`x` for a console line: fixed-point with `digits` decimals, or in exponent form from 1e6 on (a huge reward or
    loss stays one short word)."""
    return f"{x:.{digits}f}" if not math.isfinite(x) or abs(x) < 1e6 else f"{x:.{digits}e}"


class Progress:
    """One updating console line (a plain line every `every` steps when not a terminal)."""

    def __init__(self, total: int, start: int = 0, every: int = 10, stream=None):
        self.total, self.start, self.every, self.stream = total, start, every, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, rec: dict) -> None:
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
        width = 24
        bar = "#" * int(width * step / self.total) + "-" * (width - int(width * step / self.total))
        line = (f"[{bar}] {step}/{self.total} loss {number(rec['loss'])} lr {rec['lr']:.2e} "
                f"gnorm {number(rec['grad_norm'], 3)} {rec['tokens_per_s']:.0f} tok/s eta {eta:.0f}s")
        if "reward" in rec:
            line += f" reward {number(rec['reward'])}"
        if "indexer_loss" in rec:
            line += f" indexer_loss {number(rec['indexer_loss'])} recall {rec['indexer_recall']:.3f}"
        evaluated = "eval_loss" in rec
        if evaluated:
            line += f" | eval_loss {number(rec['eval_loss'])} eval_ppl {number(rec['eval_ppl'], 2)}"
        if self.tty:  # a line with an evaluation stays on the screen
            self.stream.write("\r" + line + ("\n" if step == self.total or evaluated else ""))
        elif step % self.every == 0 or step == self.total or step == self.start + 1 or evaluated:
            self.stream.write(line + "\n")
        self.stream.flush()


class MetricsLog:
    """metrics.jsonl (or another `name`), one JSON object per line with its "step", appended across resumes:
    records after the resumed step (written by a run that died before its next checkpoint) are dropped first, so
    each step appears once."""

    def __init__(self, run_dir: str, resume_step: int = 0, warn=lambda message: None, name: str = "metrics.jsonl"):
        self.run_dir, self.resume_step, self.started, self.warn = run_dir, resume_step, False, warn
        self.path = os.path.join(run_dir, name)

    def _start(self) -> None:
        """On the first record (so a run that fails before it leaves the directory as it was)."""
        os.makedirs(self.run_dir, exist_ok=True)
        kept = [r for r in read_metrics(self.path, self.warn) if r["step"] <= self.resume_step] \
            if self.resume_step else []
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        except OSError:  # a full disk: no half-written copy left beside the file
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        self.started = True

    def write(self, rec: dict) -> None:
        if not self.started:
            self._start()
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def read_metrics(path: str, warn=lambda message: None) -> list[dict]:
    """The records of a metrics.jsonl (a file or a run directory holding one); [] if there is none. A last line
    cut off (a run killed while writing it) is dropped, with a line to `warn`; a bad line before the last is a
    ValueError naming file:line."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines[:last + 1]):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if i == last:
                warn(f"{path}:{i + 1}: dropping its last line, cut off ({len(line)} bytes of an unfinished record: "
                     f"the run writing it was stopped mid-line)")
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({e}); metrics.jsonl holds one JSON object per "
                             f"line: fix or remove that line") from None
    return records


def plot_losses(runs: dict[str, list[dict]], out_png: str, title: str = "loss", key: str = "loss") -> bool:
    """Loss curves (or another metric's, `key`: e.g. GRPO's "reward") of several runs into one PNG, each run's
    held-out loss (eval_loss) dashed beside its training loss. False (and nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    has_eval = False
    for name, recs in runs.items():
        evals = [r for r in recs if "eval_loss" in r] if key == "loss" else []
        recs = [r for r in recs if key in r]
        line, = ax.plot([r["step"] for r in recs], [r[key] for r in recs], linewidth=1,
                        label=f"{name} train" if evals else name)
        if evals:
            has_eval = True
            ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "--o", color=line.get_color(),
                    markersize=3, linewidth=1, label=f"{name} eval")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(runs) > 1 or has_eval:
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(out_png, dpi=120)
    except OSError:  # a full disk: no half-written PNG left
        with contextlib.suppress(OSError):
            os.remove(out_png)
        raise
    finally:
        plt.close(fig)
    return True

"""How a run stops for a reason the user has to act on: TrainingError (one `error:` line), bad input, a full disk, out
of memory, a non-finite loss or parameter; and the first step's dead-gradient warning."""

from __future__ import annotations

import contextlib
import errno
import math
import re

import torch

from glm5f.ckpt import checkpoint
from glm5f.core.params import flatten
from glm5f.parallel.layout import Layout, local_tensor, nonfinite_counts


class TrainingError(ValueError):
    """A run stopped for a reason the user has to act on (the message says what)."""


@contextlib.contextmanager
def user_errors():
    """Bad input (a missing file, a malformed record, a mismatched checkpoint) stops the run with its message."""
    try:
        yield
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise TrainingError(str(e)) from e


@contextlib.contextmanager
def writing(path: str, run_dir: str):
    """Writing one of the run's files (metrics.jsonl, config.yaml, an export): a full disk or another I/O error
    stops the run with a line naming the file, the cause and the last checkpoint."""
    try:
        yield
    except OSError as e:
        why = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
        fix = "free some space" if e.errno == errno.ENOSPC else "fix the cause"
        raise TrainingError(f"could not write {path}: {why}; {fix}; {checkpoint.last_line(run_dir)}") from None


@contextlib.contextmanager
def out_of_memory(step: int, layout: Layout, cfg):
    """Running out of device memory in a step stops the run with one line: the allocation, the step and what to
    change (the allocator's own report stays in the exception chain)."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:  # CUDA's OutOfMemoryError; the CPU allocator's RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and "not enough memory" not in str(e):
            raise
        size = re.search(r"[Tt]ried to allocate ([\d.]+ \w+)", str(e))
        what = size.group(1) if size else "memory"
        if what.endswith(" bytes"):
            what = f"{int(what.split()[0]) / 2**30:.2f} GiB"
        p = cfg.parallel
        raise TrainingError(
            f"step {step}: out of memory on {layout.device} trying to allocate {what} "
            f"(micro-batch {cfg.data.batch_size // (cfg.train.grad_accum * p.dp_shard)} x {cfg.data.seq_len} tokens "
            f"per rank); lower --data.batch_size or --data.seq_len, raise --train.grad_accum, turn on "
            f"--train.activation_checkpointing, or shard over more ranks; `python train.py --plan table` with the "
            f"same flags shows where the memory goes") from e


def check_step(cfg, step: int, loss: float, grad_norm: float, last_ckpt: str | None, say) -> bool:
    """Whether step `step` is skipped: a NaN/inf loss or gradient norm stops the run before the update, or with
    --train.skip_nonfinite skips it."""
    bad = [f"the {name} is {v}" for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)]
    if bad and not cfg.train.skip_nonfinite:
        raise TrainingError(f"step {step}: {' and '.join(bad)}; stopping before the update. The last good "
                            f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}; resume from it with "
                            f"a lower --optim.lr, or pass --train.skip_nonfinite to skip such steps")
    if bad:
        say(f"step {step}: {' and '.join(bad)}; skipping this step's update (--train.skip_nonfinite)")
    return bool(bad)


def check_finite(params: dict, layout: Layout, step: int, last_ckpt: str | None) -> None:
    """Refuse to checkpoint parameters holding NaN or inf (counted over all ranks' shards)."""
    names = list(nonfinite_counts(params, layout.sum))
    if names:
        raise TrainingError(f"step {step}: non-finite values in {len(names)} parameter(s) ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''}); not writing a checkpoint of them. The last good "
                            f"checkpoint is {last_ckpt or 'none (no checkpoint written yet)'}")


def check_gradients(grads: dict, layout: Layout, warn) -> None:
    """After the first step: a warning naming the trained leaves whose gradient is zero on every rank (nothing the
    loss computes depends on them, e.g. LoRA on the indexer without --train.indexer_loss). A LoRA weight counts by
    its lora_B (lora_A's gradient is zero while lora_B is, as it starts)."""
    flat = {p: g for p, g in flatten(grads).items() if not p.endswith(".lora_A")}
    if not flat:
        return
    nonzero = layout.sum(torch.stack([(local_tensor(g) != 0).sum() for g in flat.values()]).to(torch.float64))
    dead = [p.removesuffix(".lora_B") for p, n in zip(flat, nonzero.tolist()) if n == 0]
    if dead:
        named = ", ".join(dead[:4]) + (", ..." if len(dead) > 4 else "")
        warn(f"{len(dead)} of the {len(flat)} trained leaves got no gradient in the first step ({named}): "
             f"the loss does not depend on them, so they will not train; drop them from --lora.targets / "
             f"--train.trainable, or turn on the loss that uses them (e.g. --train.indexer_loss for the indexer)")

"""DPO's reference log-probabilities computed once (--dpo.precompute_reference): each pair's summed answer
log-probabilities under the reference, in one pass before training, stored in the run directory with what they
were computed from, so full training keeps no copy of the reference; and the check that a --dpo.reference
checkpoint computes as the trained model does.

Shape suffixes: P pairs, B rows.
"""

from __future__ import annotations

import json
import math
import os

import torch

from glm5f.ckpt import checkpoint
from glm5f.core.config import NOT_MATH, GLM5Config, math_differences
from glm5f.data import readers
from glm5f.data.pairs import PairSource, answer_sums
from glm5f.ckpt.hf.io import DTYPES, inventory, read_metadata, read_part, write_safetensors
from glm5f.train.feed import on_device
from glm5f.train.loss import Step, logprob_table, with_targets
from glm5f.parallel.layout import Layout

FILE = "dpo_reference.safetensors"  # in the run directory
KEYS = ("ref_chosen", "ref_rejected")
# what each entry of the file's fingerprint stands for, in the line saying why it is not reused
INPUTS = {"data": "the data file", "seq_len": "--data.seq_len", "tokenizer": "the tokenizer or chat template",
          "reference": "the reference's weights", "model": "the model config", "dtype": "--train.dtype or reduce_dtype"}


def check_architecture(ref_cfg: GLM5Config, model_cfg: GLM5Config, path: str, flag: str = "--dpo.reference") -> None:
    """A ValueError naming each config field where the reference `path` (given as `flag`) computes otherwise than
    the trained model (`config.math_differences`: token ids and the init scale may differ)."""
    diff = math_differences(ref_cfg, model_cfg)
    if diff:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."  # noqa: E731
        named = "; ".join(f"{k} {short(r)} (the trained model's {short(m)})" for k, (r, m) in diff.items())
        raise ValueError(f"{flag} {path} is another architecture than the trained model: {named}; pass a "
                         f"checkpoint of the same architecture (only {', '.join(NOT_MATH)} may differ)")


@torch.no_grad()
def compute(reference: dict, data: PairSource, cfg: GLM5Config, layout: Layout, step: Step, rows: int,
            say=lambda line: None) -> torch.Tensor:
    """[P, 2] fp64: each pair of `data` (data.pairs, in their order) with its (chosen, rejected) summed answer
    log-probabilities under `reference` (as the layout stores it): the step's objective's `prepare`d batches of
    `rows` pairs at a time (the step's global micro-batch; the last one padded with its last pair so every rank
    runs the same forwards) through `loss.logprob_table` (the step's dtypes and compiled layers), each rank's part of
    each answer summed (`pairs.answer_sums`) and the parts added over the ranks, as DPO's step adds them. Every rank
    ends with the whole table. Collective. Says
    "reference log-probabilities: k/P pairs" as it goes."""
    P = len(data.pairs)
    table_Px2 = torch.zeros(P, 2, dtype=torch.float64, device=layout.device)
    chunks = math.ceil(P / rows)
    every = max(1, chunks // 10)
    for c in range(chunks):
        real = list(range(c * rows, min(P, (c + 1) * rows)))
        picked = real + [real[-1]] * (rows - len(real))
        batch = step.objective.prepare(with_targets(on_device(data.batch_of(picked), layout.device)), step.settings)
        sums_Bx2 = logprob_table(reference, batch, cfg, layout, step, micro=1, columns=2, per_row=lambda logp_BxS, b:
                                 torch.stack(answer_sums(logp_BxS, b["answer_targets"]), 1))
        table_Px2[real] = sums_Bx2[:len(real)]
        if (c + 1) % every == 0 or c + 1 == chunks:
            say(f"reference log-probabilities: {real[-1] + 1}/{P} pairs")
    return table_Px2


def precompute(run, data: PairSource, reference: dict) -> None:
    """--dpo.precompute_reference: the reference's summed answer log-probabilities of every pair, handed to the
    data (`PairSource.use_reference`): read from the run directory's FILE when it was made from this data (the
    file's fingerprint, --data.seq_len, the tokenizer and template) and this reference (its weights' fingerprint,
    the model config, --train.dtype and reduce_dtype), else computed in one pass (`compute`) and written there by
    rank 0. Every rank reuses the file, or none does. Collective. `run`: the run's edges (cfg, model_cfg, trainer,
    say, tokenizer, writing)."""
    cfg, layout, say = run.cfg, run.trainer.layout, run.say
    fingerprint = {"data": readers.fingerprint(cfg.data.path), "seq_len": cfg.data.seq_len,
                   "tokenizer": run.tokenizer.fingerprint(), "reference": checkpoint.fingerprint(reference, layout.sum),
                   "model": run.model_cfg.to_hf(), "dtype": [cfg.train.dtype, cfg.train.reduce_dtype]}
    path = os.path.join(cfg.checkpoint.dir, FILE)
    table, why = load(path, fingerprint, len(data.pairs))
    if int(layout.sum(torch.tensor(float(table is not None), device=layout.device))) == layout.world:
        say(f"reference log-probabilities: reusing {path} (the same data and reference)")
    else:
        why = why or f"another rank could not read {path}"
        say(f"reference log-probabilities: {why}; computing them ({len(data.pairs)} pairs)", flush=True)
        step = run.trainer.step
        table = compute(reference, data, run.model_cfg, layout, step, cfg.data.batch_size // step.grad_accum,
                        lambda line: say(line, flush=True))
        if layout.is_main:
            with run.writing(path):
                os.makedirs(cfg.checkpoint.dir, exist_ok=True)
                save(path, table, fingerprint)
    data.use_reference(table)


def load(path: str, fingerprint: dict, pairs: int) -> tuple[torch.Tensor | None, str]:
    """(the [pairs, 2] fp64 table stored at `path`, "") when it was made from what `fingerprint` describes, else
    (None, why not: no file, an unreadable one, or which of the fingerprint's entries differ)."""
    if not os.path.isfile(path):
        return None, f"no {FILE} in the run directory"
    try:
        stored = json.loads(read_metadata(path).get("fingerprint", "null"))
        inv = inventory([path])
    except ValueError as e:
        return None, f"{path} is unreadable ({e})"
    want = json.loads(json.dumps(fingerprint))
    if not isinstance(stored, dict):
        return None, f"{path} has no fingerprint"
    changed = sorted(k for k in want.keys() | stored.keys() if want.get(k) != stored.get(k))
    if changed:
        named = [INPUTS.get(k, k) for k in changed]
        return None, f"{path} was computed from other inputs ({', '.join(named)} changed)"
    if any(k not in inv or inv[k][1] != (pairs,) or inv[k][2] != "F64" for k in KEYS):
        return None, f"{path} does not hold {pairs} pairs' fp64 {' and '.join(KEYS)}"
    table_Px2 = torch.empty(pairs, 2, dtype=torch.float64)
    with open(path, "rb") as f:
        for j, k in enumerate(KEYS):
            column = torch.empty(pairs, dtype=DTYPES[inv[k][2]])
            read_part(f, (pairs,), torch.float64, inv[k][3], (slice(0, pairs),), column)
            table_Px2[:, j] = column
    return table_Px2, ""


def save(path: str, table_Px2: torch.Tensor, fingerprint: dict) -> None:
    """Write the table to `path` with its fingerprint, through a temporary file renamed over it (a reader never
    sees half a file)."""
    P = table_Px2.shape[0]
    tmp = f"{path}.tmp"
    write_safetensors(tmp, [(k, (P,), torch.float64) for k in KEYS],
                      (table_Px2[:, j].contiguous() for j in range(len(KEYS))),
                      metadata={"fingerprint": json.dumps(fingerprint, sort_keys=True)})
    os.replace(tmp, path)

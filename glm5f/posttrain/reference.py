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

from glm5f.core.config import NOT_MATH, GLM5Config, math_differences
from glm5f.data.pairs import PairSource
from glm5f.posttrain.dpo import prepare, reference_sums
from glm5f.model.env import make_env
from glm5f.ckpt.hf.io import DTYPES, inventory, read_metadata, read_part, write_safetensors
from glm5f.train.loss import Context, Step, with_targets
from glm5f.parallel.layout import Layout

FILE = "dpo_reference.safetensors"  # in the run directory
KEYS = ("ref_chosen", "ref_rejected")
# what each entry of the file's fingerprint stands for, in the line saying why it is not reused
INPUTS = {"data": "the data file", "seq_len": "--data.seq_len", "tokenizer": "the tokenizer or chat template",
          "reference": "the reference's weights", "model": "the model config", "dtype": "--train.dtype or reduce_dtype"}


def check_architecture(ref_cfg: GLM5Config, model_cfg: GLM5Config, path: str) -> None:
    """A ValueError naming each config field where --dpo.reference `path` computes otherwise than the trained model
    (`config.math_differences`: token ids and the init scale may differ)."""
    diff = math_differences(ref_cfg, model_cfg)
    if diff:
        short = lambda v: repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."  # noqa: E731
        named = "; ".join(f"{k} {short(r)} (the trained model's {short(m)})" for k, (r, m) in diff.items())
        raise ValueError(f"--dpo.reference {path} is another architecture than the trained model: {named}; pass a "
                         f"checkpoint of the same architecture (only {', '.join(NOT_MATH)} may differ)")


@torch.no_grad()
def compute(reference: dict, data: PairSource, cfg: GLM5Config, layout: Layout, step: Step, rows: int,
            say=lambda line: None) -> torch.Tensor:
    """[P, 2] fp64: each pair of `data` (data.pairs, in their order) with its (chosen, rejected) summed answer
    log-probabilities under `reference` (as the layout stores it), computed as DPO's step computes them
    (`dpo.reference_sums`, the step's dtypes and compiled layers) over `rows` pairs at a time (the step's global
    micro-batch; the last one padded with its last pair so every rank runs the same forwards), each rank its
    share of the rows; every rank ends with the whole table (a sum over ranks of tables zero but for each rank's
    own pairs). Collective. Says "reference log-probabilities: k/P pairs" as it goes."""
    P = len(data.pairs)
    table_Px2 = torch.zeros(P, 2, dtype=torch.float64, device=layout.device)
    chunks = math.ceil(P / rows)
    every = max(1, chunks // 10)
    for c in range(chunks):
        real = list(range(c * rows, min(P, (c + 1) * rows)))
        picked = real + [real[-1]] * (rows - len(real))
        batch = prepare(with_targets({k: v.to(layout.device) for k, v in data.batch_of(picked).items()}))
        local, env = make_env(cfg, batch, step.dtype, layout, objectives=step.objectives,
                              weight_dtype=step.weight_dtype, compile=step.compile, query_parts=step.query_parts)
        chosen_B, rejected_B = reference_sums(local, Context(cfg, layout, step, env, {}, reference=reference))
        mine = layout.share(rows, batch["input_ids"].shape[1])[0]
        index_B = torch.tensor(picked, device=layout.device)[mine]
        keep_B = (torch.arange(rows, device=layout.device) < len(real))[mine]
        if layout.cp_rank == 0:  # the other ranks of a CP group hold the same rows' sums
            table_Px2[index_B[keep_B]] = torch.stack([chosen_B, rejected_B], 1)[keep_B]
        if (c + 1) % every == 0 or c + 1 == chunks:
            say(f"reference log-probabilities: {real[-1] + 1}/{P} pairs")
    return layout.sum(table_Px2)


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

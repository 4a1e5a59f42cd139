"""DPO, the `dpo` row of the main objectives: over preference pairs (`glm5f.data.pairs`), the mean of
-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), each term an answer's summed token log-probabilities under
the policy (pi) or the reference (ref); with an SFT weight, the chosen answers' LM loss added (RPO).

Shape suffixes: B rows (one pair each), S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5f.train.loss import Context, Objective
from glm5f.model.head import head_token_losses, shift_labels
from glm5f.core.ops import wide_dtype
from glm5f.data.pairs import CHOSEN, REJECTED
from glm5f.core import IGNORE_INDEX


@dataclass(frozen=True)
class DPOConfig:
    """The --dpo flags the loss reads (configs.DPOConfig has them all): beta, the weight of the implicit reward;
    sft_weight, the weight of the chosen answers' LM loss (0: none)."""

    beta: float = 0.1
    sft_weight: float = 0.0


def answer_sums(logp_BxS: torch.Tensor, answer_BxS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) [B]: each row's summed log-probabilities of its chosen and rejected answer's targets
    (fp64 sums)."""
    return tuple((logp_BxS * (answer_BxS == which)).sum(1, dtype=torch.float64) for which in (CHOSEN, REJECTED))


def dpo_terms(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float) -> dict:
    """Per pair [B]: "loss" -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), the implicit rewards "chosen"
    beta (pi_c - ref_c) and "rejected" beta (pi_r - ref_r), "margin" their difference, "accuracy" 1 where the
    chosen reward is the larger."""
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    margin = chosen - rejected
    return {"loss": -F.logsigmoid(margin), "chosen": chosen, "rejected": rejected, "margin": margin,
            "accuracy": (margin > 0).to(margin.dtype)}


def prepare(batch: dict, settings=None) -> dict:
    """The batch with "answer_targets": which answer each next-token target belongs to (the "answer" entries
    shifted as the labels are; in a tree batch, whose targets sit at the token they name, as they are), made on
    whole sequences."""
    if batch.get("tree_prev") is not None:
        return {**batch, "answer_targets": batch["answer"]}
    return {**batch, "answer_targets": shift_labels(batch["answer"].masked_fill(batch["answer"] == 0, IGNORE_INDEX))
            .clamp(min=0)}


def denoms(batch: dict) -> dict:
    """{"pairs": the rows holding a pair, "chosen_targets": the chosen answers' targets} of the global batch."""
    ans = batch["answer_targets"]
    return {"pairs": (ans == CHOSEN).any(1).sum().clamp(min=1), "chosen_targets": (ans == CHOSEN).sum().clamp(min=1),
            "step": torch.ones((), dtype=torch.float64, device=ans.device)}


def reference_sums(batch: dict, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) [B] of this rank's rows of `batch` (a `prepare`d share): each answer's summed
    log-probabilities under the run's reference (`Context.reference_forward`), over the CP group; no gradient."""
    targets = batch["targets"]
    B, S = targets.shape
    with torch.no_grad():
        ref_hidden_BxSxD, ref_head = ctx.reference_forward(batch)
        ref_BxS = -head_token_losses(ref_head, ref_hidden_BxSxD, targets, ctx.cfg.rms_norm_eps).view(B, S)
        return tuple(ctx.layout.seq_sum(s) for s in answer_sums(ref_BxS, batch["answer_targets"]))


def loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """This rank's share of the DPO loss over its rows (`loss.Objective.loss`); the policy's forward records the
    terms, the reference's (no gradient) does not. A batch holding each row's "ref_chosen" and "ref_rejected" [B]
    (fp64; --dpo.precompute_reference) is compared with them and runs no reference forward. --dpo flags come as
    ctx.step.settings."""
    o = ctx.step.settings or DPOConfig()
    eps, targets, answer = ctx.cfg.rms_norm_eps, batch["targets"], batch["answer_targets"]
    B, S = targets.shape
    hidden_BxSxD, head = ctx.forward(params, batch)
    logp_BxS = -head_token_losses(head, hidden_BxSxD, targets, eps).view(B, S)
    ref_c, ref_r = (batch["ref_chosen"], batch["ref_rejected"]) if "ref_chosen" in batch else \
        reference_sums(batch, ctx)
    # Under CP each rank holds part of every answer: the sums are taken over the CP group (with gradients) before
    # the sigmoid, every rank of the group then holds the same pairs' terms, and the first one counts them.
    layout = ctx.layout
    pi_c, pi_r = (layout.seq_total(s) for s in answer_sums(logp_BxS, answer))
    is_pair = layout.seq_sum((answer == CHOSEN).sum(1)) > 0
    counted = float(layout.cp_rank == 0)
    t = {k: torch.where(is_pair, v, 0.0) for k, v in dpo_terms(pi_c, pi_r, ref_c, ref_r, o.beta).items()}
    sums = {name: t[name].sum() * counted for name in ("loss", "margin", "accuracy", "chosen", "rejected")}
    sums["logps_chosen"], sums["logps_rejected"] = pi_c.detach().sum() * counted, pi_r.detach().sum() * counted
    for name in ("tokens_computed", "tokens_unshared"):  # the rows' tokens run, and the pairs' sequences' tokens
        if name in batch:
            sums[name] = batch[name].sum(dtype=torch.float64) * counted
    value = sums["loss"] / ctx.denoms["pairs"]
    if o.sft_weight:
        sums["sft_loss"] = -pi_c.sum() * counted
        value = value + o.sft_weight * sums["sft_loss"] / ctx.denoms["chosen_targets"]
    return value, sums


def plan_bytes(model_cfg, run, state: dict) -> int:
    """The reference's bytes per rank: none in a LoRA run (its base) or with --dpo.precompute_reference (freed
    after its pass), else a copy of the params (sharded as they are) in the compute dtype. (GRPO's, with
    --rl.kl_beta, is the same.)"""
    if run.lora_rank or run.precompute_reference:
        return 0
    act = run.dtypes[0]
    return state["params"] * act.itemsize // wide_dtype(act).itemsize


METRICS = {name: "pairs" for name in ("loss", "margin", "accuracy", "chosen", "rejected", "logps_chosen",
                                      "logps_rejected")}
DPO = Objective(loss, denoms, {**METRICS, "sft_loss": "chosen_targets", "tokens_computed": "step",
                               "tokens_unshared": "step"}, prepare=prepare, plan_bytes=plan_bytes,
                data_types=("preference",), settings="dpo", reference=True)

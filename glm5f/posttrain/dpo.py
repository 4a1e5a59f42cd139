"""DPO, the `dpo` row of the main objectives: over preference pairs (`glm5f.data.pairs`), the mean of
-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), each term an answer's summed token log-probabilities under
the policy (pi) or the reference (ref); with an SFT weight, the chosen answers' LM loss added (RPO).

Shape suffixes: B rows (one pair each), S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from glm5f.train.loss import Context, Objective
from glm5f.model.head import shift_labels
from glm5f.model.logprobs import head_logprobs
from glm5f.core.ops import wide_dtype
from glm5f.data.chat import ChatFormat
from glm5f.data.pairs import CHOSEN, REJECTED, PairSource, answer_sums, read_pairs
from glm5f.data.sources import model_tokenizer
from glm5f.posttrain import reference as stored
from glm5f.core import IGNORE_INDEX


@dataclass
class DPOConfig:
    """The --dpo flags (mounted as Config.dpo by the objective table)."""

    beta: float = 0.1
    """DPO: the weight of the implicit reward, in -logsigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))."""
    sft_weight: float = 0.0
    """DPO: the weight of the chosen answers' LM loss added to the DPO loss (RPO); 0: none."""
    reference: Optional[str] = None
    """DPO: the reference model, a Transformers checkpoint directory; default the run's starting weights (a LoRA
    run: its base with the adapters off, no second copy in memory)."""
    precompute_reference: bool = False
    """DPO, full training: compute the reference's log-probabilities of every pair once, in a pass before the first
    step, store them in the run directory (dpo_reference.safetensors, reused while the data and the reference are
    the same) and free the reference, instead of keeping a copy of it in memory."""


def dpo_terms(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float) -> dict:
    """Per pair [B]: "loss" -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), the implicit rewards "chosen"
    beta (pi_c - ref_c) and "rejected" beta (pi_r - ref_r), "margin" their difference, "accuracy" 1 where the
    chosen reward is the larger."""
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    margin = chosen - rejected
    return {"loss": -F.logsigmoid(margin), "chosen": chosen, "rejected": rejected, "margin": margin,
            "accuracy": (margin > 0).to(margin.dtype)}


def identical(batch: dict) -> torch.Tensor:
    """[B] bool: the rows whose chosen sequence is its rejected one (the same tokens and labels), read from a
    `PairSource` row: the chosen sequence, then the rejected one, each starting at position 0 (a tree row: the two
    answers' tokens after the shared prompt). Such a pair carries no
    signal: its DPO term's gradient is 0 up to rounding, so the loss leaves it out."""
    ids_BxS, labels_BxS, pos_BxS = batch["input_ids"], batch["labels"], batch["position_ids"]
    same = torch.zeros(len(ids_BxS), dtype=torch.bool, device=ids_BxS.device)
    if batch.get("tree_prev") is not None:  # a tree row: the prompt once, then each answer's tokens
        ans = batch["answer"]
        for b in range(len(ids_BxS)):
            c, r = ans[b] == CHOSEN, ans[b] == REJECTED
            same[b] = bool(c.any() and torch.equal(ids_BxS[b][c], ids_BxS[b][r])
                           and torch.equal(labels_BxS[b][c], labels_BxS[b][r]))
        return same
    for b, starts in enumerate((pos_BxS == 0).tolist()):
        cut = [i for i, s in enumerate(starts) if s] + [len(starts)]
        if len(cut) < 3 or cut[1] - cut[0] != cut[2] - cut[1]:
            continue
        c, r = slice(cut[0], cut[1]), slice(cut[1], cut[2])
        same[b] = bool(torch.equal(ids_BxS[b, c], ids_BxS[b, r]) and torch.equal(labels_BxS[b, c], labels_BxS[b, r]))
    return same


def prepare(batch: dict, settings=None) -> dict:
    """The batch with "answer_targets": which answer each next-token target belongs to (the "answer" entries
    shifted as the labels are; in a tree batch, whose targets sit at the token they name, as they are), made on
    whole sequences; "identical" [B]: the rows `identical` finds."""
    if batch.get("tree_prev") is not None:
        return {**batch, "answer_targets": batch["answer"], "identical": identical(batch)}
    return {**batch, "answer_targets": shift_labels(batch["answer"].masked_fill(batch["answer"] == 0, IGNORE_INDEX))
            .clamp(min=0), "identical": identical(batch)}


def denoms(batch: dict) -> dict:
    """{"pairs": the rows holding a pair whose answers differ, "rows": the rows holding a pair, "chosen_targets":
    the chosen answers' targets} of the global batch (at least 1 each)."""
    ans = batch["answer_targets"]
    rows = (ans == CHOSEN).any(1)
    return {"pairs": (rows & ~batch["identical"]).sum().clamp(min=1), "rows": rows.sum().clamp(min=1),
            "chosen_targets": (ans == CHOSEN).sum().clamp(min=1),
            "step": torch.ones((), dtype=torch.float64, device=ans.device)}


def skip(batch: dict, settings=None) -> str | None:
    """Why a step on `batch` has nothing to learn (None when it has): every pair's chosen sequence is its rejected
    one and no SFT term (--dpo.sft_weight) trains the chosen answers."""
    o = settings or DPOConfig()
    has_pair = (batch["answer"] == CHOSEN).any(1)
    if o.sft_weight or not has_pair.any() or (has_pair & ~identical(batch)).any():
        return None
    return ("every pair's chosen answer equals its rejected one, so every DPO term's gradient is 0 and there is "
            "nothing to learn")


def reference_sums(batch: dict, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) [B] of this rank's rows of `batch` (a `prepare`d share): each answer's summed
    log-probabilities under the run's reference (`Context.reference_forward`), over the CP group; no gradient."""
    targets = batch["targets"]
    B, S = targets.shape
    with torch.no_grad():
        ref_hidden_BxSxD, ref_head = ctx.reference_forward(batch)
        ref_BxS = head_logprobs(ref_head, ref_hidden_BxSxD, targets, ctx.cfg.rms_norm_eps)
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
    logp_BxS = head_logprobs(head, hidden_BxSxD, targets, eps)
    ref_c, ref_r = (batch["ref_chosen"], batch["ref_rejected"]) if "ref_chosen" in batch else \
        reference_sums(batch, ctx)
    # Under CP each rank holds part of every answer: the sums are taken over the CP group (with gradients) before
    # the sigmoid, every rank of the group then holds the same pairs' terms, and the first one counts them.
    layout = ctx.layout
    pi_c, pi_r = (layout.seq_total(s) for s in answer_sums(logp_BxS, answer))
    has_pair = layout.seq_sum((answer == CHOSEN).sum(1)) > 0
    is_pair = has_pair & ~batch["identical"]  # a pair whose answers are the same is left out
    counted = float(layout.cp_rank == 0)
    t = {k: torch.where(is_pair, v, 0.0) for k, v in dpo_terms(pi_c, pi_r, ref_c, ref_r, o.beta).items()}
    sums = {name: t[name].sum() * counted for name in ("loss", "margin", "accuracy", "chosen", "rejected")}
    sums["frac_identical_pairs"] = (has_pair & batch["identical"]).sum(dtype=torch.float64) * counted
    sums["logps_chosen"], sums["logps_rejected"] = (torch.where(is_pair, s.detach(), 0.0).sum() * counted
                                                    for s in (pi_c, pi_r))
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


def reference_errors(section: str, reference: str | None, cfg) -> list[str]:
    """What is wrong with an objective's reference checkpoint flag (--<section>.reference) in run `cfg`."""
    if reference and cfg.lora.rank:
        return [f"--{section}.reference with --lora.rank: a LoRA run's reference is its base with the adapters off; "
                f"drop --{section}.reference, or train the full model (without --lora.rank)"]
    return []


def check(cfg) -> list[str]:
    """What is wrong with the --dpo flags of a DPO run."""
    o, errs = cfg.dpo, reference_errors("dpo", cfg.dpo.reference, cfg)
    if cfg.data.type == "preference" and not cfg.data.path:
        errs.append("--data.type preference needs --data.path")
    if o.precompute_reference and cfg.lora.rank:
        errs.append("--dpo.precompute_reference with --lora.rank: a LoRA run's reference is its base with the "
                    "adapters off, already in memory at no cost; drop --dpo.precompute_reference")
    if o.beta <= 0 or o.sft_weight < 0:
        errs.append(f"--dpo.beta must be positive and --dpo.sft_weight >= 0, got {o.beta} and {o.sft_weight}")
    return errs


def source(cfg, model_cfg, layout, tokenizer_path: str | None, warn) -> PairSource:
    """The run's preference pairs (--data.type preference: `pairs.PairSource` of --data.path), in memory; with
    --data.share_prefixes each pair one tree row (the prompt once, then both answers)."""
    d = cfg.data
    tok = model_tokenizer(tokenizer_path, model_cfg.vocab_size)
    fmt = ChatFormat.load(tokenizer_path, d.chat_template)
    return PairSource(read_pairs(d.path, tok, fmt), d.batch_size, d.seq_len, model_cfg.vocab_size, d.seed, tok.pad_id,
                      warn, d.path, d.share_prefixes)


def setup(run, data: PairSource, reference: dict | None) -> dict | None:
    """--dpo.precompute_reference: the reference's sums of every pair go with the data (`reference.precompute`)
    and its weights are freed (None); else the reference is kept."""
    if not run.cfg.dpo.precompute_reference:
        return reference
    stored.precompute(run, data, reference)
    return None


METRICS = {name: "pairs" for name in ("loss", "margin", "accuracy", "chosen", "rejected", "logps_chosen",
                                      "logps_rejected")}
DPO = Objective(loss, denoms, {**METRICS, "sft_loss": "chosen_targets", "frac_identical_pairs": "rows",
                               "tokens_computed": "step", "tokens_unshared": "step"},
                prepare=prepare, plan_bytes=plan_bytes, data_types=("preference",), settings="dpo", reference=True,
                config=DPOConfig, check=check, source=source, setup=setup, skip=skip)

"""GRPO, the `grpo` row of the main objectives: over groups of sampled completions (`glm5f.rollouts`), the clipped
policy-gradient loss of each completion token with its group-relative advantage, a truncated importance weight for
the rollout engine's drift, and an optional KL to a reference.

Per completion token t of completion i: A_i = (r_i - mean_g) / (std_g + 1e-4) (scale "group"; "batch": the std
over the global batch; "none": no division; std with Bessel's correction), rho_t = exp(logp_t - old_t) (old: the
policy before this batch's first update), w_t = min(exp(old_t - rollout_t), tis_cap) (detached; 1 without the
engine's log-probabilities or with tis_cap 0), l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) w_t
+ kl_beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1). Loss "dapo": the sum of l_t over the global batch over its
completion tokens; "grpo": the mean over completions of each one's token mean.

Shape suffixes: R rows (one completion each), S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5f.loss import Context, Objective, head_token_losses
from glm5f.tokens import IGNORE_INDEX

LOSSES = ("dapo", "grpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4


@dataclass(frozen=True)
class GRPOConfig:
    loss: str = "dapo"
    scale_rewards: str = "group"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    tis_cap: float = 2.0
    kl_beta: float = 0.0


def advantages(reward_R: torch.Tensor, group_R: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """A [R] (fp64) of each completion: its reward less its group's mean, over the group's std (scale "group"), the
    batch's ("batch") or 1 ("none"), std with Bessel's correction, plus STD_EPS."""
    if scale not in SCALES:
        raise ValueError(f"--rl.scale_rewards must be one of {', '.join(SCALES)}, found {scale!r}")
    r = reward_R.to(torch.float64)
    ids, inverse = torch.unique(group_R, return_inverse=True)
    n = torch.zeros(len(ids), dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(n).index_add_(0, inverse, r) / n
    centered = r - mean[inverse]
    if scale == "none":
        return centered
    if scale == "batch":
        return centered / (r.std() + STD_EPS)
    var = torch.zeros_like(n).index_add_(0, inverse, centered ** 2) / (n - 1)
    return centered / (var.sqrt()[inverse] + STD_EPS)


def shifted(t_BxS: torch.Tensor, fill: float) -> torch.Tensor:
    """A per-label tensor moved to the targets' positions (as `loss.shift_labels` moves labels)."""
    return torch.cat([t_BxS[:, 1:], torch.full_like(t_BxS[:, :1], fill)], dim=1)


def token_terms(logp: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, ref: torch.Tensor | None,
                adv_R: torch.Tensor, cfg: GRPOConfig) -> dict:
    """Per token [R, S]: "loss" l_t (the module docstring), "clipped" 1 where the clip decided the min, "capped" 1
    where w_t reached tis_cap, "gap" |old_t - rollout_t| (0 without the engine's), "kl" the KL term (unweighted)."""
    A = adv_R[:, None].to(logp.dtype)
    rho = torch.exp(logp - old)
    lo, hi = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
    unclipped, clipped = rho * A, rho.clamp(lo, hi) * A
    has = ~torch.isnan(rollout)
    ratio = torch.exp(old - torch.nan_to_num(rollout)).detach()
    w = torch.where(has & (cfg.tis_cap > 0), ratio.clamp(max=cfg.tis_cap), torch.ones_like(ratio)) \
        if cfg.tis_cap > 0 else torch.ones_like(ratio)
    loss = -torch.minimum(unclipped, clipped) * w
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + cfg.kl_beta * kl
    return {"loss": loss, "clipped": (clipped < unclipped).to(logp.dtype),
            "capped": (has & (ratio >= cfg.tis_cap) & (cfg.tis_cap > 0)).to(logp.dtype),
            "gap": torch.where(has, (old - torch.nan_to_num(rollout)).abs(), 0.0).detach(), "kl": kl.detach()}


def make(cfg: GRPOConfig) -> Objective:
    """The GRPO Objective of `cfg`."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"--rl.loss must be one of {', '.join(LOSSES)}, found {cfg.loss!r}")

    def prepare(batch: dict) -> dict:
        out = {**batch, "advantage": advantages(batch["reward"], batch["group"], cfg.scale_rewards),
               "rollout_targets": shifted(batch["rollout_logprobs"], float("nan"))}
        return out

    def denoms(batch: dict) -> dict:
        scored = batch["targets"] != IGNORE_INDEX
        return {"completion_tokens": scored.sum().clamp(min=1), "completions": scored.any(1).sum().clamp(min=1)}

    def loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
        targets = batch["targets"]
        R, S = targets.shape
        hidden_RxSxD, head = ctx.forward(params, batch)
        logp = -head_token_losses(head, hidden_RxSxD, targets, ctx.cfg.rms_norm_eps).view(R, S)
        old = batch["old_targets"] if "old_targets" in batch else logp.detach()
        ref = None
        if cfg.kl_beta:
            with torch.no_grad():
                ref_hidden, ref_head = ctx.reference_forward(batch)
                ref = -head_token_losses(ref_head, ref_hidden, targets, ctx.cfg.rms_norm_eps).view(R, S)
        scored = (targets != IGNORE_INDEX).to(logp.dtype)
        t = {k: v * scored for k, v in token_terms(logp, old, batch["rollout_targets"], ref, batch["advantage"],
                                                    cfg).items()}
        n_R = scored.sum(1)
        sums = {"loss": t["loss"].sum(dtype=torch.float64) if cfg.loss == "dapo" else
                (t["loss"].sum(1, dtype=torch.float64) / n_R.clamp(min=1)).sum()}
        value = sums["loss"] / ctx.denoms["completion_tokens" if cfg.loss == "dapo" else "completions"]
        is_completion = n_R > 0
        sums.update(reward=torch.where(is_completion, batch["reward"], 0.0).sum(),
                    advantage_abs=torch.where(is_completion, batch["advantage"].abs(), 0.0).sum(),
                    completion_length=n_R.sum(dtype=torch.float64),
                    clip_fraction=t["clipped"].sum(dtype=torch.float64),
                    tis_capped_fraction=t["capped"].sum(dtype=torch.float64),
                    rollout_logprob_gap=t["gap"].sum(dtype=torch.float64),
                    kl=t["kl"].sum(dtype=torch.float64))
        return value, sums

    per_token = ("clip_fraction", "tis_capped_fraction", "rollout_logprob_gap", "kl")
    metrics = {"loss": "completion_tokens" if cfg.loss == "dapo" else "completions", "reward": "completions",
               "advantage_abs": "completions", "completion_length": "completions",
               **{name: "completion_tokens" for name in per_token}}
    return Objective(loss, denoms, metrics, prepare=prepare, data_types=("rollouts",), reference=cfg.kl_beta > 0)

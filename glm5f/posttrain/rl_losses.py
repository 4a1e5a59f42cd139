"""GRPO's loss as three tables, as verl splits it: advantage estimators (--rl.advantage), per-token policy losses
(--rl.policy_loss) and aggregations (--rl.aggregation); each row a small pure function, its docstring its formula."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from glm5f.core import IGNORE_INDEX

SCALES = ("group", "batch", "none")
STD_EPS = 1e-4

# Notation: completion i of group g (n_g completions, rewards r), trained token t of i (n_i of them over its whole
# sequence), logp_t the policy's log-probability of it, old_t the policy's before this batch's first update,
# rollout_t the rollout engine's, sg() no gradient; eps_low, eps_high, tis_cap the --rl flags. Shape suffixes: R rows
# (one completion each), S sequence.


# ---- advantages: (reward [R], group [R], settings) -> A [R] (fp64) -----------------------------------------------

def scaled_stats(reward_R: torch.Tensor, group_R: torch.Tensor, scale: str) -> tuple[torch.Tensor, ...]:
    """(x = r / c, each row's group's mean of x, the std of x over its group (scale "group") or the batch, c) [R]
    (fp64; std with Bessel's correction), c a power of two near each row's group's largest |reward| (scale "group")
    or the batch's (1 for all zeros): exact scaling, so every statistic is the unscaled one over c and stays finite
    however large the finite rewards."""
    r = reward_R.to(torch.float64)
    _, inverse = torch.unique(group_R, return_inverse=True)
    zeros = torch.zeros(int(inverse.max()) + 1, dtype=r.dtype, device=r.device)
    top = zeros.scatter_reduce(0, inverse, r.abs(), "amax", include_self=False)[inverse] if scale == "group" else \
        r.abs().max().expand(len(r))
    c = torch.where(top > 0, torch.ldexp(torch.ones_like(top), torch.frexp(top).exponent - 1), 1.0)
    x = r / c
    n = zeros.index_add(0, inverse, torch.ones_like(r))
    mean = (zeros.index_add(0, inverse, x) / n)[inverse]
    std = (zeros.index_add(0, inverse, (x - mean) ** 2) / (n - 1)).sqrt()[inverse] if scale == "group" else \
        x.std().expand(len(r))
    return x, mean, std, c


def group_stats(reward_R: torch.Tensor, group_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [R] of each row's group's rewards (fp64; std with Bessel's correction; inf only where the
    std itself passes fp64's largest number)."""
    _, mean, std, c = scaled_stats(reward_R, group_R, "group")
    return mean * c, std * c


def finite(adv_R: torch.Tensor, reward_R: torch.Tensor, group_R: torch.Tensor, how: str) -> torch.Tensor:
    """adv_R, or a ValueError naming the first reward whose advantage passes fp64's largest number."""
    if not torch.isfinite(adv_R).all():
        worst = int(torch.argmax((~torch.isfinite(adv_R)).to(torch.int8)))
        raise ValueError(f"a reward of {float(reward_R[worst]):.4g} (group {int(group_R[worst])}) is so far from its "
                         f"group's mean that its advantage passes fp64's largest number ({how}); scale the rewards "
                         f"down, or pass --rl.scale_rewards group")
    return adv_R


def advantages(reward_R: torch.Tensor, group_R: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """A [R] (fp64) of each completion: its reward less its group's mean, over its group's std (scale "group"),
    the batch's ("batch") or 1 ("none"), plus STD_EPS; computed on the rewards scaled as `scaled_stats` does, so
    finite rewards too large for fp64 sums still give their advantages. A ValueError where an advantage itself is
    past fp64 (scale "none": a reward and its group's mean more than 1.8e308 apart)."""
    if scale not in SCALES:
        raise ValueError(f"--rl.scale_rewards must be one of {', '.join(SCALES)}, found {scale!r}")
    x, mean, std, c = scaled_stats(reward_R, group_R, "batch" if scale == "batch" else "group")
    adv = (x - mean) * c if scale == "none" else (x - mean) / (std + STD_EPS / c)
    return finite(adv, reward_R, group_R, f"--rl.scale_rewards {scale}")


def grpo_advantage(reward_R: torch.Tensor, group_R: torch.Tensor, o) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + 1e-4); --rl.scale_rewards batch: the global batch's std, none: no
    division (`advantages`)."""
    return advantages(reward_R, group_R, o.scale_rewards)


def dr_grpo_advantage(reward_R: torch.Tensor, group_R: torch.Tensor, o) -> torch.Tensor:
    """A_i = r_i - mean_g (Dr. GRPO: no division by the std), on exactly scaled rewards (`scaled_stats`)."""
    x, mean, _, c = scaled_stats(reward_R, group_R, "group")
    return finite((x - mean) * c, reward_R, group_R, "--rl.advantage dr_grpo")


def rloo_advantage(reward_R: torch.Tensor, group_R: torch.Tensor, o) -> torch.Tensor:
    """A_i = r_i - (sum_g - r_i) / (n_g - 1): the reward less the mean of the others of its group (RLOO), on
    exactly scaled rewards (`scaled_stats`)."""
    x, mean, _, c = scaled_stats(reward_R, group_R, "group")
    _, inverse = torch.unique(group_R, return_inverse=True)
    n = torch.zeros(int(inverse.max()) + 1, dtype=x.dtype, device=x.device).index_add_(0, inverse,
                                                                                      torch.ones_like(x))[inverse]
    return finite((x - (mean * n - x) / (n - 1)) * c, reward_R, group_R, "--rl.advantage rloo")


ADVANTAGES: dict[str, Callable] = {"grpo": grpo_advantage, "dr_grpo": dr_grpo_advantage, "rloo": rloo_advantage}


# ---- policy losses: (Tokens, settings) -> {"loss": l [R, S], metric: [R, S] per token or [R] per completion} ------

@dataclass(frozen=True)
class Tokens:
    """What a policy-loss row reads of this rank's share of a micro-batch: per token [R, S] the policy's
    log-probabilities (with gradients), the old policy's and the engine's (NaN where it gave none), 1 on trained
    tokens; per completion [R] its advantage and its trained tokens over its whole sequence; seq_sum adds a per-
    completion [R] tensor over the ranks holding parts of its sequence (CP), without gradients."""

    logp_RxS: torch.Tensor
    old_RxS: torch.Tensor
    rollout_RxS: torch.Tensor
    mask_RxS: torch.Tensor
    adv_R: torch.Tensor
    n_R: torch.Tensor
    seq_sum: Callable[[torch.Tensor], torch.Tensor]


def rollout_drift(t: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_t - rollout_t, detached, 0 where the engine gave no log-probability; where it gave one) [R, S]."""
    has = ~torch.isnan(t.rollout_RxS)
    return torch.where(has, t.old_RxS - torch.nan_to_num(t.rollout_RxS), 0.0).detach(), has


def clip_loss(t: Tokens, o) -> dict:
    """rho_t = exp(logp_t - old_t), w_t = sg(min(exp(old_t - rollout_t), tis_cap)) (1 where the engine gave no
    log-probability, or with tis_cap 0): l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) w_t.
    clip_fraction: tokens where the clipped term is the min and differs; tis_capped_fraction: where w_t is the cap."""
    A = t.adv_R[:, None].to(t.logp_RxS.dtype)
    rho = torch.exp(t.logp_RxS - t.old_RxS)
    unclipped, clipped = rho * A, rho.clamp(1 - o.epsilon_low, 1 + o.epsilon_high) * A
    drift, has = rollout_drift(t)
    w = torch.exp(drift).clamp(max=o.tis_cap) if o.tis_cap > 0 else torch.ones_like(drift)
    capped = has & (torch.exp(drift) >= o.tis_cap) if o.tis_cap > 0 else torch.zeros_like(has)
    return {"loss": -torch.minimum(unclipped, clipped) * w, "clip_fraction": (clipped < unclipped).to(A.dtype),
            "tis_capped_fraction": capped.to(A.dtype)}


def gspo_loss(t: Tokens, o) -> dict:
    """s_i = exp(mean over i's trained tokens of (logp_t - old_t)); loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low,
    1 + eps_high) A_i), carried by every trained token of i: l_t = loss_i in value, through s_i's factor
    sg(s_i) exp(logp_t - sg(logp_t)), so the sum of l_t over i's tokens has the value n_i loss_i and its gradient
    (s_i's gradient through every token). seq_clip_fraction: completions where the clipped term is the min."""
    dtype = t.logp_RxS.dtype
    log_s_R = t.seq_sum(((t.logp_RxS - t.old_RxS).detach() * t.mask_RxS).sum(1, dtype=torch.float64))
    s_R = torch.exp(log_s_R / t.n_R.clamp(min=1))
    s_RxS = s_R.to(dtype)[:, None] * torch.exp(t.logp_RxS - t.logp_RxS.detach())
    A = t.adv_R[:, None].to(dtype)
    lo, hi = 1 - o.epsilon_low, 1 + o.epsilon_high
    loss = -torch.minimum(s_RxS * A, s_RxS.clamp(lo, hi) * A)
    A_R = t.adv_R.to(torch.float64)
    return {"loss": loss, "seq_clip_fraction": (s_R.clamp(lo, hi) * A_R < s_R * A_R).to(torch.float64)}


def cispo_loss(t: Tokens, o) -> dict:
    """l_t = -sg(min(rho_t, 1 + eps_high)) A_i logp_t (CISPO: the clipped importance weight, detached, on the
    log-probability). clip_fraction: tokens whose weight is the cap."""
    rho = torch.exp(t.logp_RxS - t.old_RxS).detach()
    A = t.adv_R[:, None].to(t.logp_RxS.dtype)
    return {"loss": -rho.clamp(max=1 + o.epsilon_high) * A * t.logp_RxS,
            "clip_fraction": (rho > 1 + o.epsilon_high).to(A.dtype)}


def rollout_is_loss(t: Tokens, o) -> dict:
    """r_t = exp(logp_t - rollout_t) (no old policy): l_t = -sg(r_t) A_i logp_t where 1 - eps_low < r_t < 1 +
    eps_high, else 0 (the GLM-5 report's agentic loss). rollout_rs_masked_fraction: trained tokens dropped (out
    of the band, or without the engine's log-probability)."""
    has = ~torch.isnan(t.rollout_RxS)
    r = torch.exp(t.logp_RxS - torch.where(has, t.rollout_RxS, t.logp_RxS)).detach()
    keep = has & (r > 1 - o.epsilon_low) & (r < 1 + o.epsilon_high)
    A = t.adv_R[:, None].to(t.logp_RxS.dtype)
    return {"loss": -torch.where(keep, r, 0.0) * A * t.logp_RxS, "rollout_rs_masked_fraction": (~keep).to(A.dtype)}


POLICY_LOSSES: dict[str, Callable[[Tokens, object], dict]] = {
    "clip": clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "rollout_is": rollout_is_loss}
NEEDS_ROLLOUT = ("rollout_is",)  # the rows that read the engine's log-probability of every trained token


# ---- aggregations: this rank's sum of the masked token losses, and the global count it is divided by ------------

def token_sum(l_RxS: torch.Tensor, n_R: torch.Tensor) -> torch.Tensor:
    """The sum of l_t over this rank's trained tokens (fp64)."""
    return l_RxS.sum(dtype=torch.float64)


def sequence_sum(l_RxS: torch.Tensor, n_R: torch.Tensor) -> torch.Tensor:
    """The sum over this rank's completions of their token sums over their whole sequence's trained tokens
    (fp64)."""
    return (l_RxS.sum(1, dtype=torch.float64) / n_R.clamp(min=1)).sum()


def trained_tokens(scored_RxS: torch.Tensor, o) -> torch.Tensor:
    """The global batch's trained tokens (at least 1)."""
    return scored_RxS.sum().clamp(min=1)


def completions(scored_RxS: torch.Tensor, o) -> torch.Tensor:
    """The global batch's completions with a trained token (at least 1)."""
    return scored_RxS.any(1).sum().clamp(min=1)


def completion_budget(scored_RxS: torch.Tensor, o) -> torch.Tensor:
    """The global batch's completions x --rl.max_new_tokens (Dr. GRPO's constant normaliser)."""
    return completions(scored_RxS, o) * o.max_new_tokens


@dataclass(frozen=True)
class Aggregation:
    """The step's value: the sum over ranks and micro-batches of `total(l, n_R)` divided by `units(scored, o)` of
    the global batch (so every layout and micro-batching gives the same value)."""

    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    units: Callable[[torch.Tensor, object], torch.Tensor]


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": Aggregation(token_sum, trained_tokens),  # sum of l_t / trained tokens (DAPO, verl token-mean)
    "sequence_mean": Aggregation(sequence_sum, completions),  # mean over completions of each one's token mean
    "token_sum_norm": Aggregation(token_sum, completion_budget),  # sum of l_t / (completions x max_new_tokens)
}
LOSS_ROWS = {"dapo": ("grpo", "clip", "token_mean"), "grpo": ("grpo", "clip", "sequence_mean")}  # --rl.loss


def rows(o) -> tuple[str, str, str]:
    """(advantage, policy loss, aggregation) of the settings: each --rl flag as given, else its --rl.loss's
    (`LOSS_ROWS`); a ValueError naming the choices for one no table has."""
    if o.loss not in LOSS_ROWS:
        raise ValueError(f"--rl.loss must be one of {', '.join(LOSS_ROWS)}, found {o.loss!r}")
    out = tuple(getattr(o, flag, None) or default for flag, default in
                zip(("advantage", "policy_loss", "aggregation"), LOSS_ROWS[o.loss]))
    for flag, name, table in zip(("advantage", "policy_loss", "aggregation"), out,
                                 (ADVANTAGES, POLICY_LOSSES, AGGREGATIONS)):
        if name not in table:
            raise ValueError(f"--rl.{flag} must be one of {', '.join(table)}, found {name!r}")
    if out[2] == "token_sum_norm" and o.max_new_tokens < 1:
        raise ValueError(f"--rl.aggregation token_sum_norm divides by completions x --rl.max_new_tokens, which must "
                         f"be >= 1; got {o.max_new_tokens}")
    return out


def check_rollout_logprobs(scored_RxS: torch.Tensor, rollout_RxS: torch.Tensor, o) -> None:
    """A ValueError when the policy loss reads the engine's log-probabilities and a trained token of the batch has
    none (read only for such rows)."""
    policy = rows(o)[1]
    if policy in NEEDS_ROLLOUT:
        missing = int((scored_RxS & torch.isnan(rollout_RxS)).sum())
        if missing:
            raise ValueError(f"--rl.policy_loss {policy} weighs each trained token by the rollout engine's "
                             f"log-probability of it, but {missing} of the batch's {int(scored_RxS.sum())} trained "
                             f"tokens have none; give every completion's 'logprobs', or choose another "
                             f"--rl.policy_loss")


def check_source(data, o) -> None:
    """Before training, under a policy loss that reads the engine's log-probabilities: a ValueError at file:line
    for the first completion of in-memory rollouts (`RolloutSource.groups`) that has none."""
    if o is None or rows(o)[1] not in NEEDS_ROLLOUT:
        return
    for g in getattr(data, "groups", ()):
        for i, c in enumerate(g.completions):
            trained = c.example.labels[len(c.example.labels) - len(c.logprobs or []):]
            if c.logprobs is None or any(x != x and t != IGNORE_INDEX for x, t in zip(c.logprobs, trained)):
                what = "has no 'logprobs'" if c.logprobs is None else \
                    "has no log-probability for some trained token (e.g. the eos appended to a text completion)"
                raise ValueError(f"{g.where}: completion {i} {what}; --rl.policy_loss {rows(o)[1]} weighs "
                                 f"each trained token by the rollout engine's log-probability of it; give them, or "
                                 f"choose another --rl.policy_loss")

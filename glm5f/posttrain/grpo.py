"""GRPO, the `grpo` row of the main objectives: over groups of sampled completions (`glm5f.data.rollouts`), the clipped
policy-gradient loss of each completion token with its group-relative advantage, a truncated importance weight for
the rollout engine's drift, and an optional KL to a reference.

Per completion token t of completion i: A_i = (r_i - mean_g) / (std_g + 1e-4) (--rl.scale_rewards group; batch: the
std over the global batch; none: no division; std with Bessel's correction, as torch.std), rho_t = exp(logp_t -
old_t) (old: the policy before this batch's first update), w_t = min(exp(old_t - rollout_t), tis_cap) (detached; 1
without the engine's log-probabilities, or with tis_cap 0), l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 +
eps_high) A_i) w_t + kl_beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1). --rl.loss dapo: the sum of l_t over the
global batch divided by its completion tokens; grpo: the mean over completions of each one's token mean.

Shape suffixes: R rows (one completion each), S sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from glm5f.posttrain import dpo
from glm5f.model.decode import init_cache
from glm5f.core.ops import wide_dtype
from glm5f.core.params import param_count
from glm5f.core.replay import REPLAY_KEYS
from glm5f.train.loss import Context, Objective, micro_batches, micro_loss, with_targets
from glm5f.model.head import head_token_losses
from glm5f.core import IGNORE_INDEX

LOSSES = ("dapo", "grpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4


@dataclass(frozen=True)
class GRPOConfig:
    """The --rl flags the loss reads (configs.RLConfig has them all)."""

    loss: str = "dapo"
    scale_rewards: str = "group"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    tis_cap: float = 2.0
    kl_beta: float = 0.0


def unreplayed_dropped(batch: dict, settings) -> dict:
    """`batch` without the replay records (`replay.REPLAY_KEYS`) --rl.replay does not ask for (the forward then
    chooses those itself)."""
    replayed = getattr(settings, "replayed", ())
    return {k: v for k, v in batch.items() if k not in REPLAY_KEYS or k in replayed}


def _scaled_stats(reward_R: torch.Tensor, group_R: torch.Tensor, scale: str) -> tuple[torch.Tensor, ...]:
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
    _, mean, std, c = _scaled_stats(reward_R, group_R, "group")
    return mean * c, std * c


def advantages(reward_R: torch.Tensor, group_R: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """A [R] (fp64) of each completion: its reward less its group's mean, over its group's std (scale "group"),
    the batch's ("batch") or 1 ("none"), plus STD_EPS; computed on the rewards scaled as `_scaled_stats` does, so
    finite rewards too large for fp64 sums still give their advantages. A ValueError where an advantage itself is
    past fp64 (scale "none": a reward and its group's mean more than 1.8e308 apart)."""
    if scale not in SCALES:
        raise ValueError(f"--rl.scale_rewards must be one of {', '.join(SCALES)}, found {scale!r}")
    x, mean, std, c = _scaled_stats(reward_R, group_R, "batch" if scale == "batch" else "group")
    adv = (x - mean) * c if scale == "none" else (x - mean) / (std + STD_EPS / c)
    if not torch.isfinite(adv).all():
        worst = int(torch.argmax((~torch.isfinite(adv)).to(torch.int8)))
        raise ValueError(f"a reward of {float(reward_R[worst]):.4g} (group {int(group_R[worst])}) is so far from its "
                         f"group's mean that its advantage passes fp64's largest number (--rl.scale_rewards {scale}); "
                         f"scale the rewards down, or pass --rl.scale_rewards group")
    return adv


def no_signal(batch: dict, settings=None) -> str | None:
    """Why a step on `batch` has nothing to learn (None when it has): every group's completions have the same
    reward, so every advantage is 0, and no KL term (--rl.kl_beta) trains."""
    if getattr(settings, "kl_beta", 0) or has_signal(batch):
        return None
    return "every group's completions have the same reward, so every advantage is 0 and there is nothing to learn"


def has_signal(batch: dict) -> bool:
    """Whether some group of the batch has completions with different rewards (else every advantage is 0)."""
    _, std = group_stats(batch["reward"], batch["group"])
    return bool((std > 0).any())


def token_terms(logp: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor, ref: torch.Tensor | None,
                adv_R: torch.Tensor, o) -> dict:
    """Per token [R, S]: "loss" l_t (the module docstring), "clipped" 1 where the clipped term is the min and
    differs, "capped" 1 where w_t is tis_cap, "gap" |old_t - rollout_t| (0 where the engine gave none), "kl" the
    KL term (unweighted)."""
    A = adv_R[:, None].to(logp.dtype)
    rho = torch.exp(logp - old)
    unclipped, clipped = rho * A, rho.clamp(1 - o.epsilon_low, 1 + o.epsilon_high) * A
    has = ~torch.isnan(rollout)
    drift = torch.where(has, old - torch.nan_to_num(rollout), 0.0).detach()
    w = torch.exp(drift).clamp(max=o.tis_cap) if o.tis_cap > 0 else torch.ones_like(drift)
    loss = -torch.minimum(unclipped, clipped) * w
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + o.kl_beta * kl
    capped = has & (torch.exp(drift) >= o.tis_cap) if o.tis_cap > 0 else torch.zeros_like(has)
    return {"loss": loss, "clipped": (clipped < unclipped).to(logp.dtype), "capped": capped.to(logp.dtype),
            "gap": drift.abs(), "kl": kl.detach()}


def prepare(batch: dict, settings) -> dict:
    """The batch with what the loss reads, made on the global batch before any split: "advantage" [R]; the
    engine's and (when given) the old policy's log-probabilities at the targets ("rollout_targets", "old_targets"
    [R, S]); per row its batch's reward std and whether its group's rewards are all equal; "loss_units" the count
    the loss is averaged over (completion tokens for dapo, completions for grpo)."""
    o = settings or GRPOConfig()
    batch = unreplayed_dropped(batch, o)
    if o.loss not in LOSSES:
        raise ValueError(f"--rl.loss must be one of {', '.join(LOSSES)}, found {o.loss!r}")
    scored = batch["targets"] != IGNORE_INDEX
    _, std = group_stats(batch["reward"], batch["group"])
    rollout = batch["rollout_logprobs"].to(torch.float64)
    _, _, batch_std, c = _scaled_stats(batch["reward"], batch["group"], "batch")
    out = {**batch, "advantage": advantages(batch["reward"], batch["group"], o.scale_rewards),
           "rollout_targets": torch.cat([rollout[:, 1:], torch.full_like(rollout[:, :1], float("nan"))], 1),
           "reward_std": batch_std * c, "zero_std": (std == 0).to(torch.float64)}
    out["loss_units"] = (scored.sum() if o.loss == "dapo" else scored.any(1).sum()).clamp(min=1)
    return out


def denoms(batch: dict) -> dict:
    """{"completion_tokens", "completions", "loss_units"} of the global batch (at least 1 each)."""
    scored = batch["targets"] != IGNORE_INDEX
    return {"completion_tokens": scored.sum().clamp(min=1), "completions": scored.any(1).sum().clamp(min=1),
            "loss_units": batch["loss_units"]}


def loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """This rank's share of the GRPO loss over its rows (`loss.Objective.loss`); --rl flags come as
    ctx.step.settings. Under CP each rank holds part of every completion: token sums add over the ranks, each
    completion's token count is its whole sequence's, and the per-completion metrics count on CP rank 0."""
    o = ctx.step.settings or GRPOConfig()
    eps, targets, layout = ctx.cfg.rms_norm_eps, batch["targets"], ctx.layout
    R, S = targets.shape
    hidden_RxSxD, head = ctx.forward(params, batch)
    logp = -head_token_losses(head, hidden_RxSxD, targets, eps).view(R, S)
    old = batch["old_targets"].to(logp.dtype) if "old_targets" in batch else logp.detach()
    ref = None
    if o.kl_beta:
        with torch.no_grad():
            ref_hidden_RxSxD, ref_head = ctx.reference_forward(batch)
            ref = -head_token_losses(ref_head, ref_hidden_RxSxD, targets, eps).view(R, S)
    scored = (targets != IGNORE_INDEX).to(logp.dtype)
    terms = token_terms(logp, old, batch["rollout_targets"].to(logp.dtype), ref, batch["advantage"], o)
    t = {k: v * scored for k, v in terms.items()}
    n_R = layout.seq_sum(scored.sum(1, dtype=torch.float64))  # each completion's tokens, over the CP group
    is_completion = (n_R > 0).to(torch.float64) * float(layout.cp_rank == 0)
    if o.loss == "dapo":
        total = t["loss"].sum(dtype=torch.float64)
    else:
        total = (t["loss"].sum(1, dtype=torch.float64) / n_R.clamp(min=1)).sum()
    sums = {"loss": total}
    per_row = lambda v: (v.to(torch.float64) * is_completion).sum()  # noqa: E731
    sums.update(reward=per_row(batch["reward"]), reward_std=per_row(batch["reward_std"]),
                frac_reward_zero_std=per_row(batch["zero_std"]), advantage_abs=per_row(batch["advantage"].abs()),
                completion_length=scored.sum(dtype=torch.float64),
                clip_fraction=t["clipped"].sum(dtype=torch.float64),
                tis_capped_fraction=t["capped"].sum(dtype=torch.float64),
                rollout_logprob_gap=t["gap"].sum(dtype=torch.float64),
                rollout_logprob_gap_max=t["gap"].max().to(torch.float64) if t["gap"].numel() else
                torch.zeros((), dtype=torch.float64),
                kl=t["kl"].sum(dtype=torch.float64))
    return total / ctx.denoms["loss_units"], sums


# ---- the old policy's log-probabilities (--rl.updates_per_batch > 1) ----------------------------------------------

def _logp_loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """The log-probability of each target of this rank's share, written at its global (row, position) into a
    [rows, positions] table of the micro-batch (zeros elsewhere) as the sum "logp"."""
    targets = batch["targets"]
    R, S = targets.shape
    hidden_RxSxD, head = ctx.forward(params, batch)
    logp = -head_token_losses(head, hidden_RxSxD, targets, ctx.cfg.rms_norm_eps).view(R, S)
    table = torch.zeros(batch["table_shape"], dtype=torch.float64, device=logp.device)
    table[batch["table_row"], batch["table_pos"]] = logp.to(torch.float64)
    return logp.sum() * 0, {"logp": table}


LOGP = Objective(_logp_loss, lambda batch: {}, {})


@torch.no_grad()
def old_logprobs(params: dict, batch: dict, cfg, layout, step) -> torch.Tensor:
    """The policy's log-probability of each target of the global batch [R, S] (fp64; 0 where no target), computed
    as the step computes them (the same micro-batches, rank shares, dtypes and layers), every rank ending with the
    whole table: GRPO's old_t, taken before a batch's first update."""
    b = with_targets(unreplayed_dropped(batch, step.settings))
    R, S = b["targets"].shape
    b["table_row"] = torch.arange(R, device=b["targets"].device)[:, None].expand(R, S)
    b["table_pos"] = torch.arange(S, device=b["targets"].device).expand(R, S)
    s = dataclasses.replace(step, objective=LOGP, objectives=dataclasses.replace(step.objectives, seq_aux=False,
                                                                                   indexer_loss="off", mtp_depths=0),
                            coeffs={})
    out, row = torch.zeros(R, S, dtype=torch.float64, device=b["targets"].device), 0
    for mb in micro_batches(b, step.grad_accum):
        n = len(mb["targets"])
        mb = {**mb, "table_row": mb["table_row"] - row, "table_shape": (n, S)}
        _, (sums, _) = micro_loss(params, mb, {}, cfg, layout, s)
        out[row:row + n] = layout.sum(sums["logp"])
        row += n
    return torch.where(b["targets"] != IGNORE_INDEX, out, 0.0)


PER_TOKEN = ("completion_length", "clip_fraction", "tis_capped_fraction", "rollout_logprob_gap", "kl")
METRICS = {"loss": "loss_units", **{k: "completions" for k in ("reward", "reward_std", "frac_reward_zero_std",
                                                                   "advantage_abs", "completion_length")},
           **{k: "completion_tokens" for k in PER_TOKEN if k != "completion_length"},
           "rollout_logprob_gap_max": "max"}


def plan_bytes(model_cfg, run, state: dict) -> int:
    """Bytes per rank beyond the LM step: the reference (`dpo.plan_bytes`) when --rl.kl_beta asks for one; with
    sampled prompts (--data.type prompts) also the sampler's, while it decodes: its decode cache of this rank's
    rows (`decode.init_cache`, --data.seq_len positions) and its whole copy of the weights in the compute dtype
    (gathered under a multi-process layout; a LoRA run's merged base; none in one process keeping them in it)."""
    total = dpo.plan_bytes(model_cfg, run, state) if needs_reference(run.settings) else 0
    if run.data_type == "prompts":
        act = run.dtypes[0]
        cache = init_cache(model_cfg, -(-run.batch_size // run.world), run.seq_len, act, "meta")
        total += sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.values())
        if run.world > 1:
            total += param_count(model_cfg) * act.itemsize
        elif run.lora_rank or act != wide_dtype(act):
            total += state["params"] * act.itemsize // wide_dtype(act).itemsize
    return total


def needs_reference(settings) -> bool:
    """Whether the run keeps a reference model: only for the KL term."""
    return bool(settings is not None and settings.kl_beta)


GRPO = Objective(loss, denoms, METRICS, prepare=prepare, plan_bytes=plan_bytes,
                 data_types=("rollouts", "prompts"), settings="rl", reference=needs_reference, no_signal=no_signal)

"""GRPO, the `grpo` row of the main objectives: over groups of sampled completions (`glm5f.data.rollouts`), the clipped
policy-gradient loss of each completion token with its group-relative advantage, a truncated importance weight for
the rollout engine's drift, and an optional KL to a reference.

Per completion token t of completion i: A_i = (r_i - mean_g) / (std_g + 1e-4) (--rl.scale_rewards group; batch: the
std over the global batch; none: no division; std with Bessel's correction, as torch.std), rho_t = exp(logp_t -
old_t) (old: the policy before this batch's first update), w_t = min(exp(old_t - rollout_t), tis_cap) (detached; 1
without the engine's log-probabilities, or with tis_cap 0), l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 +
eps_high) A_i) w_t + kl_beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1). --rl.loss dapo: the sum of l_t over the
global batch divided by its completion tokens; grpo: the mean over completions of each one's token mean. These are
two rows of each of rl_losses' tables (--rl.advantage, --rl.policy_loss, --rl.aggregation), which hold the others.

Shape suffixes: R rows (one completion each), S sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from glm5f.posttrain import dpo, rl_losses
from glm5f.posttrain.rl_losses import group_stats
from glm5f.model.decode import init_cache
from glm5f.core.ops import wide_dtype
from glm5f.core.params import param_count
from glm5f.core.replay import REPLAY_KEYS
from glm5f.train.loss import Context, Objective, micro_batches, micro_loss, with_targets
from glm5f.model.head import head_token_losses
from glm5f.core import IGNORE_INDEX


@dataclass(frozen=True)
class GRPOConfig:
    """The --rl flags the loss reads (configs.RLConfig has them all)."""

    loss: str = "dapo"
    scale_rewards: str = "group"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    tis_cap: float = 2.0
    kl_beta: float = 0.0
    advantage: str | None = None  # None: --rl.loss's (rl_losses.LOSS_ROWS)
    policy_loss: str | None = None
    aggregation: str | None = None
    max_new_tokens: int = 64


def unreplayed_dropped(batch: dict, settings) -> dict:
    """`batch` without the replay records (`replay.REPLAY_KEYS`) --rl.replay does not ask for (the forward then
    chooses those itself)."""
    replayed = getattr(settings, "replayed", ())
    return {k: v for k, v in batch.items() if k not in REPLAY_KEYS or k in replayed}


def has_signal(batch: dict) -> bool:
    """Whether some group of the batch has completions with different rewards (else every advantage is 0)."""
    _, std = group_stats(batch["reward"], batch["group"])
    return bool((std > 0).any())


def prepare(batch: dict, settings) -> dict:
    """The batch with what the loss reads, made on the global batch before any split: "advantage" [R]; the
    engine's and (when given) the old policy's log-probabilities at the targets ("rollout_targets", "old_targets"
    [R, S]); per row its batch's reward std and whether its group's rewards are all equal; "loss_units" the count
    the loss is averaged over (its --rl.aggregation's units)."""
    o = settings or GRPOConfig()
    batch = unreplayed_dropped(batch, o)
    advantage, _, aggregation = rl_losses.rows(o)
    scored = batch["targets"] != IGNORE_INDEX
    _, std = group_stats(batch["reward"], batch["group"])
    rollout = batch["rollout_logprobs"].to(torch.float64)
    out = {**batch, "advantage": rl_losses.ADVANTAGES[advantage](batch["reward"], batch["group"], o),
           "rollout_targets": torch.cat([rollout[:, 1:], torch.full_like(rollout[:, :1], float("nan"))], 1),
           "reward_std": batch["reward"].to(torch.float64).std().expand(len(scored)),
           "zero_std": (std == 0).to(torch.float64)}
    rl_losses.check_rollout_logprobs(scored, out["rollout_targets"], o)
    out["loss_units"] = rl_losses.AGGREGATIONS[aggregation].units(scored, o)
    return out


def denoms(batch: dict) -> dict:
    """{"completion_tokens", "completions", "loss_units", "rollout_tokens" (those with the engine's log-probability)}
    of the global batch (at least 1 each)."""
    scored = batch["targets"] != IGNORE_INDEX
    return {"completion_tokens": scored.sum().clamp(min=1), "completions": scored.any(1).sum().clamp(min=1),
            "loss_units": batch["loss_units"],
            "rollout_tokens": (~torch.isnan(batch["rollout_targets"])).sum().clamp(min=1)}


def loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """This rank's share of the GRPO loss over its rows (`loss.Objective.loss`); --rl flags come as
    ctx.step.settings. Under CP each rank holds part of every completion: token sums add over the ranks, each
    completion's token count is its whole sequence's, and the per-completion metrics count on CP rank 0."""
    o = ctx.step.settings or GRPOConfig()
    _, policy, aggregation = rl_losses.rows(o)
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
    n_R = layout.seq_sum(scored.sum(1, dtype=torch.float64))  # each completion's tokens, over the CP group
    tokens = rl_losses.Tokens(logp, old, batch["rollout_targets"].to(logp.dtype), scored, batch["advantage"], n_R,
                              layout.seq_sum)
    terms = rl_losses.POLICY_LOSSES[policy](tokens, o)
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        terms["loss"] = terms["loss"] + o.kl_beta * kl
    drift, has = rl_losses.rollout_drift(tokens)
    t = {"loss": terms["loss"] * scored, "gap": drift.abs() * scored, "kl": kl.detach() * scored}
    is_completion = (n_R > 0).to(torch.float64) * float(layout.cp_rank == 0)
    total = rl_losses.AGGREGATIONS[aggregation].total(t["loss"], n_R)
    sums = {"loss": total}
    per_row = lambda v: (v.to(torch.float64) * is_completion).sum()  # noqa: E731
    sums.update(reward=per_row(batch["reward"]), reward_std=per_row(batch["reward_std"]),
                frac_reward_zero_std=per_row(batch["zero_std"]), advantage_abs=per_row(batch["advantage"].abs()),
                completion_length=scored.sum(dtype=torch.float64))
    sums.update({k: (v * scored).sum(dtype=torch.float64) if v.ndim == 2 else per_row(v)
                 for k, v in terms.items() if k != "loss"})  # the policy loss's own
    sums.update(rollout_logprob_gap=t["gap"].sum(dtype=torch.float64),
                rollout_logprob_gap_max=t["gap"].max().to(torch.float64) if t["gap"].numel() else
                torch.zeros((), dtype=torch.float64),
                rollout_logprob_masked_fraction=(has & (scored == 0)).sum(dtype=torch.float64),
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


PER_TOKEN = ("completion_length", "clip_fraction", "tis_capped_fraction", "rollout_logprob_gap", "kl",
             "rollout_rs_masked_fraction")
METRICS = {"loss": "loss_units", **{k: "completions" for k in ("reward", "reward_std", "frac_reward_zero_std",
                                                                   "advantage_abs", "completion_length",
                                                                   "seq_clip_fraction")},
           **{k: "completion_tokens" for k in PER_TOKEN if k != "completion_length"},
           "rollout_logprob_gap_max": "max", "rollout_logprob_masked_fraction": "rollout_tokens"}


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
                 data_types=("rollouts", "prompts"), settings="rl", reference=needs_reference)

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

import math
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from glm5f.data.chat import ChatFormat
from glm5f.data.notes import print_warning
from glm5f.data.rollout_trees import REASONS, tree_rows
from glm5f.data.rollouts import ReadOptions, RolloutSource, file_group_size, read_groups, rollout_batch
from glm5f.data.sources import model_tokenizer
from glm5f.model import lora
from glm5f.parallel.layout import full_tensor
from glm5f.posttrain import dpo, rl_losses, sampler
from glm5f.posttrain.agent import AgentSettings, AgentSource
from glm5f.posttrain.rl_losses import group_stats
from glm5f.model.decode import init_cache
from glm5f.core.ops import wide_dtype
from glm5f.core.params import leaf_dtype, map_with_path, param_count
from glm5f.core.replay import REPLAY_KEYS
from glm5f.train.feed import Feed, on_device
from glm5f.train.loss import Context, Objective, logprob_table, with_targets
from glm5f.model.logprobs import head_logprobs
from glm5f.core import IGNORE_INDEX


@dataclass
class RLConfig(AgentSettings):
    """The --rl flags (mounted as Config.rl by the objective table): GRPO's loss, its batch schedule, and the
    on-policy sampler's settings (`sampler.decode_rows` reads group_size, temperature, top_p, max_new_tokens and
    `replayed`)."""

    loss: Literal["dapo", "grpo"] = "dapo"
    """GRPO: how token losses become the step's: dapo, their sum over the global batch's completion tokens; grpo,
    the mean over completions of each one's token mean."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """GRPO: advantages are (reward - its group's mean) over the group's reward std (group), the global batch's
    (batch) or 1 (none); std with Bessel's correction, plus 1e-4."""
    epsilon_low: float = 0.2
    """GRPO: the ratio exp(logp - old) is clipped below at 1 - epsilon_low."""
    epsilon_high: float = 0.28
    """GRPO: the ratio is clipped above at 1 + epsilon_high."""
    tis_cap: float = 2.0
    """GRPO: cap of the truncated importance weight exp(old - rollout) that corrects for the rollout engine's
    log-probabilities (a completion's "logprobs"); 0: no weight."""
    kl_beta: float = 0.0
    """GRPO: weight of the KL estimate exp(ref - logp) - (ref - logp) - 1 to the reference (--rl.reference, default
    the run's starting weights; a LoRA run's base); 0: none, and no reference is kept."""
    reference: Optional[str] = None
    """GRPO with --rl.kl_beta: the KL's reference model, a Transformers checkpoint directory of the trained
    architecture; default the run's starting weights (a LoRA run: its base with the adapters off)."""
    updates_per_batch: int = 1
    """GRPO: optimizer steps taken on each batch of groups (each a --train.steps step); the ratio's old
    log-probabilities are the policy's before the batch's first one."""
    replay: str = ""
    """GRPO: what the forward takes from the rollouts' records instead of choosing it (comma-separated): routing,
    each MoE layer's experts; indexer, each DSA layer's selected keys (GLM-5.3: pools). Empty: none."""
    group_size: int = 8
    """Sampling (--data.type prompts): completions sampled per prompt (at least 2: a group's advantages compare
    them)."""
    temperature: float = 1.0
    """Sampling (--data.type prompts): the temperature (0: greedy); the recorded log-probabilities are at
    temperature 1."""
    top_p: float = 1.0
    """Sampling (--data.type prompts): nucleus sampling, from the most likely tokens holding this much
    probability."""
    max_new_tokens: int = 64
    """Sampling (--data.type prompts): most tokens sampled per completion (a stop token ends one sooner); a prompt
    and this many tokens must fit --data.seq_len."""
    filter_flat_groups: bool = False
    """Sampling (--data.type prompts): a sampled group whose completions' rewards are all equal (advantage 0) is
    dropped and more prompts are sampled until the batch holds --data.batch_size groups (DAPO's dynamic sampling,
    verl's filter_groups); the surplus of the last round is dropped too. Logged: groups_sampled,
    groups_flat_dropped, sample_rounds, groups_flat_kept."""
    max_sample_rounds: int = 4
    """Sampling with --rl.filter_flat_groups: most rounds of --data.batch_size prompts sampled for one batch (the
    first included); when they leave it short, the batch is filled with the last flat groups sampled (advantage 0:
    no policy gradient; counted as groups_flat_kept, and said)."""
    reward: Optional[str] = None
    """Sampling (--data.type prompts): the reward function(s), module:function (imported with the working directory
    and PYTHONPATH on the path), comma-separated for several; each in glm5f's form (per completion: prompt,
    completion, prompt_ids, completion_ids, a chat record's messages, the record's other fields; a number back),
    TRL's (per group: prompts, completions, completion_ids and the fields as lists; a list back) or verl's
    compute_score(data_source, solution_str, ground_truth, extra_info), told apart by its parameter names
    (glm5f.posttrain.rewards.form_of). glm5f.posttrain.rewards:lowercase_share is the toy task's."""
    reward_weights: str = ""
    """Sampling: the weight of each --rl.reward function (comma-separated, as many as functions; default 1 each):
    a completion's reward is the weighted sum, each function's mean logged as rewards/NAME/mean (as TRL)."""
    reward_workers: int = 1
    """Sampling: threads the reward calls run on (1: one after the other); the rewards are the same whatever it is."""

    advantage: Optional[Literal["grpo", "dr_grpo", "rloo"]] = None
    """GRPO: the advantage row (glm5f.posttrain.rl_losses.ADVANTAGES, docs/posttraining.md). None: grpo."""
    policy_loss: Optional[Literal["clip", "gspo", "cispo", "rollout_is"]] = None
    """GRPO: the per-token policy loss row (rl_losses.POLICY_LOSSES; rollout_is needs every completion's logprobs).
    None: clip."""
    aggregation: Optional[Literal["token_mean", "sequence_mean", "token_sum_norm"]] = None
    """GRPO: how token losses become the step's (rl_losses.AGGREGATIONS; token_sum_norm divides by completions x
    --rl.max_new_tokens). None: --rl.loss dapo's token_mean, grpo's sequence_mean."""
    mask_truncated: bool = False
    """GRPO: a completion the engine cut ("finish_reason": "length" or "truncated": true; no eos is appended to it)
    is left out of the loss (its reward still counts in its group's statistics), as TRL's
    mask_truncated_completions."""

    @property
    def replayed(self) -> tuple[str, ...]:
        """The --rl.replay names, in order."""
        return tuple(n.strip() for n in self.replay.split(",") if n.strip())


def unreplayed_dropped(batch: dict, settings) -> dict:
    """`batch` without the replay records (`replay.REPLAY_KEYS`) --rl.replay does not ask for (the forward then
    chooses those itself)."""
    replayed = getattr(settings, "replayed", ())
    return {k: v for k, v in batch.items() if k not in REPLAY_KEYS or k in replayed}


def completions_of(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reward [R], group [R], where they sit in batch["group"]: a bool mask of its shape) of the batch's
    completions: one per row, or in a tree batch (`rollout_trees.tree_rows`) the filled completion slots [B, K]."""
    here = batch["group"] >= 0
    return batch["reward"][here], batch["group"][here], here


def placed(batch: dict, values_R: torch.Tensor) -> torch.Tensor:
    """Per-completion values [R] placed as batch["group"] holds the completions (0 in a tree's empty slots)."""
    _, _, here = completions_of(batch)
    return torch.zeros(here.shape, dtype=values_R.dtype, device=values_R.device).masked_scatter(here, values_R)


def completion_rows(batch: dict, x_BxS: torch.Tensor, fill=0.0) -> torch.Tensor:
    """Per-token x [R, S] with one completion per row: as it is, or of a tree batch [B K, S], row b K + k holding x
    at the tokens of row b's k-th completion ("completion_slot") and `fill` elsewhere, so each completion's sums are
    those of its own sequence."""
    slot_BxS = batch.get("completion_slot")
    if slot_BxS is None:
        return x_BxS
    K = batch["group"].shape[1]
    member_BxKxS = slot_BxS[:, None, :] == torch.arange(K, device=slot_BxS.device)[:, None]
    return torch.where(member_BxKxS, x_BxS[:, None, :], fill).flatten(0, 1)


def has_signal(batch: dict) -> bool:
    """Whether some group of the batch has completions with different rewards (else every advantage is 0)."""
    reward, group, _ = completions_of(batch)
    _, std = group_stats(reward, group)
    return bool((std > 0).any())


def prepare(batch: dict, settings) -> dict:
    """The batch with what the loss reads, made on the global batch before any split: "advantage"; the engine's
    and (when given) the old policy's log-probabilities at the targets ("rollout_targets", "old_targets" [R, S]);
    per completion its batch's reward std and whether its group's rewards are all equal; "loss_units" the count the
    loss is averaged over (its --rl.aggregation's units). Per-completion values are [R], or in a tree batch [B, K]
    as its "group" (`completions_of`); a tree batch's targets sit at the token they name, and so its
    "rollout_targets" (`train.loss.with_targets`)."""
    o = settings or RLConfig()
    batch = unreplayed_dropped(batch, o)
    advantage, _, aggregation = rl_losses.rows(o)
    scored = batch["targets"] != IGNORE_INDEX
    reward, group, _ = completions_of(batch)
    _, std = group_stats(reward, group)
    rollout = batch["rollout_logprobs"].to(torch.float64)
    _, _, batch_std, c = rl_losses.scaled_stats(reward, group, "batch")
    nan = torch.full_like(rollout[:, :1], float("nan"))
    targets = torch.cat([rollout[:, 1:], nan], 1) if batch.get("tree_prev") is None else \
        rollout.masked_fill(batch["tree_prev"] < 0, float("nan"))
    out = {**batch, "advantage": placed(batch, rl_losses.ADVANTAGES[advantage](reward, group, o)),
           "rollout_targets": targets, "reward_std": placed(batch, batch_std * c),
           "zero_std": placed(batch, (std == 0).to(torch.float64))}
    rl_losses.check_rollout_logprobs(scored, out["rollout_targets"], o)
    out["loss_units"] = rl_losses.AGGREGATIONS[aggregation].units(completion_rows(batch, scored, False), o)
    return out


def denoms(batch: dict) -> dict:
    """{"completion_tokens", "completions", "loss_units", "rollout_tokens" (those with the engine's log-probability),
    "step" (1)} of the global batch (at least 1 each)."""
    scored = batch["targets"] != IGNORE_INDEX
    return {"completion_tokens": scored.sum().clamp(min=1),
            "completions": completion_rows(batch, scored, False).any(1).sum().clamp(min=1),
            "loss_units": batch["loss_units"],
            "rollout_tokens": (~torch.isnan(batch["rollout_targets"])).sum().clamp(min=1),
            "step": torch.ones((), dtype=torch.float64, device=scored.device)}


def loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """This rank's share of the GRPO loss over its rows (`loss.Objective.loss`); --rl flags come as
    ctx.step.settings. Under CP each rank holds part of every completion: token sums add over the ranks, each
    completion's token count is its whole sequence's, and the per-completion metrics count on CP rank 0."""
    o = ctx.step.settings or RLConfig()
    _, policy, aggregation = rl_losses.rows(o)
    eps, targets, layout = ctx.cfg.rms_norm_eps, batch["targets"], ctx.layout
    hidden_BxSxD, head = ctx.forward(params, batch)
    logp_BxS = head_logprobs(head, hidden_BxSxD, targets, eps)
    rows = lambda x_BxS, fill=0.0: completion_rows(batch, x_BxS, fill)  # noqa: E731  (a tree's: per completion)
    logp = rows(logp_BxS)
    old = rows(batch["old_targets"].to(logp.dtype)) if "old_targets" in batch else logp.detach()
    ref = None
    if o.kl_beta:
        with torch.no_grad():
            ref_hidden_BxSxD, ref_head = ctx.reference_forward(batch)
            ref = rows(head_logprobs(ref_head, ref_hidden_BxSxD, targets, eps))
    scored = rows((targets != IGNORE_INDEX).to(logp.dtype))
    n_R = layout.seq_sum(scored.sum(1, dtype=torch.float64))  # each completion's tokens, over the CP group
    per = {k: batch[k].flatten() for k in ("advantage", "reward", "reward_std", "zero_std")}
    tokens = rl_losses.Tokens(logp, old, rows(batch["rollout_targets"].to(logp.dtype), float("nan")), scored,
                              per["advantage"], n_R, layout.seq_sum)
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
    sums.update(reward=per_row(per["reward"]), reward_std=per_row(per["reward_std"]),
                frac_reward_zero_std=per_row(per["zero_std"]), advantage_abs=per_row(per["advantage"].abs()),
                completion_length=scored.sum(dtype=torch.float64))
    sums.update({k: (v * scored).sum(dtype=torch.float64) if v.ndim == 2 else per_row(v)
                 for k, v in terms.items() if k != "loss"})  # the policy loss's own
    sums.update(rollout_logprob_gap=t["gap"].sum(dtype=torch.float64),
                rollout_logprob_gap_max=t["gap"].max().to(torch.float64) if t["gap"].numel() else
                torch.zeros((), dtype=torch.float64),
                rollout_logprob_masked_fraction=(has & (scored == 0)).sum(dtype=torch.float64),
                kl=t["kl"].sum(dtype=torch.float64))
    for name in STEP_COUNTS:  # the tokens the rows run and their sequences', the prefixes a tree could not share
        if name in batch:
            sums[name] = batch[name].sum(dtype=torch.float64) * float(layout.cp_rank == 0)
    return total / ctx.denoms["loss_units"], sums


STEP_COUNTS = ("tokens_computed", "tokens_unshared", *(f"prefixes_unshared_{why}" for why in REASONS))
PER_TOKEN = ("completion_length", "clip_fraction", "tis_capped_fraction", "rollout_logprob_gap", "kl",
             "rollout_rs_masked_fraction")
METRICS = {"loss": "loss_units", **{k: "completions" for k in ("reward", "reward_std", "frac_reward_zero_std",
                                                                   "advantage_abs", "completion_length",
                                                                   "seq_clip_fraction")},
           **{k: "completion_tokens" for k in PER_TOKEN if k != "completion_length"},
           "rollout_logprob_gap_max": "max", "rollout_logprob_masked_fraction": "rollout_tokens",
           **{k: "step" for k in STEP_COUNTS}}


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


# ---- the run's hooks (`loss.Objective`) ---------------------------------------------------------------------------

def check(cfg) -> list[str]:
    """What is wrong with the --rl flags of a GRPO run."""
    r, errs = cfg.rl, []
    if cfg.data.type in ("rollouts", "prompts") and not cfg.data.path:
        errs.append(f"--data.type {cfg.data.type} needs --data.path")
    unknown = [n for n in r.replayed if n not in ("routing", "indexer")]
    if unknown:
        errs.append(f"--rl.replay takes routing and/or indexer (comma-separated), found {', '.join(unknown)}")
    if cfg.data.type == "prompts":
        if not r.reward and r.environment is None:
            errs.append("--data.type prompts needs --rl.reward module:function (the reward of a sampled completion)")
        errs += reward_errors(r)
        if r.max_sample_rounds < 1:
            errs.append(f"--rl.max_sample_rounds must be >= 1 (the first round is one), found {r.max_sample_rounds}")
        if r.group_size < 2 or r.max_new_tokens < 1 or r.temperature < 0 or not 0 < r.top_p <= 1:
            errs.append(f"--rl.group_size must be >= 2, --rl.max_new_tokens >= 1, --rl.temperature >= 0 and "
                        f"--rl.top_p in (0, 1]; got {r.group_size}, {r.max_new_tokens}, {r.temperature}, {r.top_p}")
        if cfg.parallel.cp > 1:
            errs.append("--data.type prompts does not run under --parallel.cp (the decoder does not); sample with "
                        "scripts/rollouts.py and train on --data.type rollouts, or drop --parallel.cp")
    if not (0 <= r.epsilon_low < 1 and r.epsilon_high >= 0 and r.tis_cap >= 0 and r.kl_beta >= 0
            and r.updates_per_batch >= 1):
        errs.append(f"--rl.epsilon_low must lie in [0, 1), --rl.epsilon_high, --rl.tis_cap and --rl.kl_beta be >= 0 "
                    f"and --rl.updates_per_batch >= 1; got {r.epsilon_low}, {r.epsilon_high}, {r.tis_cap}, "
                    f"{r.kl_beta}, {r.updates_per_batch}")
    if r.filter_flat_groups and cfg.data.type != "prompts":
        errs.append(f"--rl.filter_flat_groups samples more prompts when groups are flat: it needs --data.type prompts, "
                    f"found {cfg.data.type} (a rollouts file's groups are what they are)")
    if r.reference and not r.kl_beta:
        errs.append(f"--rl.reference {r.reference} is the KL term's reference, and --rl.kl_beta is 0 (no KL term): "
                    f"pass --rl.kl_beta > 0, or drop --rl.reference")
    return errs + dpo.reference_errors("rl", r.reference, cfg)


def reward_errors(r) -> list[str]:
    """What is wrong with --rl.reward_weights and --rl.reward_workers (their form; the functions load later)."""
    errs, n = [], len([x for x in (r.reward or "").split(",") if x.strip()])
    if r.reward_weights.strip():
        try:
            ws = [float(w) for w in r.reward_weights.split(",")]
        except ValueError:
            ws = None
        if ws is None or not all(math.isfinite(w) for w in ws) or len(ws) != n:
            errs.append(f"--rl.reward_weights takes one finite number per --rl.reward function (comma-separated: "
                        f"{n} for --rl.reward {r.reward}), found {r.reward_weights!r}")
    if r.reward_workers < 1:
        errs.append(f"--rl.reward_workers must be >= 1 (1: the calls one after the other), found {r.reward_workers}")
    if r.enabled and (n > 1 or r.reward_weights.strip() or r.reward_workers != 1):
        errs.append("agent episodes (--rl.tools, --rl.environment) take one --rl.reward function (messages, ids, "
                    "loss_mask); drop --rl.reward_weights and --rl.reward_workers, or give one function")
    return errs


def source(cfg, model_cfg, layout, tokenizer_path: str | None, warn):
    """The run's data source: --data.type rollouts, the groups of --data.path (`rollouts.RolloutSource`, their
    replay records checked against the model); prompts, its prompt records, sampled each batch with the --rl flags
    and scored by --rl.reward (`sampler.PromptSource`, its sampling generator seeded by --train.seed). What
    --data.skip_overlong left out is said in one warning line."""
    d, r = cfg.data, cfg.rl
    tok = model_tokenizer(tokenizer_path, model_cfg.vocab_size)
    fmt = ChatFormat.load(tokenizer_path, d.chat_template)
    if d.type != "prompts":
        options = ReadOptions(d.format, d.group_key, r.replayed, r.mask_truncated)
        data = RolloutSource(read_groups(d.path, tok, fmt, model_cfg, options), d.batch_size, d.seq_len,
                             model_cfg.vocab_size, d.seed, tok.pad_id, d.path, d.skip_overlong, d.share_prefixes,
                             r.replayed)
        rl_losses.check_source(data, r)  # a rollouts file without what --rl.policy_loss reads, at file:line
    elif r.enabled:  # --rl.tools or --rl.environment: multi-turn episodes
        data = AgentSource(d.path, d.batch_size, d.seq_len, model_cfg, d.seed, r, r, fmt, r.reward, cfg.train.seed,
                           layout.device, d.skip_overlong)
    else:
        reward = sampler.load_rewards(r.reward, r.reward_weights, r.reward_workers)
        data = sampler.PromptSource(sampler.read_prompts(d.path, tok, fmt), d.batch_size, d.seq_len, model_cfg,
                                    d.seed, tok.pad_id, r, reward, f"--rl.reward {r.reward}", tok, cfg.train.seed,
                                    layout.device, d.skip_overlong)
        data.share_prefixes = d.share_prefixes  # GRPOFeed lays its sampled batches out as trees
    if data.skipped is not None:
        warn(data.skipped.line())
    return data


class GRPOFeed(Feed):
    """GRPO's batch schedule: each batch of groups gets --rl.updates_per_batch updates, the ratio's old
    log-probabilities (`old_logprobs`) taken before its first; sampled prompts are sampled when a batch starts, by
    the policy the step trains (`decoding_params`), the sampling time logged as sample_time_s."""

    per_batch_flag = "--rl.updates_per_batch"

    def __init__(self, data, trainer):
        super().__init__(data, trainer)
        self.per_batch = trainer.step.settings.updates_per_batch
        self.sampled = isinstance(data, sampler.PromptSource)
        self.trees = self.sampled and getattr(data, "share_prefixes", False)  # --data.share_prefixes

    def next(self, state, step: int) -> dict:
        s = self.trainer.step.settings
        self.metrics = ({"sample_time_s": 0.0, **(dict.fromkeys(FILTER_COUNTS, 0) if s.filter_flat_groups else {})}
                        if self.sampled else {})
        return super().next(state, step)

    def fetch(self, state) -> dict:
        t, layout, s = self.trainer, self.trainer.layout, self.trainer.step.settings
        if self.sampled:  # sampled now, by the policy this step trains
            t0 = time.perf_counter()
            params = decoding_params(state, t.step)
            if s.filter_flat_groups:
                groups, counts = groups_with_signal(lambda: self.data.next_groups(params, layout), self.data.B,
                                                    s.max_sample_rounds)
                if counts["groups_flat_kept"] and layout.is_main:
                    print_warning(f"--rl.max_sample_rounds {s.max_sample_rounds}: after {s.max_sample_rounds} "
                                  f"rounds {counts['groups_flat_kept']} of the batch's {self.data.B} groups are flat "
                                  f"(all rewards equal): they fill it, adding no policy gradient")
            else:
                groups, counts = self.data.next_groups(params, layout), {}
            batch = rollout_batch(groups, self.data.S, self.data.pad_id)
            if self.trees:  # each group's prompt once, its completions branching from it
                batch = tree_rows(batch, self.data.S, self.data.pad_id, s.replayed)
            batch = on_device(batch, layout.device)
            self.metrics = {"sample_time_s": time.perf_counter() - t0, **counts, **reward_means(groups),
                            **sampler.episode_metrics(groups)}
        else:
            batch = super().fetch(state)
        if self.per_batch > 1:  # the ratio's old log-probabilities: the policy's before the batch's first update
            batch["old_targets"] = old_logprobs(state.params, batch, t.model_cfg, layout, t.step)
        return batch


def reward_means(groups: list) -> dict:
    """{rewards/NAME/mean: the mean of reward function NAME over the groups' completions} of sampled groups
    (`sampler.ScoredGroup`; TRL's metric names)."""
    names = getattr(groups[0], "rewards", {}) if groups else {}
    return {f"rewards/{n}/mean": sum(sum(g.rewards[n]) for g in groups) / sum(len(g.rewards[n]) for g in groups)
            for n in names}


FILTER_COUNTS = ("groups_sampled", "groups_flat_dropped", "sample_rounds", "groups_flat_kept")


def is_flat(g) -> bool:
    """Whether every completion of group `g` has the same reward (each advantage 0)."""
    return len({c.reward for c in g.completions}) == 1


def groups_with_signal(sample, size: int, max_rounds: int) -> tuple[list, dict]:
    """(`size` groups, the FILTER_COUNTS): rounds of `sample()` (a list of groups each), its flat groups
    (`is_flat`) dropped, until `size` groups are kept (in the order sampled; the surplus of the last round dropped)
    or `max_rounds` rounds ran; then the batch is filled with the last flat groups sampled (groups_flat_kept)."""
    kept, flat, rounds, sampled = [], [], 0, 0
    while len(kept) < size and rounds < max_rounds:
        groups = sample()
        rounds, sampled = rounds + 1, sampled + len(groups)
        kept += [g for g in groups if not is_flat(g)]
        flat += [g for g in groups if is_flat(g)]
    short = max(size - len(kept), 0)
    fill = flat[len(flat) - short:] if short else []
    return kept[:size] + fill, {"groups_sampled": sampled, "groups_flat_dropped": len(flat) - short,
                                "sample_rounds": rounds, "groups_flat_kept": short}


@torch.no_grad()
def old_logprobs(params: dict, batch: dict, cfg, layout, step) -> torch.Tensor:
    """The policy's log-probability of each target of the global batch [R, S] (fp64; 0 where no target), computed
    as the step computes them (`loss.logprob_table`), every rank ending with the whole table: GRPO's old_t, taken
    before a batch's first update."""
    return logprob_table(params, with_targets(unreplayed_dropped(batch, step.settings)), cfg, layout, step)


def decoding_params(state, step) -> dict:
    """The policy's weights as the on-policy sampler decodes with them: whole on every rank (gathered one leaf at
    a time under a multi-process layout: collective), each leaf in the step's compute dtype (the fp32 leaves of
    `params.leaf_kinds()` stay fp32), a LoRA run's adapters merged into a copy of its base."""
    whole = lambda tree: map_with_path(  # noqa: E731
        lambda path, t: full_tensor(t.detach()).to(leaf_dtype(path, step.dtype)), tree)
    return lora.merge(whole(state.frozen), whole(state.trained), step.lora) if step.lora else whole(state.trained)


def skip(batch: dict, settings) -> str | None:
    """A batch whose every group's completions have the same reward has every advantage 0: without the KL term
    there is nothing to learn, so the step's update is skipped."""
    if "reward" in batch and not settings.kl_beta and not has_signal(batch):
        return ("every group's completions have the same reward, so every advantage is 0 and there is nothing to "
                "learn")
    return None


def rows_per_item(cfg) -> int:
    """Rows of a batch per --data.batch_size group: its completions (--rl.group_size for sampled prompts, else the
    rollouts file's group size; 1 when it cannot be read)."""
    if cfg.data.type == "prompts":
        return cfg.rl.group_size
    options = ReadOptions(getattr(cfg.data, "format", "glm5f"), getattr(cfg.data, "group_key", None))
    return (file_group_size(cfg.data.path, options) if cfg.data.type == "rollouts" and cfg.data.path else None) or 1


def batch_line(cfg) -> str:
    return f"{cfg.data.batch_size} groups of {rows_per_item(cfg)} completions x {cfg.data.seq_len} tokens/step"


def summary(first: dict, last: dict) -> list[str]:
    r0, r1 = (f"{r:.4f}" if abs(r) < 1e6 else f"{r:.4e}" for r in (first["reward"], last["reward"]))
    return [f"reward: {r0} (step {first['step']}) -> {r1} (step {last['step']})"]


GRPO = Objective(loss, denoms, METRICS, prepare=prepare, plan_bytes=plan_bytes,
                 data_types=("rollouts", "prompts"), settings="rl", reference=needs_reference, config=RLConfig,
                 check=check, source=source, feed=GRPOFeed, skip=skip, rows_per_item=rows_per_item,
                 batch_line=batch_line, summary=summary)

"""The training objective and its gradients: a main objective (a row `Objective`, `lm` the LM loss) plus GLM-5's
own terms (one table, `TERMS`), each a mean over the global batch, so a step's value and gradients do not depend on
the layout.

Shape suffixes: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from glm5f.core.config import GLM5Config
from glm5f.core import IGNORE_INDEX
from glm5f.model.env import INDEXER_LOSSES, Objectives, make_env
from glm5f.core.layers import INDEXERS, layer_spec
from glm5f.model.lora import LoraSpec
from glm5f.model.decoder import hidden_states, main_head, mtp_states
from glm5f.model.head import head_loss_sum, mtp_inputs, mtp_targets, shift_labels
from glm5f.model.logprobs import head_logprobs
from glm5f.model.tree import predecessor_states
from glm5f.train.optim import trained_paths, value_and_grad
from glm5f.parallel.layout import Layout
from glm5f.core.params import flatten
from glm5f.train.feed import Feed


# ---- the main objective -------------------------------------------------------------------------------------------

@dataclass
class Context:
    """What a main objective's loss reads beside params and batch: the model config, the layout, the Step, the
    Env of this rank's share of the micro-batch, the step's global counts (`step_denoms`); `forward` runs the model.
    Each forward it runs is recorded (`forwards`), so the step's terms (MTP, indexer, balance) and the expert
    counts come from every forward, whatever the objective."""

    cfg: GLM5Config
    layout: Layout
    step: Step
    env: object
    denoms: dict
    forwards: list = dataclasses.field(default_factory=list)
    reference: dict | None = None

    def forward(self, params: dict, batch: dict) -> tuple[torch.Tensor, dict]:
        """(final hidden states [B, S, D] of batch["input_ids"], the head: `model.main_head`'s final norm and LM
        head, for `head_token_losses` / `head_loss_sum`). Gathers the embedding, final norm and head now, each
        decoder layer as it runs (model.run_layer)."""
        env = self.env
        top = env.weights({**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}})
        compute = {**top, "model": {**top["model"], "layers": params["model"]["layers"]}}
        hidden_BxSxD, aux = hidden_states(compute, self.cfg, batch["input_ids"], env)
        hidden_BxSxD = tree_targets_states(hidden_BxSxD, batch)
        self.forwards.append((compute, hidden_BxSxD, aux["layers"], batch))
        return hidden_BxSxD, main_head(compute, self.cfg)

    def reference_forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """`forward` of the run's reference model (`TrainState.reference`: a LoRA run's base with its adapters
        off), not recorded: no terms, no expert counts. Run it under torch.no_grad."""
        if self.reference is None:
            raise ValueError("the objective reads a reference model, but the step was given none")
        env = self.env
        top = env.weights({**self.reference, "model": {k: v for k, v in self.reference["model"].items()
                                                       if k != "layers"}})
        compute = {**top, "model": {**top["model"], "layers": self.reference["model"]["layers"]}}
        hidden_BxSxD, _ = hidden_states(compute, self.cfg, batch["input_ids"], env)
        return tree_targets_states(hidden_BxSxD, batch), main_head(compute, self.cfg)


def tree_targets_states(hidden_BxSxD: torch.Tensor, batch: dict) -> torch.Tensor:
    """The hidden states that predict `batch["targets"]`: as they are, or in a tree batch (whose targets sit at the
    token they name: `with_targets`) each token's predecessor's on its path (`tree.predecessor_states`)."""
    prev_BxS = batch.get("tree_prev")
    return hidden_BxSxD if prev_BxS is None else predecessor_states(hidden_BxSxD, prev_BxS)


@dataclass(frozen=True)
class Objective:
    """A main objective of the training step, a row of `objectives.OBJECTIVES` (--train.objective), as optimizers are
    rows of `optim.OPTIMIZERS`. The row owns its lifecycle: train.py, configs.py and the plan ask it, never its name.

    loss(params, batch, ctx) -> (value, sums): this rank's share of the objective's value over one micro-batch
    (`batch` this rank's share of it; ctx a `Context`, whose `forward` runs the model), and {metric: this rank's
    fp64 sum of it}, "loss" among them (the run stops, or skips, on a non-finite one). Each metric is logged as
    its sum over the global batch divided by denoms[metrics[name]]. denoms(batch) -> {name: global count >= 1} of
    the global batch (`with_targets`'s, after `prepare`): what the value and metrics are averaged over.
    prepare(batch, settings) -> batch: the global batch with what `loss` reads, made on whole sequences before any
    split (every [B, S, ...] tensor of it is cut as the tokens are; 0-dim tensors are not), `settings` the
    objective's flags (Step.settings). A metric whose denominator is "max" is logged as its largest value over
    micro-batches and ranks instead. plan_bytes(model_cfg, run, state) -> bytes per rank
    the memory plan adds beyond the LM step (e.g. a reference copy of the params; `state`: `plan.state_bytes`).
    data_types: the --data.type values it trains on (None: any). settings: the name of its Config section (e.g.
    "dpo": its --dpo flags), which the step hands its loss as ctx.step.settings; config: that section's dataclass,
    defined once beside the objective's code and mounted in the run config under `settings`. reference: whether its
    loss reads a reference model (`Context.reference_forward`; the run keeps one, `TrainState.reference`): a bool
    or a function of its settings (`needs_reference`). cp: whether it runs under CP.

    The run's hooks (each optional; `cfg` the run's Config): check(cfg) -> [error]: what is wrong with its flags
    (configs.validate adds them). source(cfg, model_cfg, layout, tokenizer_path, warn) -> the data source of its own
    data types (None: the data floor's `make_source`; such data has no held-out part). feed: the class of the
    run's batch schedule (`feed.Feed`: where each step's batch comes from, how many updates each batch gets, what
    of it a checkpoint keeps), made as feed(data, trainer). skip(batch, settings) -> why the step's update is
    skipped (None: it is not). rows_per_item(cfg): rows of a batch per --data.batch_size item (the plan's and the
    start line's). batch_line(cfg): the start line's batch sizes (None: B x S tokens/step). setup(run, data,
    reference) -> the reference to keep (None: free it), once before the first step (`run` the run's edges:
    cfg, model_cfg, trainer, say, tokenizer, writing). summary(first, last) -> lines the run's end adds, of its
    first and last metrics records."""

    loss: Callable[[dict, dict, Context], tuple[torch.Tensor, dict]]
    denoms: Callable[[dict], dict]
    metrics: dict
    prepare: Callable[[dict, object], dict] = lambda batch, settings: batch
    plan_bytes: Callable[..., int] = lambda model_cfg, run, state: 0
    data_types: tuple[str, ...] | None = None
    settings: str | None = None
    reference: bool | Callable[[object], bool] = False
    cp: bool = True
    config: type | None = None
    check: Callable[[object], list] = lambda cfg: []
    source: Callable[..., object] | None = None
    feed: Callable[..., object] = Feed
    skip: Callable[[dict, object], str | None] = lambda batch, settings: None
    rows_per_item: Callable[[object], int] = lambda cfg: 1
    batch_line: Callable[[object], str | None] = lambda cfg: None
    setup: Callable[..., dict | None] = lambda run, data, reference: reference
    summary: Callable[[dict, dict], list] = lambda first, last: []

    def needs_reference(self, settings: object = None) -> bool:
        """Whether a run with these settings (its --<settings> section) keeps a reference model."""
        return self.reference(settings) if callable(self.reference) else self.reference


def lm_loss(params: dict, batch: dict, ctx: Context) -> tuple[torch.Tensor, dict]:
    """The LM loss: next-token cross-entropy summed over this rank's targets, over the global batch's targets."""
    hidden_BxSxD, head = ctx.forward(params, batch)
    sums = {"loss": head_loss_sum(head, hidden_BxSxD, batch["targets"], ctx.cfg.rms_norm_eps)}
    return sums["loss"] / ctx.denoms["targets"], sums


def target_count(batch: dict) -> dict:
    """{"targets": the global batch's next-token targets (at least 1)}."""
    return {"targets": (batch["targets"] != IGNORE_INDEX).sum().clamp(min=1)}


LM = Objective(lm_loss, target_count, {"loss": "targets"})


# ---- the step's terms ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Term:
    """One term the step adds to its main objective's value: `coeff` its weight (the name of the --train flag
    holding it; None: a metric, logged but not optimized), `denom` the `step_denoms` count its sum is averaged
    over, `source` where its sum comes from ("mtp": the MTP heads, "layers": the layers' aux, summed), `on`:
    whether a step with these Objectives computes it; `default`: the weight when its flag is None (not given),
    `needs`: what the model must have to compute it (a flag given for a term it cannot compute is warned about:
    `unused_weights`)."""

    coeff: str | None
    denom: str
    source: str
    on: Callable[[Objectives], bool]
    default: float | None = None
    needs: str = ""


TERMS = {
    "mtp_loss": Term("mtp_loss_weight", "mtp_depths", "mtp", lambda o: o.mtp_depths > 0, default=0.1,
                     needs="MTP layers (--model.num_nextn_predict_layers)"),
    "indexer_loss": Term("indexer_loss_coeff", "queries", "layers", lambda o: o.indexer_loss != "off"),
    "indexer_recall": Term(None, "indexer_queries", "layers", lambda o: o.indexer_loss != "off"),
    "seq_aux_loss": Term("seq_aux_loss_coeff", "sequences", "layers", lambda o: o.seq_aux),
}


@dataclass(frozen=True)
class Step:
    """What a training step computes and how: the main objective (`Objective`, default the LM loss), the terms'
    Objectives and each term's weight, the activations' dtype, the dtype of the sums that make gradients
    (`--train.reduce_dtype`; None: the activations'), activation checkpointing, micro-batches, the
    --train.trainable regex, whether decoder layers run compiled, the LoRA spec (None: no adapters; with one, the
    params hold them, `lora.attach`, and only they are trained), and the parts of the queries sparse attention runs
    over (`--train.query_parts`)."""

    objectives: Objectives = Objectives()
    coeffs: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    remat: bool = False
    grad_accum: int = 1
    trainable: str | None = None
    compile: bool = False
    lora: LoraSpec | None = None
    query_parts: int = 1
    objective: Objective = LM
    settings: object = None

    @classmethod
    def of(cls, train, model_cfg: GLM5Config, lora: LoraSpec | None = None, objective: Objective = LM,
           settings: object = None) -> Step:
        """The Step of a run's TrainConfig (`train`) for a model of model_cfg, training the adapters of `lora`
        (the run's LoraSpec) when given, on the main objective `objective` (`objectives.OBJECTIVES`' row of
        --train.objective)."""
        if train.indexer_loss not in INDEXER_LOSSES:
            raise ValueError(f"--train.indexer_loss must be one of {INDEXER_LOSSES}, got {train.indexer_loss!r}")
        objectives = Objectives(train.indexer_loss, train.indexer_target, train.seq_aux_loss_coeff > 0,
                                model_cfg.mtp_depths)
        def flag(t: Term) -> float:  # its --train flag's value, its default when not given
            return t.default if getattr(train, t.coeff) is None else getattr(train, t.coeff)

        coeffs = {name: flag(t) for name, t in TERMS.items() if t.coeff is not None and t.on(objectives)}
        return cls(objectives, coeffs, getattr(torch, train.dtype),
                   getattr(torch, train.reduce_dtype) if train.reduce_dtype else None,
                   train.activation_checkpointing, train.grad_accum, train.trainable, train.compile, lora,
                   train.query_parts, objective, settings)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.dtype

    def trained(self, params: dict) -> list[str]:
        """Paths of the leaves this step trains (the indexer's only with its loss on; with LoRA the adapters')."""
        return trained_paths(params, self.trainable, indexer=self.objectives.indexer_loss != "off",
                             lora=self.lora is not None)

    def denom(self, metric: str) -> str:
        """The `step_denoms` count the metric `metric` (the objective's or a term's) is averaged over."""
        return self.objective.metrics[metric] if metric in self.objective.metrics else TERMS[metric].denom


def unused_weights(train, model_cfg: GLM5Config) -> list[str]:
    """A warning for each term weight given (its flag not None) that the run's TrainConfig `train` and the model
    of model_cfg do not compute."""
    objectives = Step.of(train, model_cfg).objectives
    return [f"--train.{t.coeff} {getattr(train, t.coeff):g} is not used: the model has no {t.needs}, so there is no "
            f"{name} to weight; drop the flag or train a model with them"
            for name, t in TERMS.items() if t.default is not None and getattr(train, t.coeff) is not None
            and not t.on(objectives)]


def with_targets(batch: dict, mtp_depths: int = 0) -> dict:
    """The batch with its next-token "targets" (shifted on whole sequences, before any split; in a tree batch,
    `glm5f.model.tree`, each token's own label, predicted from its predecessor) and "valid" tokens (the batch's own
    "valid" when it has one: 0 on padding; a tree batch's counts the sequences holding each token);
    with mtp_depths, also the MTP depths' inputs "mtp_input_ids" and targets "mtp_targets" (lists, depth 1 first)."""
    mask = batch.get("attention_mask")
    valid = mask if mask is not None and mask.ndim == 2 else torch.ones_like(batch["input_ids"])
    valid = batch["valid"] if batch.get("valid") is not None else valid  # a source's own (0 on padding)
    prev_BxS = batch.get("tree_prev")  # a tree batch: a token's target is its own label, from its predecessor
    targets = shift_labels(batch["labels"]) if prev_BxS is None else batch["labels"].masked_fill(prev_BxS < 0,
                                                                                                 IGNORE_INDEX)
    out = dict(batch, targets=targets, valid=valid)
    if mtp_depths:
        depths = range(1, mtp_depths + 1)
        out["mtp_input_ids"] = [mtp_inputs(batch["input_ids"], d) for d in depths]
        out["mtp_targets"] = [mtp_targets(batch["labels"], d, batch.get("position_ids"), valid) for d in depths]
    return out


def step_denoms(batch: dict, cfg: GLM5Config, objectives: Objectives = Objectives(), objective: Objective = LM) -> dict:
    """The global counts the step's main objective (its `denoms`) and terms are averaged over (at least 1 each), of
    a `with_targets` batch (after the objective's `prepare`)."""
    queries = batch["valid"].sum().clamp(min=1)
    indexed = sum(INDEXERS[layer_spec(cfg, i).indexer].selects for i in range(cfg.num_hidden_layers)) + \
        objectives.mtp_depths
    denoms = {**objective.denoms(batch), "queries": queries, "indexer_queries": queries * indexed,
              "sequences": (batch["valid"].sum(1) > 0).sum().clamp(min=1)}
    if batch.get("mtp_targets"):  # per depth: its target count; and the number of depths the MTP loss averages
        mtp = batch["mtp_targets"]
        denoms["mtp_targets"] = torch.stack([(t != IGNORE_INDEX).sum() for t in mtp]).clamp(min=1)
        denoms["mtp_depths"] = torch.tensor(float(len(mtp)), dtype=torch.float64, device=mtp[0].device)
    return denoms


def micro_batches(batch: dict, n: int) -> Iterator[dict]:
    """The n micro-batches of a global batch: consecutive rows, every tensor of the batch cut alike."""
    B = len(batch["input_ids"])
    for m in range(n):
        rows = slice(m * B // n, (m + 1) * B // n)
        yield pytree.tree_map(lambda t: t[rows] if isinstance(t, torch.Tensor) and t.ndim else t, batch)


def micro_loss(params: dict, batch: dict, denoms: dict, cfg: GLM5Config, layout: Layout, step: Step,
               reference: dict | None = None):
    """This rank's share of the step's value over one global micro-batch, with (sums, expert counts) as aux.

    The value is the main objective's (`step.objective.loss`, over this rank's share of the batch) plus, for each
    term the step weights (TERMS), coeff * sum / denoms[denom], denoms being the step's global counts
    (`step_denoms`), so it does not depend on the layout. The terms come from every forward the objective ran (the
    MTP heads on its hidden states; the MTP layers count as layers for the indexer and balance losses). sums maps
    each metric (the objective's, then the terms') to this rank's fp64 sum of it. expert counts: per MoE layer's
    router bias path, the valid tokens of this rank routed to each expert (for the bias rule).
    """
    local, env = make_env(cfg, batch, step.dtype, layout, objectives=step.objectives, weight_dtype=step.weight_dtype,
                          remat=step.remat, compile=step.compile, lora=step.lora, query_parts=step.query_parts)
    ctx = Context(cfg, layout, step, env, denoms, reference=reference)
    value, sums = step.objective.loss(params, local, ctx)
    sums, eps, runs = dict(sums), cfg.rms_norm_eps, []  # runs: (layers' aux, their layer indices) of each forward
    index = list(range(cfg.num_hidden_layers))
    for compute, hidden_BxSxD, layers, fwd in ctx.forwards:
        if step.objectives.mtp_depths:
            states, mtp_aux = mtp_states(compute, cfg, hidden_BxSxD, fwd["mtp_input_ids"], env)
            mtp = sum(head_loss_sum(head, h_BxSxD, t, eps) / n
                      for (h_BxSxD, head), t, n in zip(states, fwd["mtp_targets"], denoms["mtp_targets"]))
            sums["mtp_loss"] = sums["mtp_loss"] + mtp if "mtp_loss" in sums else mtp
            layers = layers + mtp_aux["layers"]
        runs.append((layers, index + [cfg.mtp_layer(d) for d in range(1, cfg.mtp_depths + 1)]))
    device = ctx.forwards[0][1].device if ctx.forwards else layout.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    for name, t in TERMS.items():
        if t.source == "layers" and t.on(step.objectives):
            sums[name] = sum((a[name] for layers, _ in runs for a in layers if name in a), zero)
    for name, v in sums.items():
        if name in TERMS and name in step.coeffs:
            value = value + step.coeffs[name] * v / denoms[TERMS[name].denom]
    with torch.no_grad():
        valid = local["valid"].flatten().to(torch.float32)
        counts = {}  # an MTP layer that several depths share counts the tokens of all of them
        for layers, indices in runs:
            for i, a in zip(indices, layers):
                if "expert_idx" in a:
                    path = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                    counts[path] = counts.get(path, 0) + valid.new_zeros(cfg.n_routed_experts).index_add_(
                        0, a["expert_idx"].flatten(), valid.repeat_interleave(a["expert_idx"].shape[1]))
    return value, (sums, counts)


def step_grads(params: dict, batch: dict, cfg: GLM5Config, layout: Layout, step: Step, reference: dict | None = None):
    """(metrics, gradients of the trained leaves, per-MoE-layer expert token counts) of one step: `device_step`
    with its metrics read to the host as floats, all in one read (the step's only wait on the device)."""
    metrics, grads, counts = device_step(params, batch, cfg, layout, step, reference)
    return dict(zip(metrics, torch.stack(list(metrics.values())).tolist())), grads, counts


def device_step(params: dict, batch: dict, cfg: GLM5Config, layout: Layout, step: Step,
                reference: dict | None = None):
    """(metrics, gradients of the trained leaves, per-MoE-layer expert token counts) of one step, all tensors on
    the layout's device: nothing is read to the host (tests/test_host_sync.py).

    metrics maps each metric of the step's main objective and each term it computes to its mean over the global
    batch (an fp64 scalar). Only the
    leaves the step trains get gradients. The batch is the step's global batch; it is cut into micro-batches,
    each rank computes its share, and the token-weighted means over all of them are the same whatever the layout.
    With a reduce dtype the gradients are taken, and summed over micro-batches and ranks, in that dtype and
    rounded to the parameters' at the end.
    """
    master = {p: t.dtype for p, t in flatten(params).items()}
    if step.reduce_dtype is not None:
        params = pytree.tree_map(lambda t: t.to(torch.promote_types(t.dtype, step.reduce_dtype)), params)
    batch = step.objective.prepare(with_targets(batch, step.objectives.mtp_depths), step.settings)
    denoms = step_denoms(batch, cfg, step.objectives, step.objective)
    grad_fn = value_and_grad(micro_loss, has_aux=True, paths=step.trained(params))
    grads, sums, counts = None, {}, {}
    for mb in micro_batches(batch, step.grad_accum):
        (_, (mb_sums, mb_counts)), g = grad_fn(params, mb, denoms, cfg, layout, step, reference)
        grads = g if grads is None else dict(zip(grads, torch._foreach_add(list(grads.values()), list(g.values()))))
        sums = {k: (torch.maximum(sums[k], v) if step.denom(k) == "max" else sums[k] + v) if k in sums else v
                for k, v in mb_sums.items()}
        counts = {k: counts.get(k, 0) + c for k, c in mb_counts.items()}
    grads = {p: g.to(master[p]) for p, g in grads.items()}
    metrics = {k: (layout.max(v) if step.denom(k) == "max" else layout.sum(v) / denoms[step.denom(k)])
               .to(torch.float64) for k, v in sums.items()}
    return metrics, grads, {k: layout.sum(c) for k, c in counts.items()}


@torch.no_grad()
def eval_loss(params: dict, batches: list[dict], cfg: GLM5Config, layout: Layout, step: Step) -> float:
    """Token-weighted mean LM loss of `params` over the held-out batches: every batch cut into micro-batches and
    rank shares as a training step's, the loss sums added over all of them and divided by all their targets."""
    lm = dataclasses.replace(step, objectives=Objectives(), coeffs={}, objective=LM, remat=False,
                             lora=step.lora and dataclasses.replace(step.lora, dropout=0.0))
    one = {"targets": torch.ones((), device=layout.device)}
    loss_sum, n_targets = torch.zeros((), dtype=torch.float64, device=layout.device), 0
    for batch in batches:
        batch = with_targets(batch)
        n_targets += int((batch["targets"] != IGNORE_INDEX).sum())
        for mb in micro_batches(batch, step.grad_accum):
            loss_sum = loss_sum + micro_loss(params, mb, one, cfg, layout, lm)[1][0]["loss"]
    return float(layout.sum(loss_sum) / max(n_targets, 1))


# ---- log-probabilities of a batch into a global table -------------------------------------------------------------

def _table_loss(params: dict, batch: dict, ctx: Context, per_row=None) -> tuple[torch.Tensor, dict]:
    """The log-probability of each target of this rank's share, written at its (row, position) of the micro-batch
    into a table of its shape (zeros elsewhere), as the sum "logp"; with `per_row`, per_row(logp_BxS, share) [B, K]
    (this rank's part of each row's values) written at its rows instead. No value to differentiate."""
    hidden_BxSxD, head = ctx.forward(params, batch)
    logp_BxS = head_logprobs(head, hidden_BxSxD, batch["targets"], ctx.cfg.rms_norm_eps)
    table = torch.zeros(batch["table_shape"], dtype=torch.float64, device=logp_BxS.device)
    if per_row is None:
        table[batch["table_row"], batch["table_pos"]] = logp_BxS.to(torch.float64)
    else:
        table[batch["table_row"][:, 0]] = per_row(logp_BxS, batch).to(torch.float64)
    return logp_BxS.sum() * 0, {"logp": table}


@torch.no_grad()
def logprob_table(params: dict, batch: dict, cfg: GLM5Config, layout: Layout, step: Step,
                  micro: int | None = None, per_row=None, columns: int = 0) -> torch.Tensor:
    """The log-probability under `params` of each target of the global batch `batch` (`with_targets`'s, after the
    objective's `prepare`) [R, S] (fp64; 0 where no target), computed as the step computes them (its rank shares,
    dtypes, LoRA and compiled layers; `micro` micro-batches, default the step's; no terms), every rank ending with
    the whole table (each entry is one rank's, the others add zeros to it). Collective. With `per_row`: [R, columns]
    instead, each rank's per_row(logp_BxS, share) [B, columns] at its rows, summed over the ranks (a CP group's parts
    of a row add up, as `Layout.seq_sum` adds them). GRPO's old policy and DPO's stored reference are this pass."""
    R, S = batch["targets"].shape
    device = batch["targets"].device
    b = {**batch, "table_row": torch.arange(R, device=device)[:, None].expand(R, S),
         "table_pos": torch.arange(S, device=device).expand(R, S)}
    table = Objective(lambda p, b, ctx: _table_loss(p, b, ctx, per_row), lambda batch: {}, {})
    s = dataclasses.replace(step, objective=table, coeffs={}, objectives=dataclasses.replace(
        step.objectives, seq_aux=False, indexer_loss="off", mtp_depths=0))
    K = columns if per_row is not None else S
    out_RxK, row = torch.zeros(R, K, dtype=torch.float64, device=device), 0
    for mb in micro_batches(b, micro or step.grad_accum):
        n = len(mb["targets"])
        mb = {**mb, "table_row": mb["table_row"] - row, "table_shape": (n, K)}
        _, (sums, _) = micro_loss(params, mb, {}, cfg, layout, s)
        out_RxK[row:row + n] = layout.sum(sums["logp"])
        row += n
    return out_RxK if per_row is not None else torch.where(batch["targets"] != IGNORE_INDEX, out_RxK, 0.0)

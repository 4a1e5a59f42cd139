"""The training step as one function, `train_step(state, batch, trainer) -> (state, metrics)`, over a `TrainState`
(the trained tree, the frozen tree, the optimizer state, the step number); the main objective is the Trainer's row
(glm5f.objectives).

What trains is which tree goes where: full training trains the params (the leaves `Step.trained` names; the others
ride along unchanged), a LoRA run trains its adapters beside the frozen base (router biases included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from glm5f.core.config import GLM5Config
from glm5f.model.lora import attach
from glm5f.train.loss import Objective, Step, step_grads
from glm5f.train.optim import (Optimizer, balance_router_bias, clip_by_global_norm, lr_schedule, make_optimizer, matches,
                               schedule_total)
from glm5f.parallel.layout import Layout
from glm5f.core.params import flatten

class TrainState(NamedTuple):
    """A run between steps: `trained` the tree the optimizer updates (the params, or a LoRA run's adapters: a flat
    {path: tensor} tree), `frozen` the tree it only reads (a LoRA run's base; None when the params train),
    `opt_state` the optimizer's state of the trained leaves, `step` the steps done, `reference` the model an
    objective compares with (`Objective.reference`: DPO's; a LoRA run's is its frozen base, no copy), never
    trained and not checkpointed (a run makes it again from where it came from)."""

    trained: dict
    frozen: dict | None
    opt_state: dict
    step: int
    reference: dict | None = None

    @property
    def params(self) -> dict:
        """The tree the model computes with: the trained tree, or the adapters beside the frozen base."""
        return self.trained if self.frozen is None else attach(self.frozen, self.trained)

    def saved(self) -> dict:
        """What a checkpoint holds of the state: {"params" (the trained params) or "adapters" (trained beside a
        frozen base), "optim"}; `checkpoint.load` fills it in place, `restored` makes the state of it."""
        return {"params" if self.frozen is None else "adapters": self.trained, "optim": self.opt_state}

    def restored(self, saved: dict, step: int) -> TrainState:
        """The state of a checkpoint's trees `saved` (as `saved()` names them), at step `step`."""
        return self._replace(trained=saved["params" if self.frozen is None else "adapters"],
                             opt_state=saved["optim"], step=step)


@dataclass(frozen=True)
class Trainer:
    """What stays the same over a run's steps: the model config, the layout, the Step (main objective, terms,
    dtypes, what is trained), the optimizer, the global-norm clip (<= 0: none), the learning rate of each step
    index, and the router-bias rule's rate."""

    model_cfg: GLM5Config
    layout: Layout
    step: Step
    optimizer: Optimizer
    clip_norm: float
    lr: Callable[[int], float]
    bias_update_rate: float

    @classmethod
    def of(cls, cfg, model_cfg: GLM5Config, layout: Layout, row: Objective) -> Trainer:
        """The Trainer of a train.py `Config` training the main objective `row` (--train.objective's, from
        glm5f.objectives): --lora's adapters, --optim's optimizer, clip, schedule and bias rate."""
        o = cfg.optim
        total = schedule_total(o, cfg.train)
        settings = getattr(cfg, row.settings) if row.settings else None
        return cls(model_cfg, layout, Step.of(cfg.train, model_cfg, cfg.lora.spec(), row, settings),
                   make_optimizer(o, model_cfg, lora=bool(cfg.lora.rank)), o.clip_norm,
                   lambda i: lr_schedule(i, peak=o.lr, warmup=o.warmup_steps, total=total, min_ratio=o.min_lr_ratio),
                   o.bias_update_rate)

    def init(self, trained: dict, frozen: dict | None = None, reference: dict | None = None) -> TrainState:
        """The state at step 0 of training `trained` (beside `frozen`, comparing with `reference`): a fresh
        optimizer state of the leaves the Step trains."""
        state = TrainState(trained, frozen, {}, 0, reference)
        return state._replace(opt_state=self.optimizer.init(trained, self.step.trained(state.params)))


def train_step(state: TrainState, batch: dict, trainer: Trainer, skip: Callable[[dict], bool] | None = None,
               inspect: Callable[[dict], None] | None = None) -> tuple[TrainState, dict]:
    """One optimizer step on the global batch `batch`: the value and gradients of the step's objective over the
    trained tree (`loss.step_grads`; the frozen tree a constant), the gradients clipped by their global norm, the
    learning rate of step index state.step; then, unless `skip(metrics)` says to skip the update (e.g. a non-finite
    loss or norm), `inspect(grads)` when given (e.g. the first update's check), the optimizer's update of the trained
    tree and the router-bias rule on the router biases in it that --train.trainable selects.

    Returns (the next state, metrics): the step's metrics, then "lr" and "grad_norm" (floats), and "skipped": True
    for a skipped update. The trained tree and the optimizer state are donated (updated in place, as
    `Optimizer.update` does); the frozen tree is only read."""
    t = trainer
    metrics, grads, counts = step_grads(state.params, batch, t.model_cfg, t.layout, t.step, state.reference)
    grads, grad_norm = clip_by_global_norm(grads, t.clip_norm)
    metrics = {**metrics, "lr": t.lr(state.step), "grad_norm": float(grad_norm)}
    if skip is not None and skip(metrics):
        return state._replace(step=state.step + 1), {**metrics, "skipped": True}
    if inspect is not None:
        inspect(grads)
    trained, opt_state = t.optimizer.update(state.trained, grads, state.opt_state, metrics["lr"])
    del grads  # freed before the bias rule
    here = flatten(trained)
    trained = balance_router_bias(trained, {k: c for k, c in counts.items()
                                            if k in here and matches(t.step.trainable, k)}, t.bias_update_rate)
    return TrainState(trained, state.frozen, opt_state, state.step + 1, state.reference), metrics


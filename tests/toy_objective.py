"""A toy main objective with everything a post-training objective brings, in one file: its settings (--toy.*), its
own data type (toy_counts), two updates per batch, a plan row; tests/test_objective_toy.py adds it to the table.

Loss: each target's cross-entropy weighted by 1 + (position mod --toy.period), over the sum of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5f.core import IGNORE_INDEX
from glm5f.model.head import head_token_losses
from glm5f.train.feed import Feed
from glm5f.train.loss import Objective


@dataclass
class ToyConfig:
    """The --toy flags."""

    period: int = 3
    """Targets are weighted 1 + (position mod period)."""
    updates: int = 2
    """Optimizer steps taken on each batch."""


def weights(targets_BxS: torch.Tensor, period: int) -> torch.Tensor:
    """[B, S] fp64: 1 + (position mod period), 0 where there is no target."""
    w_S = 1.0 + torch.arange(targets_BxS.shape[1], dtype=torch.float64, device=targets_BxS.device) % period
    return w_S.expand_as(targets_BxS) * (targets_BxS != IGNORE_INDEX)


def loss(params: dict, batch: dict, ctx) -> tuple[torch.Tensor, dict]:
    hidden_BxSxD, head = ctx.forward(params, batch)
    loss_N = head_token_losses(head, hidden_BxSxD, batch["targets"], ctx.cfg.rms_norm_eps)
    sums = {"loss": (loss_N.to(torch.float64) * batch["toy_weights"].flatten()).sum()}
    return sums["loss"] / ctx.denoms["weight"], sums


class CountSource:
    """--data.type toy_counts: batch n holds rows counting up by a step of their own from (n + row) mod vocab;
    its state is the batches drawn."""

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int):
        self.B, self.S, self.V, self.drawn = batch_size, seq_len, vocab_size, 0

    def next_batch(self) -> dict:
        n, self.drawn = self.drawn, self.drawn + 1
        rows_B = torch.arange(self.B)
        ids_BxS = (n + rows_B[:, None] + (1 + rows_B[:, None] % 5) * torch.arange(self.S)) % self.V
        return {"input_ids": ids_BxS, "labels": ids_BxS.clone()}

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


class ToyFeed(Feed):
    """--toy.updates updates per batch (the base Feed keeps the batch between them, in the checkpoint too)."""

    per_batch_flag = "--toy.updates"

    def __init__(self, data, trainer):
        super().__init__(data, trainer)
        self.per_batch = trainer.step.settings.updates


def check(cfg) -> list[str]:
    return [] if cfg.toy.period >= 1 and cfg.toy.updates >= 1 else ["--toy.period and --toy.updates must be >= 1"]


TOY = Objective(loss, lambda batch: {"weight": batch["toy_weights"].sum().clamp(min=1)}, {"loss": "weight"},
                prepare=lambda batch, s: {**batch, "toy_weights": weights(batch["targets"], s.period)},
                plan_bytes=lambda model_cfg, run, state: run.batch_size * run.seq_len * 8,  # the weights, fp64
                data_types=("toy_counts",), settings="toy", config=ToyConfig, check=check,
                source=lambda cfg, model_cfg, layout, tokenizer_path, warn: CountSource(
                    cfg.data.batch_size, cfg.data.seq_len, model_cfg.vocab_size),
                feed=ToyFeed)

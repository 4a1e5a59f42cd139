"""How a run is laid out over processes. `Layout` is what the train loop asks: this rank's share of a batch, the
attention context, the experts function, parameter gathering, and sums over ranks.

One process: every method is the identity (this file's `Layout`). Several processes: see `glm5f.distributed`.
"""

from __future__ import annotations

from typing import Callable

import torch

from glm5f.attention import AttnContext
from glm5f.config import GLM5Config
from glm5f.model import make_context
from glm5f.moe import ExpertsFn, expert_ffn
from glm5f.params import Region


class Layout:
    """A single process: it holds the whole batch, all parameters and all experts."""

    rank, world, is_main = 0, 1, True

    def __init__(self, device: torch.device):
        self.device = device

    def local_params(self, make: Callable[[Region | None], dict]) -> dict:
        """Params as this layout stores them, each rank making only its own part: `make(region)` builds the part
        `region(path, shape)` of each leaf (`init_params` and `load_hf` take it); here: region None, all of it."""
        return make(None)

    def shard_params(self, params: dict) -> dict:
        """Params as this layout stores them (DTensors under FSDP/EP)."""
        return params

    def gather_params(self, params: dict, prefix: str = "") -> dict:
        """Plain tensors for the forward, gradients flowing back to the stored (possibly sharded) leaves. `params`
        is the whole tree, or the subtree at dotted path `prefix` (a decoder layer: "model.layers.3")."""
        return params

    def local_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows (data parallel) and sequence chunks (context parallel) of a global (micro-)batch."""
        return batch

    def context(self, cfg: GLM5Config, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> AttnContext:
        """The attention context of this rank's share of a batch."""
        return make_context(cfg, batch["input_ids"].shape, batch.get("attention_mask"), batch["position_ids"],
                            dtype, batch["input_ids"].device)

    @property
    def experts(self) -> ExpertsFn:
        return expert_ffn

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over all ranks (here: itself)."""
        return t

    def seq_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a per-sequence tensor [B, ...] over the ranks holding parts of this rank's sequences (here:
        itself)."""
        return t

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """A leaf's full value on every rank (here: itself)."""
        return t

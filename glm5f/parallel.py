"""How a run is laid out over processes. `Layout` is one process: the whole batch, all parameters, all experts.
Several processes: `glm5f.distributed.DistLayout`, with the same methods.

The model's layers use five verbs, through their `Env`: `gather` (a subtree's weights for compute), `keys` (a
layer's keys over the whole sequence), `state` (a recurrent layer's state carried between calls), `chunks`
(per-chunk values of every context-parallel rank, in sequence order), `experts` (routed experts over rows
sorted by expert) and `seq_sum`. The train loop uses the others: which rows and positions of a batch are this
rank's (`share`), the params as stored (`local_params`, `shard_params`) and sums over ranks (`sum`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from glm5f.params import Region, flatten


class Layout:
    """A single process: it holds the whole batch, all parameters and all experts."""

    rank, world, is_main, cp = 0, 1, True, 1

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    # ---- what the train loop asks
    def share(self, B: int, S: int) -> tuple[slice, torch.Tensor | None]:
        """(rows, sequence positions: a CPU LongTensor, None for all) of a [B, S] batch that this rank holds."""
        return slice(None), None

    def local_params(self, make: Callable[[Region | None], dict]) -> dict:
        """Params as this layout stores them, each rank making only its own part: `make(region)` builds the part
        `region(path, shape)` of each leaf (`init_params` and `load_hf` take it); here: region None, all of it."""
        return make(None)

    def shard_params(self, params: dict) -> dict:
        """Params as this layout stores them (DTensors under FSDP/EP)."""
        return params

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a tensor over all ranks (here: itself), without autograd."""
        return t

    def step_done(self, step: int) -> None:
        """The train loop finished step `step` (a multi-process layout may watch for the steps that stall)."""

    # ---- the verbs the layers use (see glm5f.env.Env)
    def gather(self, tree: dict, prefix: str = "") -> dict:
        """Plain tensors for the forward, gradients flowing back to the stored (possibly sharded) leaves. `tree`
        is the subtree at dotted path `prefix` (a decoder layer: "model.layers.3"), or the whole tree."""
        return tree

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s keys `name` ("latent", "index_keys") over all T positions from this rank's [B, S, ...]."""
        return local

    def state(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Layer `layer`'s recurrent state carried from call to call ({name: buffer}, which the layer reads and
        updates in place; a decode cache's), or None: every forward starts at its sequences' beginnings."""
        return None

    def chunks(self, local: torch.Tensor) -> torch.Tensor:
        """A value per chunk of every CP rank, in sequence order: this rank's [B, 2, ...] (one per chunk it holds, in
        the order `share` gives them: `distributed.cp_positions`) -> [B, 2 cp, ...], gradients flowing back. One
        process holds both halves of each sequence, in order: `local`."""
        return local

    def experts(self, p: dict, x_MxD: torch.Tensor, counts_E: torch.Tensor, ffn: Callable) -> torch.Tensor:
        """The routed experts' outputs of rows sorted by expert (counts_E rows each), in the same order, computed by
        `ffn(p, rows, counts)` (`moe.expert_ffn`: each expert over its block of rows)."""
        return ffn(p, x_MxD, counts_E)

    def seq_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of a per-sequence tensor [B, ...] over the ranks holding parts of this rank's sequences (here:
        itself), without autograd."""
        return t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def nonfinite_counts(params: dict, total: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, int]:
    """{path: NaN/inf values} of the leaves of `params` that hold any, counted over every rank's shards by `total`
    (`Layout.sum`: each rank counts its own, all agree on the result)."""
    flat = {p: t for p, t in flatten(params).items() if t.is_floating_point()}
    if not flat:
        return {}
    counts = total(torch.stack([(~torch.isfinite(local_tensor(t))).sum() for t in flat.values()]).to(torch.float64))
    return {p: int(n) for p, n in zip(flat, counts.tolist()) if n}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value on every rank (collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t

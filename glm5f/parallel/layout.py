"""How a run is laid out over processes. `Layout` is one process: the whole batch, all parameters, all experts.
Several processes: `glm5f.parallel.distributed.DistLayout`, with the same methods, laid out by the math here.

The model's layers use five verbs, through their `Env`: `gather` (a subtree's weights for compute), `keys` (a
layer's keys over the whole sequence), `state` (a recurrent layer's state carried between calls), `chunks`
(per-chunk values of every context-parallel rank, in sequence order), `experts` (routed experts over rows
sorted by expert) and `seq_sum`. The train loop uses the others: which rows and positions of a batch are this
rank's (`share`), the params as stored (`local_params`, `shard_params`) and sums over ranks (`sum`).

The layout math needs no process group. The spec of each leaf comes from the one table of what each leaf is,
`params.leaf_kinds()`, which names the logical axis of each of its dims (embed, heads, mlp, experts, ...);
`MESH_RULES` maps logical axes to mesh axes, and `placements` derives the leaf's DTensor placements from them. Layer
code never names a mesh axis. Meshes (`mesh_shapes`): "fsdp" is every rank (world = dp_shard x cp); "dp" x "cp"
splits the world for the data (`cp_positions`: the positions of a sequence a CP rank holds); "edp" x "ep" splits it
for experts (ep consecutive ranks share one copy of all experts, each owning n_routed_experts / ep).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from glm5f.core.params import Region, flatten

# Logical axis -> the mesh axes that may shard it, in order: each dim of a leaf takes the first of its axis's mesh
# axes that no earlier dim took. "fsdp": stored sharded, gathered for the forward, the gradient reduce-scattered
# (over every rank; on a leaf with an "ep" dim, over the edp ranks sharing one copy of its experts). "ep": the
# routed experts, stored and computed sharded (each rank runs its own experts).
MESH_RULES = {
    "experts": ("ep",),
    "vocab": ("fsdp",), "embed": ("fsdp",), "heads": ("fsdp",), "mlp": ("fsdp",), "router": ("fsdp",),
    "q_lora": ("fsdp",), "kv_lora": ("fsdp",), "latent": ("fsdp",),
    "index_heads": ("fsdp",), "index_dim": ("fsdp",),
    "lora_rank": (),  # a LoRA factor's rank dim: small, replicated; its other dims shard as its weight's
    # GLM-5.3: KDA heads (x head dim) and head dim; the small mHC mixing rows, short-convolution taps and pool
    # positions stay replicated
    "linear_heads": ("fsdp",), "linear_dim": ("fsdp",), "hc": (), "conv": (), "pool": (),
}
GATHERED = ("fsdp",)  # the mesh axes a leaf is gathered over for the forward


class Spec(NamedTuple):
    """How one parameter is laid out: its mesh, its placements as stored, as gathered for the forward, and the
    placements its gradient arrives in from the gathered (local) tensor."""

    mesh: DeviceMesh
    stored: list
    gathered: list
    grads: list


@functools.lru_cache(maxsize=None)
def placements(axes: tuple[str, ...]) -> tuple[str, list, list, list]:
    """(mesh name, placements as stored, as gathered for the forward, of the gathered tensor's gradient) of a leaf
    whose dims have the logical `axes` (its `params.leaf_kinds()` entry), by MESH_RULES. A leaf with an "ep" dim
    lives on the "experts" mesh (edp x ep: its fsdp shard is over edp), any other on "fsdp" (every rank)."""
    taken: dict[str, int] = {}  # mesh axis -> the dim it shards
    for dim, axis in enumerate(axes):
        if axis not in MESH_RULES:
            raise ValueError(f"the logical axis {axis!r} has no row in parallel.MESH_RULES: add one")
        mesh_axis = next((m for m in MESH_RULES[axis] if m not in taken), None)
        if mesh_axis is not None:
            taken[mesh_axis] = dim
    mesh, mesh_axes = ("experts", ("fsdp", "ep")) if "ep" in taken else ("fsdp", ("fsdp",))
    stored = [Shard(taken[m]) if m in taken else Replicate() for m in mesh_axes]
    gathered = [Replicate() if m in GATHERED else pl for m, pl in zip(mesh_axes, stored)]
    grads = [Partial() if m in GATHERED else pl for m, pl in zip(mesh_axes, stored)]
    return mesh, stored, gathered, grads


def cp_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Sequence indices held by CP rank `rank`: chunks rank and 2cp-1-rank of 2cp equal chunks (each rank gets
    an equal share of the causal attention work)."""
    return torch.tensor(cp_position_list(seq_len, cp, rank))


def cp_position_list(seq_len: int, cp: int, rank: int) -> list[int]:
    """`cp_positions` as host integers."""
    c = seq_len // (2 * cp)
    return [*range(rank * c, (rank + 1) * c), *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def mesh_shapes(dp_shard: int, cp: int, ep: int) -> dict[str, tuple[int, ...]]:
    """The shape of each named mesh of a dp_shard x cp run with ep expert ranks (what DistLayout builds; the
    memory plan reads it to size shards without a process group)."""
    world = dp_shard * cp
    return {"fsdp": (world,), "data": (dp_shard, cp), "experts": (world // ep, ep)}


class Layout:
    """A single process: it holds the whole batch, all parameters and all experts."""

    rank, world, is_main, cp, cp_rank = 0, 1, True, 1, 0

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

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order (here: [obj])."""
        return [obj]

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise largest value of a tensor over all ranks (here: itself), without autograd."""
        return t

    def step_done(self, step: int) -> None:
        """The train loop finished step `step` (a multi-process layout passes it to its `on_step` hook)."""

    # ---- the verbs the layers use (see glm5f.model.env.Env)
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
        the order `share` gives them: `cp_positions`) -> [B, 2 cp, ...], gradients flowing back. One
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

    def seq_total(self, t: torch.Tensor) -> torch.Tensor:
        """`seq_sum` with gradients: each rank's part of the sum gets the gradient of the total, summed over the
        ranks holding the sequence (a function of a whole sequence, such as DPO's, computed on each)."""
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

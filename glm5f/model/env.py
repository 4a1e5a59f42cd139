"""What every layer runs in beside its params and activations: rope tables, the mask, what the step computes, and
the parallel layout's verbs. `make_env` builds it, with this rank's share of a batch, in one place.

Shape suffixes: B batch, S queries (this rank's), T keys (the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from glm5f.core import replay
from glm5f.core.config import GLM5Config
from glm5f.kernels.dsa import allowed_rows
from glm5f.model.lora import LoraSpec, bind
from glm5f.core.ops import rope_tables
from glm5f.parallel.layout import Layout
from glm5f.model.tree import Tree
from glm5f.core.params import leaf_dtype, map_with_path


@dataclass
class Mask:
    """Which keys each query may see, kept compact: causal order, key padding and document ids, or a dense mask.

    q_index [S]: each query's sequence index among the keys (causal: key index <= q_index).
    key_valid [B, T]: False for padding keys. q_segment [B, S] / k_segment [B, T]: document ids (packed
    sequences attend within their document). dense [B, S, T] bool: a user's 4D mask, used as given (no causal
    part added), with `bias` [B, S, T] its additive values where it was a float mask with non-zero entries.
    q_index_host: q_index as Python ints (a range or list), read to size query chunks without a device read.
    tree: a tree batch's structure (`glm5f.model.tree`): key j is visible to query i only when i <= tree.reach[j]
    (with causal order: j is on i's path), and keys its `valid` marks False are not keys.
    """

    q_index: torch.Tensor
    num_keys: int
    key_valid: torch.Tensor | None = None
    q_segment: torch.Tensor | None = None
    k_segment: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    q_index_host: Sequence[int] | None = None
    tree: Tree | None = None

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is exactly "key index <= query index" over the same S == T positions."""
        return (self.dense is None and self.key_valid is None and self.q_segment is None and self.tree is None
                and self.q_index.numel() == self.num_keys)

    def rows(self, start: int, stop: int, num_keys: int | None = None) -> torch.Tensor:
        """allowed [B or 1, stop - start, num_keys] for queries start:stop over the first num_keys (default all)."""
        return allowed_rows(self.q_index, self.key_valid, self.q_segment, self.k_segment, self.dense, start, stop,
                            self.num_keys if num_keys is None else num_keys, self.reach)

    @property
    def reach(self) -> torch.Tensor | None:
        """[B, T]: the last query index that may see each key (a tree's `Tree.reach`), None without a tree."""
        return None if self.tree is None else self.tree.reach

    def visible_keys(self, start: int, stop: int) -> int:
        """How many leading keys queries start:stop can see at most (causal: one past the last query's index)."""
        if self.dense is not None or stop <= start:
            return self.num_keys
        if self.q_index_host is None:
            return min(self.num_keys, int(self.q_index[start:stop].max()) + 1)
        return min(self.num_keys, max(self.q_index_host[start:stop]) + 1)

    def at(self, idx_BxSxK: torch.Tensor) -> torch.Tensor:
        """allowed [B, S, K] at the key indices idx (without building [S, T])."""
        if self.dense is not None:
            return self.dense.expand(idx_BxSxK.shape[0], -1, -1).gather(-1, idx_BxSxK)
        allowed = idx_BxSxK <= self.q_index[None, :, None]
        B = idx_BxSxK.shape[0]
        if self.key_valid is not None:
            allowed = allowed & self.key_valid.expand(B, -1).gather(1, idx_BxSxK.flatten(1)).view_as(idx_BxSxK)
        if self.q_segment is not None:
            k_seg = self.k_segment.expand(B, -1).gather(1, idx_BxSxK.flatten(1)).view_as(idx_BxSxK)
            allowed = allowed & (k_seg == self.q_segment[:, :, None])
        if self.tree is not None:
            reach = self.tree.reach.expand(B, -1).gather(1, idx_BxSxK.flatten(1)).view_as(idx_BxSxK)
            allowed = allowed & (self.q_index[None, :, None] <= reach)
        return allowed

    def queries(self, held: list[int], held_S: torch.Tensor) -> Mask:
        """The mask of queries `held` (indices among this mask's queries; `held_S` the same on the device)."""
        def rows(t, dim):
            return None if t is None else t.index_select(dim, held_S)
        host = None if self.q_index_host is None else [self.q_index_host[i] for i in held]
        return Mask(rows(self.q_index, 0), self.num_keys, self.key_valid, rows(self.q_segment, 1), self.k_segment,
                    rows(self.dense, 1), rows(self.bias, 1), host, self.tree)

    def bias_at(self, idx_BxSxK: torch.Tensor) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias.expand(idx_BxSxK.shape[0], -1, -1).gather(-1, idx_BxSxK)

    def query_valid(self, B: int) -> torch.Tensor:
        """[B, S] bool: the queries that are not padding."""
        if self.key_valid is None:
            return torch.ones(B, self.q_index.numel(), dtype=torch.bool, device=self.q_index.device)
        return self.key_valid.expand(B, -1)[:, self.q_index]


INDEXER_LOSSES = ("off", "dense", "sparse")


@dataclass(frozen=True)
class Objectives:
    """What a forward computes beside the logits (the --train flags of the same names).

    indexer_loss: "off", or the key set of the DSA indexer's KL to the main attention ("dense": every visible key,
    "sparse": the selected top-k; `indexer_loss.kl`); indexer_target: its target, "own" (each full layer's own
    attention) or "mean" (the mean over the full layer and the shared layers reusing its top-k); seq_aux: the MoE
    layers compute DeepSeek-V3's sequence-wise balance loss; mtp_depths: MTP depths run after the main layers.
    """

    indexer_loss: str = "off"
    indexer_target: str = "own"
    seq_aux: bool = False
    mtp_depths: int = 0


@dataclass
class Env:
    """What every layer gets beside its params and activations: rope tables of this rank's queries, the mask, the
    objectives, `valid_BxS` (this rank's real tokens), and the layout's verbs: `weights` (a subtree's compute
    weights: cast to weight_dtype, FSDP-gathered), `keys` (a layer's keys over all T positions: identity, a CP
    all-gather, a decode cache), `state` (a recurrent layer's state carried between calls: a decode cache's, else
    None), `chunks` (a value per CP chunk of every rank, in sequence order), `experts` (the routed experts over
    rows sorted by expert: local or EP all-to-all) and `seq_sum` (a sum over the ranks holding parts of this
    rank's sequences). `remat` recomputes
    each decoder layer in the backward pass; `compile` runs decoder layers under torch.compile; `lora`: the LoRA
    spec (scale, dropout) of the adapters in the params, None without; `query_parts`: the parts of the queries
    sparse attention runs over (`attention.sparse_mla`); `topk_dense`: whether a CPU layer may attend its top-k
    with per-head keys where that costs less (`attention.dense_topk_pays`; off in the memory plan's traces, which
    follow the accelerators' sparse kernels). `routing` and `indexer`: the batch's replay records of this rank's
    positions by layer (`glm5f.core.replay`): routing[layer] [B, S, K] the experts to use, indexer[layer] [B, S, T] the
    key rows (pool ends) to attend (`replay.key_rows`); empty without replay. `record`: the layers' aux also hold
    what `replay.record` reads (the indexers' selections)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: Mask
    layout: Layout = field(default_factory=Layout)
    objectives: Objectives = Objectives()
    valid_BxS: torch.Tensor | None = None
    weight_dtype: torch.dtype | None = None
    remat: bool = False
    compile: bool = False
    lora: LoraSpec | None = None
    query_parts: int = 1
    topk_dense: bool = True
    routing: dict[int, torch.Tensor] = field(default_factory=dict)
    indexer: dict[int, torch.Tensor] = field(default_factory=dict)
    record: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self.cos.dtype

    def weights(self, tree: dict, prefix: str = "") -> dict:
        """The compute weights of the subtree at dotted path `prefix`: cast to weight_dtype (the fp32 leaves of
        `params.leaf_kinds()` stay wide), gathered where the layout shards them, with the run's LoRA spec beside each
        adapter (`lora.bind`)."""
        if self.weight_dtype is not None:
            tree = map_with_path(lambda p, t: t.to(leaf_dtype(f"{prefix}.{p}" if prefix else p, self.weight_dtype)),
                                 tree)
        return bind(self.layout.gather(tree, prefix), self.lora)

    def keys(self, layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
        return self.layout.keys(layer, name, local)

    def state(self, layer: int) -> dict[str, torch.Tensor] | None:
        return self.layout.state(layer)

    def chunks(self, local: torch.Tensor) -> torch.Tensor:
        return self.layout.chunks(local)

    def experts(self, p: dict, x_MxD: torch.Tensor, counts_E: torch.Tensor, ffn: Callable) -> torch.Tensor:
        return self.layout.experts(p, x_MxD, counts_E, ffn)

    def seq_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.layout.seq_sum(t)


def default_positions(position_ids: torch.Tensor | None, B: int, S: int, device) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(S, device=device).expand(B, S)
    if position_ids.ndim != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be [{B}, {S}] or [1, {S}], got {tuple(position_ids.shape)}")
    return position_ids.expand(B, S)


def packed_segments(position_ids_BxS: torch.Tensor) -> torch.Tensor:
    """Document ids [B, S]: a new packed document starts where positions do not step by one. All zeros when every
    row is one document (not checked: that would read the device)."""
    first = position_ids_BxS[:, :1] - 1
    return (torch.diff(position_ids_BxS, prepend=first, dim=-1) != 1).cumsum(-1)


def make_mask(attention_mask: torch.Tensor | None, position_ids_BxT: torch.Tensor,
              q_index: torch.Tensor | None = None, packed: bool = True) -> Mask:
    """The mask of queries `q_index` (default: all T positions; a CP rank's share, a CPU tensor) over the T
    positions of a sequence: attention_mask None (causal; with `packed`, positions that restart mark packed
    documents), 2D [B, T] padding (1 keep, 0 pad) or 4D [B, 1, T, T] (boolean, True attends, or additive float:
    0 attends, the dtype's minimum masks), used as given."""
    B, T = position_ids_BxT.shape
    device = position_ids_BxT.device
    host = range(T) if q_index is None else q_index.tolist()
    q_index = torch.arange(T, device=device) if q_index is None else q_index.to(device)
    if attention_mask is None:
        seg = packed_segments(position_ids_BxT) if packed else None
        return Mask(q_index, T, q_segment=None if seg is None else seg[:, q_index], k_segment=seg, q_index_host=host)
    if attention_mask.ndim == 2:
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"a 2D attention_mask must be [batch, seq] = [{B}, {T}], got "
                             f"{tuple(attention_mask.shape)}")
        return Mask(q_index, T, key_valid=attention_mask.to(device=device, dtype=torch.bool), q_index_host=host)
    if attention_mask.ndim != 4:
        raise ValueError(f"attention_mask must be 2D [batch, seq] or 4D [batch, 1, seq, seq], got "
                         f"{attention_mask.ndim}D {tuple(attention_mask.shape)}")
    if attention_mask.shape[0] not in (1, B) or tuple(attention_mask.shape[2:]) != (T, T):
        raise ValueError(f"a 4D attention_mask must be [{B}, 1, {T}, {T}], got {tuple(attention_mask.shape)}")
    m = attention_mask[:, 0].to(device).index_select(1, q_index)
    if m.dtype == torch.bool:
        return Mask(q_index, T, dense=m, q_index_host=host)
    if not m.dtype.is_floating_point:
        raise ValueError(f"a 4D attention_mask must be bool or float (additive), got {m.dtype}")
    allowed = m > torch.finfo(m.dtype).min / 2
    bias = m.float().masked_fill(~allowed, 0.0)
    return Mask(q_index, T, dense=allowed, bias=bias if bool(bias.ne(0).any()) else None, q_index_host=host)


def split_tokens(batch: dict, rows: slice, positions: torch.Tensor | None) -> dict:
    """The rows `rows` and sequence positions `positions` (None: all) of every per-token tensor of a batch (its
    leaves of shape [B, S, ...], in lists too), whatever their names; the other leaves keep their rows only."""
    B, S = batch["input_ids"].shape

    def take(t):
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return t
        t = t[rows]
        if positions is not None and t.ndim >= 2 and t.shape[1] == S:
            t = t.index_select(1, positions.to(t.device))
        return t
    return pytree.tree_map(take, batch)


def make_env(cfg: GLM5Config, batch: dict, dtype: torch.dtype, layout: Layout | None = None, *,
             objectives: Objectives = Objectives(), weight_dtype: torch.dtype | None = None,
             remat: bool = False, compile: bool = False, lora: LoraSpec | None = None,
             query_parts: int = 1) -> tuple[dict, Env]:
    """(this rank's share of a global batch, the Env its layers run in). The batch holds [B, S] "input_ids" and
    "position_ids", optionally "attention_mask" (2D or 4D, see `make_mask`), "valid", the replay records "routing"
    and "indexer" (`glm5f.core.replay`; shapes checked, values not: `replay.check_replay` reads them) and any other
    per-token tensors (split alike); the layout says which rows and positions are this rank's. A tree batch
    (`glm5f.model.tree`) holds a "tree" (a Tree) or its tensors "tree_prev" and "tree_reach" beside position_ids
    (`check_tree_batch` says what it may not hold)."""
    layout = layout or Layout(batch["input_ids"].device)
    B, S = batch["input_ids"].shape
    replaying = any(batch.get(k) is not None for k in replay.REPLAY_KEYS)
    if replaying:
        replay.check_shapes(batch, cfg)
    rows, positions = layout.share(B, S)
    tree = batch.get("tree")
    if tree is None and batch.get("tree_prev") is not None:
        tree = Tree.of(batch["tree_prev"], batch["tree_reach"], batch["position_ids"])
    if tree is not None:
        check_tree_batch(batch, positions, objectives)
        batch = {**batch, "position_ids": tree.position}
    packed = batch.get("position_ids") is not None  # else one document per row (deciding it would read the ids)
    position_ids = default_positions(batch.get("position_ids"), B, S, batch["input_ids"].device)
    batch = {**batch, "position_ids": position_ids}
    local = split_tokens(batch, rows, positions)
    mask = batch.get("attention_mask")
    if tree is None:
        mask = make_mask(None if mask is None else mask[rows], position_ids[rows], positions, packed)
    else:
        tree = tree.rows(rows)
        mask = Mask(torch.arange(S, device=position_ids.device), S, key_valid=tree.valid, q_index_host=range(S),
                    tree=tree)
    cos, sin = rope_tables(cfg, local["position_ids"], dtype)
    env = Env(cos, sin, mask, layout, objectives, local.get("valid"), weight_dtype, remat, compile, lora, query_parts)
    if replaying:
        env.routing, env.indexer = replay_records(cfg, local, mask)
    return local, env


def check_tree_batch(batch: dict, positions: torch.Tensor | None, objectives: Objectives) -> None:
    """Refuses what a tree batch (`glm5f.model.tree`) does not compute exactly: its position_ids are the tree's own
    (`Tree.position`), its mask is the tree's (no attention_mask), its rows whole on each rank (no CP), no indexer
    replay records (they name key positions of an unshared sequence; routing records are per token), and no
    objective summed over queries or sequences (indexer loss, sequence balance loss) unless each
    token is weighed by the sequences holding it, which they are not yet."""
    found = [k for k in ("attention_mask", "indexer") if batch.get(k) is not None]
    if found:
        raise ValueError(f"a tree batch takes its mask and positions from its Tree; found {', '.join(found)} beside "
                         f"it: drop them or run without sharing prefixes (--data.share_prefixes false)")
    if positions is not None:
        raise ValueError("a tree batch's rows are not split over context-parallel ranks yet; run with cp 1 or "
                         "without sharing prefixes (--data.share_prefixes false)")
    if objectives.indexer_loss != "off" or objectives.seq_aux or objectives.mtp_depths:
        raise ValueError("the indexer loss, the sequence balance loss and a step's MTP loss do not weigh a tree's "
                         "shared tokens by the sequences holding them yet (tree_logprobs computes MTP terms); turn "
                         "them off or run with --data.share_prefixes false")


def replay_records(cfg: GLM5Config, local: dict, mask: Mask) -> tuple[dict, dict]:
    """(`Env.routing`, `Env.indexer`) of this rank's share of a batch with replay keys."""
    slots = replay.replay_slots(cfg)
    routing = local.get("routing")
    routing = {} if routing is None else {layer: routing[:, :, m] for layer, m in slots["routing"].items()}
    indexer = local.get("indexer")
    if indexer is None:
        return routing, {}
    rows_BxSxLxT = replay.key_rows(indexer, mask.q_index, local["position_ids"], cfg)
    return routing, {layer: rows_BxSxLxT[:, :, j] for layer, j in slots["indexer"].items()}

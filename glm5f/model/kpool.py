"""GLM-5.3's pooled DSA indexer (KPool): the indexer scores pools of index_kpool keys instead of single keys, picks
the top index_topk / index_kpool pools per query, expands them to their tokens and adds the query's own pool.

Pools tile each document from its first real token. A pool's key is a per-channel softmax-weighted mean of its
tokens' index keys (logits: a gate projection of the token plus a learned term per position in the pool). A pool
is a candidate for a query when all its tokens are real and its last token is visible. Pool keys are laid out at
their last token's position ([B, T, J], zero elsewhere), so the existing `glm5f::indexer_topk` op selects pools with
the token mask unchanged (causal order, padding, documents), its key_valid narrowed to pool ends: equal scores go to
the lower pool. The expanded tokens then feed `glm5f::sparse_mla` with an explicit allowed mask.

Shape suffixes: B batch, S queries, T keys, I indexer heads, J index_head_dim, D hidden, G pools per query (top),
W = G * index_kpool + index_kpool - 1 selected tokens per query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5f.kernels import dsa as kernels
from glm5f.core import replay
from glm5f.model.env import Mask
from glm5f.core.ops import layer_norm, linear, wide


@dataclass(frozen=True)
class Pools:
    """Where the pools of a batch lie. offset [B, T]: each token's index in its document counted from the
    document's first real token (negative before it); end [B, T] bool: the token ends a complete pool (every
    token of it real and in the document)."""

    offset: torch.Tensor
    end: torch.Tensor
    members: torch.Tensor | None = None  # [B, T, kpool] in a tree batch: the pool ending at t's tokens, in order


def pools(mask: Mask, B: int, kpool: int) -> Pools:
    """The pools of keys 0..T-1 under `mask` (padding and packed documents; a 4D mask has no documents to tile)."""
    if mask.dense is not None:
        raise ValueError("GLM-5.3's pooled indexer tiles documents into pools: it takes a 2D padding mask or packed "
                         "position_ids, not a 4D attention_mask")
    if mask.tree is not None:  # each path's tokens tile from its root's first (position 0)
        offset_BxT = mask.tree.position.expand(B, -1)
        end_BxT = (offset_BxT >= kpool - 1) & ((offset_BxT + 1) % kpool == 0)
        return Pools(offset_BxT, end_BxT, mask.tree.ancestors(kpool).flip(-1).expand(B, -1, -1))
    T = mask.num_keys
    device = mask.q_index.device
    t_T = torch.arange(T, device=device)
    valid_BxT = torch.ones(B, T, dtype=torch.bool, device=device) if mask.key_valid is None else \
        mask.key_valid.expand(B, -1)
    seg_BxT = torch.zeros(B, T, dtype=torch.long, device=device) if mask.k_segment is None else \
        mask.k_segment.expand(B, -1).long()
    seg_BxT = seg_BxT - seg_BxT[:, :1]  # packed_segments' ids count up from the first: 0..T-1 here
    first_real = torch.where(valid_BxT, t_T, T)
    anchor_BxT = torch.full((B, T), T, dtype=torch.long, device=device).scatter_reduce(
        1, seg_BxT, first_real.expand(B, -1), "amin").gather(1, seg_BxT)
    offset_BxT = t_T - anchor_BxT
    real_before = torch.nn.functional.pad(valid_BxT.long().cumsum(1), (1, 0))  # real tokens before position t
    window_real = real_before[:, kpool:] - real_before[:, :T - kpool + 1] == kpool  # t - kpool + 1 .. t all real
    window_real = torch.nn.functional.pad(window_real, (kpool - 1, 0), value=False)
    end_BxT = window_real & (offset_BxT >= kpool - 1) & ((offset_BxT + 1) % kpool == 0)
    return Pools(offset_BxT, end_BxT)


def pool_keys(keys_BxTxJ: torch.Tensor, gate_BxTxJ: torch.Tensor, ape_KxJ: torch.Tensor, where: Pools,
              kpool: int) -> torch.Tensor:
    """Pool keys [B, T, J] at each complete pool's last token (zero elsewhere): per channel j, the pool's tokens'
    keys weighted by softmax over the pool of gate[t, j] + ape[t's index in the pool, j], in fp32 (or wider)."""
    B, T, J = keys_BxTxJ.shape
    if where.members is not None:
        return tree_pool_keys(keys_BxTxJ, gate_BxTxJ, ape_KxJ, where)
    t_T = torch.arange(T, device=keys_BxTxJ.device)
    offset = where.offset.clamp(min=0)
    # each token's pool, named by the pool's last index; tokens before their document's first real one go to a
    # slot of their own (T + kpool - 1) that no pool end reads
    pool_end_BxT = torch.where(where.offset >= 0, t_T - offset % kpool + kpool - 1, T + kpool - 1)
    slot_BxTxJ = pool_end_BxT[..., None].expand(-1, -1, J)
    logits_BxTxJ = wide(gate_BxTxJ) + wide(ape_KxJ)[offset % kpool]
    with torch.no_grad():  # the softmax's shift: any per-pool constant gives the same weights
        top = logits_BxTxJ.new_full((B, T + kpool, J), float("-inf")).scatter_reduce(1, slot_BxTxJ, logits_BxTxJ,
                                                                                    "amax")
    e_BxTxJ = torch.exp(logits_BxTxJ - top.gather(1, slot_BxTxJ))
    den = e_BxTxJ.new_zeros(B, T + kpool, J).scatter_add(1, slot_BxTxJ, e_BxTxJ)
    num = e_BxTxJ.new_zeros(B, T + kpool, J).scatter_add(1, slot_BxTxJ, e_BxTxJ * keys_BxTxJ.to(e_BxTxJ.dtype))
    pooled_BxTxJ = (num[:, :T] / den[:, :T].clamp(min=torch.finfo(den.dtype).tiny)).to(keys_BxTxJ.dtype)
    return pooled_BxTxJ.masked_fill(~where.end[..., None], 0)


def tree_pool_keys(keys_BxTxJ: torch.Tensor, gate_BxTxJ: torch.Tensor, ape_KxJ: torch.Tensor,
                   where: Pools) -> torch.Tensor:
    """`pool_keys` of a tree batch: each pool's tokens gathered along its end's path (`Pools.members`)."""
    B, T, J = keys_BxTxJ.shape
    idx_BxTP = where.members.clamp(min=0).flatten(1)[..., None].expand(-1, -1, J)
    gate_BxTxPxJ = gate_BxTxJ.gather(1, idx_BxTP).view(B, T, -1, J)
    weights = torch.softmax(wide(gate_BxTxPxJ) + wide(ape_KxJ), dim=2)
    keys_BxTxPxJ = keys_BxTxJ.gather(1, idx_BxTP).view(B, T, -1, J)
    pooled_BxTxJ = (weights * keys_BxTxPxJ.to(weights.dtype)).sum(2).to(keys_BxTxJ.dtype)
    return pooled_BxTxJ.masked_fill(~where.end[..., None], 0)


def candidates(mask: Mask, where: Pools) -> Mask:
    """The mask of the pool keys each query may score: `mask` with its key_valid narrowed to complete pools' ends."""
    return Mask(mask.q_index, mask.num_keys, key_valid=where.end, q_segment=mask.q_segment, k_segment=mask.k_segment,
                tree=mask.tree)


def pooled_selection(q_BxSxIxJ: torch.Tensor, w_BxSxI: torch.Tensor, pooled_BxTxJ: torch.Tensor, where: Pools,
                     mask: Mask, index_topk: int, kpool: int, tail: bool,
                     recorded_BxSxG: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices [B, S, W], allowed [B, S, W]) each query attends: its top index_topk / index_kpool candidate
    pools by index score (`glm5f::indexer_topk`; fewer when fewer are candidates), or with `recorded_BxSxG` (pool
    ends, `replay.key_rows`) the recorded pools where a query has a record (`replay.replayed`), expanded to their
    tokens, then with `tail` the real tokens of its own pool up to itself when it does not end that pool
    (index_kpool - 1 slots). Padding queries attend to nothing."""
    B, S = q_BxSxIxJ.shape[:2]
    T = pooled_BxTxJ.shape[1]
    pool_mask = candidates(mask, where)
    k = min(index_topk // kpool, T)
    ends_BxSxG = kernels.indexer_topk(q_BxSxIxJ, w_BxSxI, pooled_BxTxJ.to(q_BxSxIxJ.dtype), pool_mask.q_index,
                                      pool_mask.key_valid, pool_mask.q_segment, pool_mask.k_segment, None, None, k,
                                      pool_mask.reach)
    if recorded_BxSxG is None:
        chosen_BxSxG = pool_mask.at(ends_BxSxG)
    else:
        ends_BxSxG, chosen_BxSxG = replay.replayed(ends_BxSxG, recorded_BxSxG, pool_mask.at)
    step_P = torch.arange(kpool, device=ends_BxSxG.device)
    if where.members is None:
        idx_BxSxW = (ends_BxSxG[..., None] - (kpool - 1) + step_P).flatten(2)
    else:
        idx_BxSxW = where.members.gather(1, ends_BxSxG.flatten(1)[..., None].expand(-1, -1, kpool)).view(
            B, S, -1)
    allowed_BxSxW = chosen_BxSxG[..., None].expand(-1, -1, -1, kpool).flatten(2)
    if tail and kpool > 1:
        q_offset_BxS = where.offset[:, mask.q_index]
        in_pool_BxS = q_offset_BxS % kpool  # the query's index in its own pool
        if where.members is None:
            tail_BxSxP = mask.q_index[None, :, None] - in_pool_BxS[..., None] + step_P[:kpool - 1]
        else:  # the query's predecessors on its path: in_pool - s steps back for slot s
            back_BxSxP = (in_pool_BxS[..., None] - step_P[:kpool - 1]).clamp(min=0)
            tail_BxSxP = where.members[:, mask.q_index].flip(-1).gather(-1, back_BxSxP)
        valid_BxT = where.offset >= 0 if mask.key_valid is None else mask.key_valid.expand(B, -1) & (where.offset >= 0)
        tail_ok = ((step_P[:kpool - 1] <= in_pool_BxS[..., None]) & (in_pool_BxS[..., None] < kpool - 1)
                   & (q_offset_BxS[..., None] >= 0))
        tail_ok = tail_ok & valid_BxT.gather(1, tail_BxSxP.clamp(0, T - 1).flatten(1)).view_as(tail_BxSxP)
        idx_BxSxW = torch.cat([idx_BxSxW, tail_BxSxP], dim=-1)
        allowed_BxSxW = torch.cat([allowed_BxSxW, tail_ok], dim=-1)
    allowed_BxSxW = allowed_BxSxW & mask.query_valid(B)[..., None]
    return idx_BxSxW.clamp(0, T - 1), allowed_BxSxW


def pooled_indexer(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, keys_BxTx_: torch.Tensor, mask: Mask,
                   index_topk: int, kpool: int, tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`pooled_selection` of one layer's indexer (ip: wq_b, weights_proj, index_kpool_compress_ape) from its input
    x, the q latent and keys_BxTx_ [B, T, 2J], every key's index key and gate logits (`index_key_and_gate`)."""
    J = ip["index_kpool_compress_ape"].shape[1]
    q_BxSxIxJ, w_BxSxI = index_queries(ip, x_BxSxD, q_BxSxQ)
    keys_BxTxJ, gate_BxTxJ = keys_BxTx_.split([J, J], dim=-1)
    where = pools(mask, x_BxSxD.shape[0], kpool)
    pooled_BxTxJ = pool_keys(keys_BxTxJ, gate_BxTxJ, ip["index_kpool_compress_ape"], where, kpool)
    return pooled_selection(q_BxSxIxJ, w_BxSxI, pooled_BxTxJ, where, mask, index_topk, kpool, tail)


def index_queries(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index queries [B, S, I, J] from the q latent, head weights [B, S, I] scaled by I^-0.5), both wide (no
    rope: GLM-5.3 is NoPE)."""
    J = ip["index_kpool_compress_ape"].shape[1]
    q_BxSxIxJ = wide(linear(ip["wq_b"], q_BxSxQ).unflatten(-1, (-1, J)))
    return q_BxSxIxJ, linear(ip["weights_proj"], wide(x_BxSxD)) * q_BxSxIxJ.shape[2] ** -0.5


def index_key_and_gate(ip: dict, x_BxSxD: torch.Tensor) -> torch.Tensor:
    """[B, S, 2J]: each token's index key LayerNorm(wk x) (no rope: GLM-5.3 is NoPE) and its pool gate logits
    (index_kpool_compress_gate x), side by side so one gather over the keys' ranks carries both."""
    key_BxSxJ = layer_norm(ip["k_norm"], linear(ip["wk"], x_BxSxD))
    gate_BxSxJ = linear({"weight": ip["index_kpool_compress_gate"]}, x_BxSxD)
    return torch.cat([key_BxSxJ, gate_BxSxJ], dim=-1)

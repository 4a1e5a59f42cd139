"""MLA attention with DeepSeek Sparse Attention (DSA): the lightning indexer, its top-k, and sparse attention.

Keys and values are never stored per head: a token's key/value source is its *latent* row, the normalised
compressed kv (kv_lora_rank) followed by the shared rope key (qk_rope_head_dim). The sparse path gathers each
query's top-k latent rows and attends in latent space (queries absorb kv_b's key half, outputs pass through its
value half), so no L x L score matrix is built. The dense path (all keys selected) expands latents per head.

Shape suffixes: B batch, S queries (this rank's), T keys (global), H heads, K top-k, R kv_lora_rank,
P qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim, C = R + P, Q q_lora_rank, I indexer heads, J index_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from glm5f.config import GLM5Config
from glm5f.ops import apply_rope, layer_norm, linear, rms_norm, wide

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use 1e-6, not rms_norm_eps
INDEXER_QUERY_CHUNK_ELEMS = 1 << 25  # bound on the indexer's per-chunk [B, S, I, T] fp32 scores


@dataclass
class Mask:
    """Which keys each query may see, kept compact: causal order, key padding and document ids, or a dense mask.

    q_index [S]: each query's sequence index among the keys (causal: key index <= q_index).
    key_valid [B, T]: False for padding keys. q_segment [B, S] / k_segment [B, T]: document ids (packed
    sequences attend within their document). dense [B, S, T] bool: a user's 4D mask, used as given (no causal
    part added), with `bias` [B, S, T] its additive values where it was a float mask with non-zero entries.
    """

    q_index: torch.Tensor
    num_keys: int
    key_valid: torch.Tensor | None = None
    q_segment: torch.Tensor | None = None
    k_segment: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is exactly "key index <= query index" over the same S == T positions."""
        return (self.dense is None and self.key_valid is None and self.q_segment is None
                and self.q_index.numel() == self.num_keys)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """allowed [B or 1, stop - start, T] for queries start:stop."""
        if self.dense is not None:
            return self.dense[:, start:stop]
        k_index = torch.arange(self.num_keys, device=self.q_index.device)
        allowed = (k_index[None, :] <= self.q_index[start:stop, None])[None]
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, :]
        if self.q_segment is not None:
            allowed = allowed & (self.q_segment[:, start:stop, None] == self.k_segment[:, None, :])
        return allowed

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
        return allowed

    def bias_at(self, idx_BxSxK: torch.Tensor) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias.expand(idx_BxSxK.shape[0], -1, -1).gather(-1, idx_BxSxK)


def identity_keys(layer: int, name: str, local: torch.Tensor) -> torch.Tensor:
    """The default key collector: this rank's keys are all the keys (no context parallelism, no cache)."""
    return local


@dataclass
class AttnContext:
    """What attention needs beyond params and activations: rope tables of the local queries, the mask, and
    `collect(layer, name, local_keys) -> keys over all T positions` (identity; an all-gather under context
    parallelism; append-and-read for a decode cache)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: Mask
    collect: Callable[[int, str, torch.Tensor], torch.Tensor] = identity_keys

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self.cos.dtype


# ---- MLA projections ----------------------------------------------------------------------------------------------

def mla_project(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, ctx: AttnContext):
    """Queries (nope and rotated parts, plus the q latent the indexer reuses) and this rank's latent rows."""
    B, S, _ = x_BxSxD.shape
    q_BxSxQ = rms_norm(p["q_a_layernorm"]["weight"], linear(p["q_a_proj"], x_BxSxD), LATENT_NORM_EPS)
    q_BxSxHx_ = linear(p["q_b_proj"], q_BxSxQ).view(B, S, cfg.num_attention_heads, cfg.qk_head_dim)
    q_nope_BxSxHxN, q_rot_BxSxHxP = q_BxSxHx_.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv_BxSxC = linear(p["kv_a_proj_with_mqa"], x_BxSxD)
    kv_BxSxR, k_rot_BxSxP = kv_BxSxC.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent_BxSxC = torch.cat([rms_norm(p["kv_a_layernorm"]["weight"], kv_BxSxR, LATENT_NORM_EPS),
                              apply_rope(k_rot_BxSxP, ctx.cos, ctx.sin)], dim=-1)
    return q_nope_BxSxHxN, apply_rope(q_rot_BxSxHxP, ctx.cos, ctx.sin), q_BxSxQ, latent_BxSxC


def kv_b_heads(p: dict, cfg: GLM5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj split per head into its key half [H, N, R] and value half [H, V, R]."""
    w_Hx_xR = p["kv_b_proj"]["weight"].view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                            cfg.kv_lora_rank)
    return w_Hx_xR.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)


# ---- the lightning indexer ----------------------------------------------------------------------------------------

def indexer_keys(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, ctx: AttnContext) -> torch.Tensor:
    """Index keys [B, S, J]: LayerNorm(wk x), rope on the first P dims (the indexer splits [rope, nope])."""
    k_BxSxJ = layer_norm(p["k_norm"], linear(p["wk"], x_BxSxD))
    k_rot, k_pass = k_BxSxJ.split([cfg.qk_rope_head_dim, cfg.index_head_dim - cfg.qk_rope_head_dim], dim=-1)
    return torch.cat([apply_rope(k_rot, ctx.cos, ctx.sin), k_pass], dim=-1)


@torch.no_grad()
def indexer_scores(p: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, keys_BxTxJ: torch.Tensor,
                   cfg: GLM5Config, ctx: AttnContext, start: int, stop: int) -> torch.Tensor:
    """Index scores [B, stop - start, T] of queries start:stop: sum_i w_i relu(q_i . k / sqrt(J)), masked to -inf.

    Computed in fp32 (fp64 in fp64 runs), with weights_proj in fp32 (scaled by I^-0.5), as the reference does.
    """
    B = x_BxSxD.shape[0]
    I, J, P = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    x = x_BxSxD[:, start:stop]
    q_BxSxIxJ = linear(p["wq_b"], q_BxSxQ[:, start:stop]).view(B, stop - start, I, J)
    q_rot, q_pass = q_BxSxIxJ.split([P, J - P], dim=-1)
    q_BxSxIxJ = torch.cat([apply_rope(q_rot, ctx.cos[:, start:stop], ctx.sin[:, start:stop]), q_pass], dim=-1)
    n = stop - start
    scores_BxSxIxT = F.relu(torch.bmm(wide(q_BxSxIxJ).reshape(B, n * I, J), wide(keys_BxTxJ).transpose(1, 2))
                            .view(B, n, I, -1) * J ** -0.5)
    w_BxSxI = linear(p["weights_proj"], wide(x)) * I ** -0.5
    scores_BxSxT = torch.matmul(w_BxSxI.unsqueeze(-2), scores_BxSxIxT).squeeze(-2)
    mask = ctx.mask
    if mask.bias is not None:
        scores_BxSxT = scores_BxSxT + mask.bias[:, start:stop]
    return scores_BxSxT.masked_fill(~mask.rows(start, stop), float("-inf"))


@torch.no_grad()
def indexer_topk(p: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, keys_BxTxJ: torch.Tensor,
                 cfg: GLM5Config, ctx: AttnContext) -> torch.Tensor:
    """Top-k key indices [B, S, K] per query, K = min(index_topk, T), chosen in query chunks.

    Masked keys score -inf; when a query has fewer than K visible keys the remaining picks are masked keys, which
    `Mask.at` reports as not allowed, so attention never uses them.
    """
    B, S, _ = x_BxSxD.shape
    T = keys_BxTxJ.shape[1]
    K = min(cfg.index_topk, T)
    chunk = max(1, INDEXER_QUERY_CHUNK_ELEMS // max(1, B * cfg.index_n_heads * T))
    out = []
    for start in range(0, S, chunk):
        stop = min(S, start + chunk)
        scores = indexer_scores(p, x_BxSxD, q_BxSxQ, keys_BxTxJ, cfg, ctx, start, stop)
        out.append(topk_first(scores, K))
    return torch.cat(out, dim=1)


def topk_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (compared in fp32) along the last dim; equal scores go to the lower index.

    Ties are common (ReLU zeros) and torch.topk breaks them arbitrarily, so a query could see different keys in
    a full forward, a decode step or a context-parallel shard. Each score's order-preserving 32-bit pattern goes
    in the high half of an int64 key and the reversed index in the low half: the keys are unique.
    """
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    T = scores.shape[-1]
    rev_index = torch.arange(T - 1, -1, -1, device=scores.device)
    return (ordered * (1 << 32) + rev_index).topk(k, dim=-1).indices


# ---- attention cores ----------------------------------------------------------------------------------------------

def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax in fp32 (or wider) over the last dim; disallowed entries get the dtype's minimum (never NaN: a row
    with no allowed entry averages uniformly, as the reference does)."""
    scores = wide(scores)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).to(dtype)


def sparse_attention(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                     allowed_BxSxK: torch.Tensor, scale: float, value_dim: int,
                     bias_BxSxK: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over its K selected latent rows (shared by all heads) -> [B, S, H, value_dim].

    Values are the first `value_dim` channels of the latent rows. Memory is O(S K C), never O(S T). Computed in
    the queries' dtype; each key row's gradient is summed over the queries that selected it in the latent's.
    """
    B, T, C = latent_BxTxC.shape
    rows_BxSxK = idx_BxSxK + T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]
    sel_BxSxKxC = (latent_BxTxC.reshape(B * T, C).index_select(0, rows_BxSxK.flatten()).view(*idx_BxSxK.shape, C)
                   .to(q_BxSxHxC.dtype))
    scores_BxSxHxK = torch.einsum("bshc,bskc->bshk", q_BxSxHxC, sel_BxSxKxC) * scale
    if bias_BxSxK is not None:
        scores_BxSxHxK = scores_BxSxHxK + bias_BxSxK[:, :, None, :]
    probs_BxSxHxK = masked_softmax(scores_BxSxHxK, allowed_BxSxK[:, :, None, :], q_BxSxHxC.dtype)
    return torch.einsum("bshk,bskr->bshr", probs_BxSxHxK, sel_BxSxKxC[..., :value_dim])


def sparse_mla(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
               idx_BxSxK: torch.Tensor, mask: Mask, cfg: GLM5Config) -> torch.Tensor:
    """MLA over the selected keys, in latent space: q_nope absorbs W_k, the latent output passes W_v. -> [B,S,H,V]

    The contractions with kv_b compute in the latent's dtype (kv_b's; wider than the queries' under
    --train.reduce_dtype), attention itself in the queries'.
    """
    dt, act = latent_BxTxC.dtype, q_nope_BxSxHxN.dtype
    w_k_HxNxR, w_v_HxVxR = kv_b_heads(p, cfg)
    q_abs_BxSxHxR = torch.einsum("bshn,hnr->bshr", q_nope_BxSxHxN.to(dt), w_k_HxNxR.to(dt)).to(act)
    q_BxSxHxC = torch.cat([q_abs_BxSxHxR, q_rot_BxSxHxP], dim=-1)
    out_BxSxHxR = sparse_attention(q_BxSxHxC, latent_BxTxC, idx_BxSxK, mask.at(idx_BxSxK), cfg.softmax_scale,
                                   cfg.kv_lora_rank, mask.bias_at(idx_BxSxK))
    return torch.einsum("bshr,hvr->bshv", out_BxSxHxR.to(dt), w_v_HxVxR.to(dt)).to(act)


def expand_latent(p: dict, latent_BxTxC: torch.Tensor, cfg: GLM5Config):
    """Per-head keys [B, H, T, N + P] and values [B, H, T, V] from latent rows (through kv_b_proj)."""
    B, T, _ = latent_BxTxC.shape
    H, N = cfg.num_attention_heads, cfg.qk_nope_head_dim
    kv_BxTxR, k_rot_BxTxP = latent_BxTxC.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv_BxHxTx_ = linear(p["kv_b_proj"], kv_BxTxR).view(B, T, H, N + cfg.v_head_dim).transpose(1, 2)
    k_nope_BxHxTxN, v_BxHxTxV = kv_BxHxTx_.split([N, cfg.v_head_dim], dim=-1)
    k_BxHxTx_ = torch.cat([k_nope_BxHxTxN, k_rot_BxTxP[:, None].expand(B, H, T, -1)], dim=-1)
    return k_BxHxTx_, v_BxHxTxV


def dense_mla(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
              mask: Mask, cfg: GLM5Config, allowed_BxSxT: torch.Tensor | None = None) -> torch.Tensor:
    """MLA over all allowed keys (DSA with index_topk >= T), via scaled_dot_product_attention. -> [B, S, H, V]

    `allowed_BxSxT` overrides the mask (the masked-dense oracle of the sparse path passes its top-k set here).
    Computed in the latent's dtype (kv_b's), returned in the queries'.
    """
    k_BxHxTx_, v_BxHxTxV = expand_latent(p, latent_BxTxC, cfg)
    q_BxHxSx_ = torch.cat([q_nope_BxSxHxN, q_rot_BxSxHxP], dim=-1).transpose(1, 2).to(latent_BxTxC.dtype)
    if allowed_BxSxT is None and mask.is_plain_causal and mask.bias is None:
        out = F.scaled_dot_product_attention(q_BxHxSx_, k_BxHxTx_, v_BxHxTxV, is_causal=True,
                                             scale=cfg.softmax_scale)
    else:
        allowed = mask.rows(0, q_BxHxSx_.shape[2]) if allowed_BxSxT is None else allowed_BxSxT
        additive = torch.zeros(allowed.shape, dtype=q_BxHxSx_.dtype, device=q_BxHxSx_.device)
        if mask.bias is not None:
            additive = additive + mask.bias
        additive = additive.masked_fill(~allowed, torch.finfo(q_BxHxSx_.dtype).min)
        out = F.scaled_dot_product_attention(q_BxHxSx_, k_BxHxTx_, v_BxHxTxV, attn_mask=additive[:, None],
                                             scale=cfg.softmax_scale)
    return out.transpose(1, 2).to(q_nope_BxSxHxN.dtype)


def topk_as_mask(idx_BxSxK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, S, T], True at the selected keys."""
    sel = torch.zeros(*idx_BxSxK.shape[:2], num_keys, dtype=torch.bool, device=idx_BxSxK.device)
    return sel.scatter(-1, idx_BxSxK, True)


# ---- the attention block ------------------------------------------------------------------------------------------

def attention(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, ctx: AttnContext,
              prev_topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MLA + DSA for one layer. Returns (output [B, S, D], top-k indices [B, S, K] or None when every key is
    selected). A "full" layer runs its indexer; a "shared" layer reuses `prev_topk` from the last full layer."""
    B, S, _ = x_BxSxD.shape
    q_nope, q_rot, q_BxSxQ, latent_BxSxC = mla_project(p, x_BxSxD, cfg, ctx)
    # the latent rows are gathered (and their gradients summed over queries and CP ranks) in kv_b's dtype
    latent_dtype = torch.promote_types(latent_BxSxC.dtype, p["kv_b_proj"]["weight"].dtype)
    latent_BxTxC = ctx.collect(layer, "latent", latent_BxSxC.to(latent_dtype))
    T = latent_BxTxC.shape[1]
    if "indexer" in p:
        with torch.no_grad():  # the indexer is not trained through the language-model loss (as in the reference)
            keys_BxTxJ = ctx.collect(layer, "index_keys", indexer_keys(p["indexer"], x_BxSxD, cfg, ctx))
        topk = indexer_topk(p["indexer"], x_BxSxD, q_BxSxQ, keys_BxTxJ, cfg, ctx) if T > cfg.index_topk else None
    else:
        topk = prev_topk
    if topk is None and S > 1:
        out_BxSxHxV = dense_mla(p, q_nope, q_rot, latent_BxTxC, ctx.mask, cfg)
    else:
        if topk is None:  # one query (decoding) over at most index_topk keys: all of them
            topk = torch.arange(T, device=x_BxSxD.device).expand(B, S, T)
        out_BxSxHxV = sparse_mla(p, q_nope, q_rot, latent_BxTxC, topk, ctx.mask, cfg)
    return linear(p["o_proj"], out_BxSxHxV.reshape(B, S, -1)), topk

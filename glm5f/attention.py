"""MLA attention with DeepSeek Sparse Attention (DSA): the lightning indexer, its top-k, and sparse attention.

Keys and values are never stored per head: a token's key/value source is its *latent* row, the normalised
compressed kv (kv_lora_rank) followed by the shared rope key (qk_rope_head_dim). The sparse path gathers each
query's top-k latent rows and attends in latent space (queries absorb kv_b's key half, outputs pass through its
value half), so no L x L score matrix is built. The dense path (all keys selected) expands latents per head.

Shape suffixes: B batch, S queries (this rank's), T keys (global), H heads, K top-k, R kv_lora_rank,
P qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim, C = R + P, Q q_lora_rank, I indexer heads, J index_head_dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from glm5f.config import GLM5Config
from glm5f.ops import apply_rope, layer_norm, linear, rms_norm, wide, wide_dtype

if TYPE_CHECKING:
    from glm5f.moe import SeqAux

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use 1e-6, not rms_norm_eps
INDEXER_QUERY_CHUNK_ELEMS = 1 << 24  # bound on the indexer's per-chunk [B, S, I, T] fp32 scores


@dataclass
class Mask:
    """Which keys each query may see, kept compact: causal order, key padding and document ids, or a dense mask.

    q_index [S]: each query's sequence index among the keys (causal: key index <= q_index).
    key_valid [B, T]: False for padding keys. q_segment [B, S] / k_segment [B, T]: document ids (packed
    sequences attend within their document). dense [B, S, T] bool: a user's 4D mask, used as given (no causal
    part added), with `bias` [B, S, T] its additive values where it was a float mask with non-zero entries.
    q_index_host: q_index on the CPU where q_index lives on an accelerator (the indexer reads it to size its
    chunks without waiting for the device).
    """

    q_index: torch.Tensor
    num_keys: int
    key_valid: torch.Tensor | None = None
    q_segment: torch.Tensor | None = None
    k_segment: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    q_index_host: torch.Tensor | None = None

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is exactly "key index <= query index" over the same S == T positions."""
        return (self.dense is None and self.key_valid is None and self.q_segment is None
                and self.q_index.numel() == self.num_keys)

    def rows(self, start: int, stop: int, num_keys: int | None = None) -> torch.Tensor:
        """allowed [B or 1, stop - start, num_keys] for queries start:stop over the first num_keys (default all)."""
        nk = self.num_keys if num_keys is None else num_keys
        if self.dense is not None:
            return self.dense[:, start:stop, :nk]
        k_index = torch.arange(nk, device=self.q_index.device)
        allowed = (k_index[None, :] <= self.q_index[start:stop, None])[None]
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, :nk]
        if self.q_segment is not None:
            allowed = allowed & (self.q_segment[:, start:stop, None] == self.k_segment[:, None, :nk])
        return allowed

    def visible_keys(self, start: int, stop: int) -> int:
        """How many leading keys queries start:stop can see at most (causal: one past the last query's index)."""
        if self.dense is not None or stop <= start:
            return self.num_keys
        q_index = self.q_index if self.q_index_host is None else self.q_index_host
        return min(self.num_keys, int(q_index[start:stop].max()) + 1)

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
    parallelism; append-and-read for a decode cache). The objectives a training forward adds ride along:
    `indexer_loss`, "off" or the key set of the indexer's KL loss ("dense": every visible key, "sparse": the
    selected top-k; see `indexer_kl`); `indexer_target`, its target: "own" (each full layer's own attention) or
    "mean" (the mean over the full layer and the shared layers reusing its top-k, see `IndexerGroup`); `seq_aux`,
    set when the MoE layers are to compute their sequence-wise balance loss."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: Mask
    collect: Callable[[int, str, torch.Tensor], torch.Tensor] = identity_keys
    indexer_loss: str = "off"
    indexer_target: str = "own"
    seq_aux: SeqAux | None = None

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
                   cfg: GLM5Config, ctx: AttnContext, start: int, stop: int,
                   num_keys: int | None = None) -> torch.Tensor:
    """Index scores [B, stop - start, num_keys] of queries start:stop over the first num_keys keys (default all):
    sum_i w_i relu(q_i . k / sqrt(J)), masked to -inf.

    Computed in fp32 (fp64 in fp64 runs), with weights_proj in fp32 (scaled by I^-0.5), as the reference does;
    one GEMM for all heads of the block, then ReLU, scale and the head-weighted sum in place.
    """
    B = x_BxSxD.shape[0]
    I, J, P = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    keys_BxTxJ = keys_BxTxJ[:, :num_keys]
    x = x_BxSxD[:, start:stop]
    q_BxSxIxJ = linear(p["wq_b"], q_BxSxQ[:, start:stop]).view(B, stop - start, I, J)
    q_rot, q_pass = q_BxSxIxJ.split([P, J - P], dim=-1)
    q_BxSxIxJ = torch.cat([apply_rope(q_rot, ctx.cos[:, start:stop], ctx.sin[:, start:stop]), q_pass], dim=-1)
    n = stop - start
    scores_BxSIxT = torch.bmm(wide(q_BxSxIxJ).reshape(B, n * I, J), wide(keys_BxTxJ).transpose(1, 2))
    scores_BSxIxT = scores_BxSIxT.mul_(J ** -0.5).relu_().view(B * n, I, -1)
    w_BSx1xI = (linear(p["weights_proj"], wide(x)) * I ** -0.5).view(B * n, 1, I)
    scores_BxSxT = torch.bmm(w_BSx1xI, scores_BSxIxT).view(B, n, -1)
    mask = ctx.mask
    if mask.bias is not None:
        scores_BxSxT = scores_BxSxT + mask.bias[:, start:stop, :num_keys]
    return scores_BxSxT.masked_fill_(~mask.rows(start, stop, num_keys), float("-inf"))


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
    idx_BxSxK = torch.empty(B, S, K, dtype=torch.long, device=x_BxSxD.device)
    # the last chunk first: causal chunks see more keys the later they are, so each chunk's buffers fit in the
    # memory the one before freed (in ascending order every chunk needs more, and the host heap only grows)
    for start in reversed(range(0, S, chunk)):
        stop = min(S, start + chunk)
        # keys past the chunk's last query are masked for all of it: they are not scored (half the causal work);
        # at least K keys are kept, so the picks past a query's visible keys are the same masked ones as over all T
        num_keys = max(K, ctx.mask.visible_keys(start, stop))
        scores = indexer_scores(p, x_BxSxD, q_BxSxQ, keys_BxTxJ, cfg, ctx, start, stop, num_keys)
        idx_BxSxK[:, start:stop] = topk_first(scores, K)
    return idx_BxSxK


def topk_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (compared in fp32) along the last dim; equal scores go to the lower index.

    Ties are common (ReLU zeros) and torch.topk breaks them arbitrarily, so a query could see different keys in
    a full forward, a decode step or a context-parallel shard. Each score's 32-bit pattern is made
    order-preserving (negative floats: flip all but the sign bit), goes in the high half of an int64 key and the
    reversed index in the low half: the keys are unique. Two temporaries the size of `scores` (int32, int64).
    """
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0; a fresh tensor, changed in place
    bits ^= (bits >> 31) & 0x7FFFFFFF
    rev_index = torch.arange(scores.shape[-1] - 1, -1, -1, device=scores.device)
    return bits.to(torch.int64).mul_(1 << 32).add_(rev_index).topk(k, dim=-1).indices


# ---- attention cores ----------------------------------------------------------------------------------------------

SPARSE_BLOCK_ELEMS = 1 << 23  # bound on one query block's gathered rows plus scores, [B, s, K, C + 2H] elements


def sparse_block_size(B: int, K: int, C: int, H: int) -> int:
    """Queries per block of the blocked sparse core: its gathered latent rows [B, s, K, C] and its scores and
    probabilities [B, s, H, K] stay within SPARSE_BLOCK_ELEMS."""
    return max(1, SPARSE_BLOCK_ELEMS // max(1, B * K * (C + 2 * H)))


def _gather_rows(latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The selected latent rows [B, S, K, C] in `dtype`, one index_select over the flattened batch."""
    B, T, C = latent_BxTxC.shape
    rows = (idx_BxSxK + T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]).flatten()
    return latent_BxTxC.reshape(B * T, C).index_select(0, rows).view(*idx_BxSxK.shape, C).to(dtype)


def _block_probs(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale):
    """Softmax probabilities [B, S, H, K] (fp32 or wider) of one block of queries over its selected rows."""
    scores_BxSxHxK = torch.matmul(q_BxSxHxC, sel_BxSxKxC.transpose(-1, -2)).mul_(scale)
    if bias_BxSxK is not None:
        scores_BxSxHxK = scores_BxSxHxK + bias_BxSxK[:, :, None, :]
    scores_BxSxHxK = wide(scores_BxSxHxK).masked_fill_(~allowed_BxSxK[:, :, None, :],
                                                       torch.finfo(wide_dtype(q_BxSxHxC.dtype)).min)
    return torch.softmax(scores_BxSxHxK, dim=-1)


class _BlockedSparseAttention(torch.autograd.Function):
    """Sparse attention over query blocks, flash-attention style: the forward keeps no gathered rows, the
    backward gathers each block again and recomputes its softmax (deterministic, so identical to the forward's).
    Extra memory is one block's, independent of S; what is saved is the inputs (O(S H C) and O(S K))."""

    @staticmethod
    def forward(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block):
        B, S, H, _ = q_BxSxHxC.shape
        dt = q_BxSxHxC.dtype
        out_BxSxHxR = q_BxSxHxC.new_empty(B, S, H, value_dim)
        for a in range(0, S, block):
            b = min(S, a + block)
            sel = _gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
            probs = _block_probs(q_BxSxHxC[:, a:b], sel, allowed_BxSxK[:, a:b],
                                 None if bias_BxSxK is None else bias_BxSxK[:, a:b], scale).to(dt)
            out_BxSxHxR[:, a:b] = torch.matmul(probs, sel[..., :value_dim])
        return out_BxSxHxR

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, latent, idx, allowed, bias, scale, value_dim, block = inputs
        ctx.save_for_backward(q, latent, idx, allowed, bias)
        ctx.scale, ctx.value_dim, ctx.block = scale, value_dim, block

    @staticmethod
    def backward(ctx, dout_BxSxHxR):
        q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK = ctx.saved_tensors
        scale, R, block = ctx.scale, ctx.value_dim, ctx.block
        B, S, H, C = q_BxSxHxC.shape
        T, dt = latent_BxTxC.shape[1], q_BxSxHxC.dtype
        dq_BxSxHxC = torch.empty_like(q_BxSxHxC)
        # each selected row's gradient is summed over the queries that chose it in the latent's dtype (as the
        # unblocked path's index_select backward does): exact, so independent of blocks and of rank layouts
        dlatent = torch.zeros(B * T, C, dtype=latent_BxTxC.dtype, device=latent_BxTxC.device)
        offsets = T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]
        for a in range(0, S, block):
            b = min(S, a + block)
            q, dout, allowed = q_BxSxHxC[:, a:b], dout_BxSxHxR[:, a:b].to(dt), allowed_BxSxK[:, a:b]
            sel = _gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
            probs_w = _block_probs(q, sel, allowed, None if bias_BxSxK is None else bias_BxSxK[:, a:b], scale)
            probs = probs_w.to(dt)
            dprobs_w = wide(torch.matmul(dout, sel[..., :R].transpose(-1, -2)))
            dscores_w = probs_w * (dprobs_w - (probs_w * dprobs_w).sum(-1, keepdim=True))
            dscores = dscores_w.masked_fill_(~allowed[:, :, None, :], 0).to(dt).mul_(scale)
            dq_BxSxHxC[:, a:b] = torch.matmul(dscores, sel)
            dsel = torch.matmul(dscores.transpose(-1, -2), q)
            dsel[..., :R] += torch.matmul(probs.transpose(-1, -2), dout)
            dlatent.index_add_(0, (idx_BxSxK[:, a:b] + offsets).flatten(),
                               dsel.reshape(-1, C).to(latent_BxTxC.dtype))
        return dq_BxSxHxC, dlatent.view(B, T, C), None, None, None, None, None, None


def sparse_attention(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                     allowed_BxSxK: torch.Tensor, scale: float, value_dim: int,
                     bias_BxSxK: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """Attention of each query over its K selected latent rows (shared by all heads) -> [B, S, H, value_dim].

    Values are the first `value_dim` channels of the latent rows. Queries run in blocks of `block` (default
    `sparse_block_size`), so memory is linear in S and never O(S T) or O(S K C). Computed in the queries' dtype
    with an fp32 (or wider) softmax; each key row's gradient is summed over queries in the latent's dtype.
    Under torch.func transforms (grad, vmap, jacrev) the same math runs unblocked through plain autograd ops
    (`sparse_attention_unblocked`), which functorch differentiates and batches itself.
    """
    if torch._C._are_functorch_transforms_active():
        return sparse_attention_unblocked(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, scale, value_dim,
                                          bias_BxSxK)
    B, S, H, C = q_BxSxHxC.shape
    block = block or sparse_block_size(B, idx_BxSxK.shape[-1], C, H)
    return _BlockedSparseAttention.apply(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale,
                                         value_dim, block)


def sparse_attention_unblocked(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                               allowed_BxSxK: torch.Tensor, scale: float, value_dim: int,
                               bias_BxSxK: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of `sparse_attention`: every query's rows gathered at once ([B, S, K, C]), plain autograd."""
    sel_BxSxKxC = _gather_rows(latent_BxTxC, idx_BxSxK, q_BxSxHxC.dtype)
    probs_BxSxHxK = _block_probs(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale).to(q_BxSxHxC.dtype)
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


# The cost model that picks between the two exact paths for a top-k set, in fp32 FLOP equivalents of one forward
# (the backward scales both alike). Gathered sparse attention runs its contractions as one small GEMM per query
# (M = H rows), well below the matmul peak, and moves every gathered latent element through memory; masked dense
# attention expands the latent per head and scores every key, in large GEMMs, and builds a [B, S, T] mask.
# Measured on a 2-core CPU (bench/attention.py, fp32): dense wins at short L and K near T, sparse from ~K = T/4.
SMALL_GEMM_SLOWDOWN = 4.0  # a per-query [H, C] x [C, K] GEMM's time over a large GEMM's, per FLOP
GATHER_FLOPS = 8.0  # one gathered latent element (index_select, copy, its gradient's index_add)
MASK_FLOPS = 4.0  # one [B, S, T] mask element (built, added to the scores, its softmax entry)
DENSE_MAX_MASK_ELEMS = 1 << 26  # never build a mask larger than this: the dense path's memory is O(S T)
# Off by default for now: in fp32 the masked-dense path makes parallel layouts drift apart within 10 steps
# (scripts/align.py: ep2 1.3e-3, cp2 2.6e-3 max |loss diff|, against 2.6e-7 when every top-k layer gathers).
DENSE_TOPK_PATH = False


def dense_is_cheaper(B: int, T: int, K: int, cfg: GLM5Config) -> bool:
    """True when masked dense attention of T queries over T keys, K selected each, costs less than gathering the
    selected keys (the result is the same)."""
    H, R, P = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    N, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    S = T
    if B * S * T > DENSE_MAX_MASK_ELEMS:
        return False
    sparse = B * S * K * (2 * H * (R + P + R) * SMALL_GEMM_SLOWDOWN + GATHER_FLOPS * (R + P))
    dense = 2 * B * T * R * H * (N + V) + 2 * B * S * T * H * (N + P + V) + MASK_FLOPS * B * S * T * H
    return dense < sparse


# ---- the attention block ------------------------------------------------------------------------------------------

def attention(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, ctx: AttnContext,
              prev_topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """MLA + DSA for one layer. Returns (output [B, S, D], top-k indices [B, S, K] or None when every key is
    selected, aux). A "full" layer runs its indexer; a "shared" layer reuses `prev_topk` from the last full layer.
    aux: with ctx.indexer_loss on, a full layer's "indexer_loss" and "indexer_recall" fp64 sums (`indexer_kl`).
    With ctx.indexer_target "mean", a layer followed by a shared one returns an `IndexerGroup` (holding the top-k)
    in place of the top-k, and the group's last layer's aux holds the group's sums (`group_kl`)."""
    B, S, _ = x_BxSxD.shape
    q_nope, q_rot, q_BxSxQ, latent_BxSxC = mla_project(p, x_BxSxD, cfg, ctx)
    # the latent rows are gathered (and their gradients summed over queries and CP ranks) in kv_b's dtype
    latent_dtype = torch.promote_types(latent_BxSxC.dtype, p["kv_b_proj"]["weight"].dtype)
    latent_BxTxC = ctx.collect(layer, "latent", latent_BxSxC.to(latent_dtype))
    T = latent_BxTxC.shape[1]
    if "indexer" in p and ctx.indexer_loss != "off":  # trained by its own loss only: its inputs are detached
        keys_BxTxJ = ctx.collect(layer, "index_keys", indexer_keys(p["indexer"], x_BxSxD.detach(), cfg, ctx))
        topk = indexer_topk(p["indexer"], x_BxSxD, q_BxSxQ, keys_BxTxJ.detach(), cfg, ctx) \
            if T > cfg.index_topk else None
    elif "indexer" in p:
        with torch.no_grad():  # the indexer is not trained through the language-model loss (as in the reference)
            keys_BxTxJ = ctx.collect(layer, "index_keys", indexer_keys(p["indexer"], x_BxSxD, cfg, ctx))
        topk = indexer_topk(p["indexer"], x_BxSxD, q_BxSxQ, keys_BxTxJ, cfg, ctx) if T > cfg.index_topk else None
    else:
        topk = prev_topk
    group = None
    if isinstance(topk, IndexerGroup):  # a shared layer of a "mean" group
        group, topk = topk, topk.topk
    elif "indexer" in p and ctx.indexer_loss != "off" and ctx.indexer_target == "mean":
        q_BxSxIxJ, w_BxSxI = indexer_student(p["indexer"], x_BxSxD.detach(), q_BxSxQ.detach(), cfg, ctx)
        group = IndexerGroup(topk, x_BxSxD.shape[:2], q_BxSxIxJ, w_BxSxI, keys_BxTxJ, ())
    if topk is None and S > 1:
        out_BxSxHxV = dense_mla(p, q_nope, q_rot, latent_BxTxC, ctx.mask, cfg)
    elif (DENSE_TOPK_PATH and topk is not None and S > 1 and latent_dtype == q_nope.dtype
          and dense_is_cheaper(B, T, topk.shape[-1], cfg)):
        # decided on the global sequence, so every CP rank and one process take the same path; with a wider latent
        # (--train.reduce_dtype) always gathered: only there is each key's gradient an exact sum over queries
        allowed_BxSxT = ctx.mask.rows(0, S) & topk_as_mask(topk, T)
        out_BxSxHxV = dense_mla(p, q_nope, q_rot, latent_BxTxC, ctx.mask, cfg, allowed_BxSxT=allowed_BxSxT)
    else:
        if topk is None:  # one query (decoding) over at most index_topk keys: all of them
            topk = torch.arange(T, device=x_BxSxD.device).expand(B, S, T)
        out_BxSxHxV = sparse_mla(p, q_nope, q_rot, latent_BxTxC, topk, ctx.mask, cfg)
    aux = {}
    if group is not None:
        qa_BxSxHxC = target_queries(p, q_nope.detach(), q_rot.detach(), latent_BxTxC.detach(), cfg)
        group = dataclasses.replace(group, targets=group.targets + ((qa_BxSxHxC, latent_BxTxC.detach()),))
        if layer + 1 >= cfg.num_hidden_layers or cfg.has_indexer(layer + 1):  # the group's last layer
            aux["indexer_loss"], aux["indexer_recall"] = group_kl(group, cfg, ctx)
        else:
            return linear(p["o_proj"], out_BxSxHxV.reshape(B, S, -1)), group, aux
    elif "indexer" in p and ctx.indexer_loss != "off":
        aux["indexer_loss"], aux["indexer_recall"] = indexer_kl(
            p, x_BxSxD.detach(), q_BxSxQ.detach(), keys_BxTxJ, q_nope.detach(), q_rot.detach(),
            latent_BxTxC.detach(), None if topk is None or topk.shape[-1] >= T else topk, cfg, ctx)
    return linear(p["o_proj"], out_BxSxHxV.reshape(B, S, -1)), topk, aux


# ---- the indexer's training objective -----------------------------------------------------------------------------

INDEXER_LOSS_BLOCK_ELEMS = 1 << 23  # bound on one query block's scores of both attentions, [B, s, keys, ~2H + 3I]


def indexer_kl(p: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, keys_BxTxJ: torch.Tensor,
               q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor, latent_BxTxC: torch.Tensor,
               topk: torch.Tensor | None, cfg: GLM5Config, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL sum, recall sum): fp64 sums over this rank's valid queries of the lightning indexer's distillation loss.

    Per query, over its key set (ctx.indexer_loss "dense": every key it may see; "sparse": its selected top-k):
    the target is the main attention's probabilities (fp32 softmax of the MLA scores), summed over heads and
    L1-normalised, detached; the student is the log-softmax of the index scores sum_i w_i relu(q_i . k / sqrt(J))
    over the same keys; the loss is KL(target || student). Recall is the target's mass on the selected keys (1
    where every key is selected, and in sparse mode). Only the indexer's leaves p["indexer"] get gradients (the
    other inputs must come detached); keys_BxTxJ are the collected index keys, with their graph.
    """
    q_BxSxIxJ, w_BxSxI = indexer_student(p["indexer"], x_BxSxD, q_BxSxQ, cfg, ctx)
    qa_BxSxHxC = target_queries(p, q_nope_BxSxHxN, q_rot_BxSxHxP, latent_BxTxC, cfg)
    group = IndexerGroup(topk, x_BxSxD.shape[:2], q_BxSxIxJ, w_BxSxI, keys_BxTxJ, ((qa_BxSxHxC, latent_BxTxC),))
    return group_kl(group, cfg, ctx)


@dataclass(frozen=True)
class IndexerGroup:
    """What the indexer loss of a "mean" target needs from a full layer and the shared layers reusing its top-k,
    carried from layer to layer in place of the top-k (`attention`'s prev_topk) until the group's last layer.

    topk [B, S, K] (None: every key selected); shape (B, S); the student's inputs with their graph to the full
    layer's indexer: index queries q_BxSxIxJ (wide, roped), head weights w_BxSxI, collected index keys
    keys_BxTxJ; targets: per layer so far, its detached absorbed queries qa_BxSxHxC and collected latent rows
    latent_BxTxC (O(S H C) each: the target distributions themselves are made per query block in `group_kl`).
    """

    topk: torch.Tensor | None
    shape: tuple
    q_BxSxIxJ: torch.Tensor
    w_BxSxI: torch.Tensor
    keys_BxTxJ: torch.Tensor
    targets: tuple


def indexer_student(ip: dict, x_BxSxD: torch.Tensor, q_BxSxQ: torch.Tensor, cfg: GLM5Config, ctx: AttnContext):
    """(index queries [B, S, I, J] roped and wide, head weights [B, S, I]) of the student, with their graph."""
    B, S = x_BxSxD.shape[:2]
    I, J, P = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_BxSxIxJ = linear(ip["wq_b"], q_BxSxQ).view(B, S, I, J)
    q_rot, q_pass = q_BxSxIxJ.split([P, J - P], dim=-1)
    q_BxSxIxJ = wide(torch.cat([apply_rope(q_rot, ctx.cos, ctx.sin), q_pass], dim=-1))
    w_BxSxI = linear(ip["weights_proj"], wide(x_BxSxD)) * I ** -0.5
    return q_BxSxIxJ, w_BxSxI


@torch.no_grad()
def target_queries(p: dict, q_nope_BxSxHxN: torch.Tensor, q_rot_BxSxHxP: torch.Tensor,
                   latent_BxTxC: torch.Tensor, cfg: GLM5Config) -> torch.Tensor:
    """The target's queries [B, S, H, C], absorbed into latent space as the sparse path computes them."""
    dt, act = latent_BxTxC.dtype, q_nope_BxSxHxN.dtype
    w_k_HxNxR, _ = kv_b_heads(p, cfg)
    q_abs_BxSxHxR = torch.einsum("bshn,hnr->bshr", q_nope_BxSxHxN.to(dt), w_k_HxNxR.detach().to(dt)).to(act)
    return torch.cat([q_abs_BxSxHxR, q_rot_BxSxHxP], dim=-1)


def group_kl(g: IndexerGroup, cfg: GLM5Config, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL sum, recall sum) of `indexer_kl` with the target the mean of the group's layers' targets."""
    B, S = g.shape
    I, J, H = cfg.index_n_heads, cfg.index_head_dim, cfg.num_attention_heads
    keys_BxTxJ, latent_BxTxC = g.keys_BxTxJ, g.targets[0][1]
    topk = None if g.topk is None or g.topk.shape[-1] >= keys_BxTxJ.shape[1] else g.topk
    mask = ctx.mask
    valid_BxS = (mask.key_valid.expand(B, -1)[:, mask.q_index] if mask.key_valid is not None
                 else torch.ones(B, S, dtype=torch.bool, device=keys_BxTxJ.device))
    sparse = ctx.indexer_loss == "sparse" and topk is not None
    C = latent_BxTxC.shape[-1]
    width = topk.shape[-1] if sparse else keys_BxTxJ.shape[1]
    block = max(1, INDEXER_LOSS_BLOCK_ELEMS // max(1, B * width * (2 * H + 3 * I + 8 + (C + J if sparse else 0))))
    return _IndexerKL.apply(g.q_BxSxIxJ, g.w_BxSxI, keys_BxTxJ, g.targets, topk, valid_BxS, mask,
                            cfg.softmax_scale, sparse, block)


def _gather_keys(keys_BxTxJ: torch.Tensor, idx_BxSxK: torch.Tensor) -> torch.Tensor:
    """Rows [B, S, K, J] of keys at each query's indices (differentiable)."""
    B, T, J = keys_BxTxJ.shape
    rows = (idx_BxSxK + T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]).flatten()
    return keys_BxTxJ.reshape(B * T, J).index_select(0, rows).view(*idx_BxSxK.shape, J)


class _IndexerKL(torch.autograd.Function):
    """The indexer's KL over query blocks, with its gradient taken block by block in the forward (the student's
    [B, s, I, keys] scores live for one block only); the backward scales the saved input gradients."""

    @staticmethod
    def forward(ctx, q_BxSxIxJ, w_BxSxI, keys_BxTxJ, targets, topk, valid_BxS, mask, scale, sparse, block):
        """targets: ((qa_BxSxHxC, latent_BxTxC) per layer): the target is the mean of their distributions."""
        want = any(ctx.needs_input_grad[:3])
        B, S = valid_BxS.shape
        T, J = keys_BxTxJ.shape[1:]
        grads = [torch.zeros_like(t) for t in (q_BxSxIxJ, w_BxSxI, keys_BxTxJ)] if want else []
        loss = torch.zeros((), dtype=torch.float64, device=q_BxSxIxJ.device)
        recall = torch.zeros_like(loss)
        keys_d = keys_BxTxJ.detach().requires_grad_(want)
        if sparse:  # as the sparse path sees them (Mask.at takes every query's indices)
            allowed_BxSxK, bias_BxSxK = mask.at(topk), mask.bias_at(topk)
        for a in range(0, S, block):
            b = min(S, a + block)
            valid = valid_BxS[:, a:b].to(torch.float64)
            if sparse:
                idx = topk[:, a:b]
                allowed = allowed_BxSxK[:, a:b]
                bias = None if bias_BxSxK is None else bias_BxSxK[:, a:b]
            else:
                nk = mask.visible_keys(a, b)
                allowed = mask.rows(a, b, nk)
                bias = None if mask.bias is None else mask.bias[:, a:b, :nk]
            layer_targets = []
            for qa_BxSxHxC, latent_BxTxC in targets:
                rows = (_gather_rows(latent_BxTxC, idx, qa_BxSxHxC.dtype) if sparse
                        else latent_BxTxC[:, None, :nk].to(qa_BxSxHxC.dtype))
                # the target: heads' probabilities summed, zero off the key set, L1-normalised
                probs = _block_probs(qa_BxSxHxC[:, a:b], rows, allowed, bias, scale).sum(2)
                target = probs.masked_fill_(~allowed, 0)
                layer_targets.append(target / target.sum(-1, keepdim=True).clamp(min=torch.finfo(target.dtype).tiny))
            target = layer_targets[0] if len(layer_targets) == 1 else sum(layer_targets) / len(layer_targets)
            with torch.enable_grad():
                q = q_BxSxIxJ[:, a:b].detach().requires_grad_(want)
                w = w_BxSxI[:, a:b].detach().requires_grad_(want)
                k = wide(keys_d)
                if sparse:
                    z = torch.einsum("bsij,bskj->bsik", q, _gather_keys(k, idx))
                else:
                    z = torch.matmul(q, k[:, None, :nk].transpose(-1, -2))
                scores = torch.einsum("bsi,bsik->bsk", w, (z * J ** -0.5).relu())
                if bias is not None:
                    scores = scores + bias
                scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
                kl = (torch.xlogy(target, target) - target * torch.log_softmax(scores, dim=-1)).sum(-1)
                block_loss = (kl.to(torch.float64) * valid).sum()
                if want:
                    dq, dw, dk = torch.autograd.grad(block_loss, [q, w, keys_d])
                    grads[0][:, a:b] = dq
                    grads[1][:, a:b] = dw
                    grads[2] += dk
            loss += block_loss.detach()
            if sparse:
                mass = target.sum(-1)
            elif topk is None:
                mass = target.sum(-1)
            else:
                mass = (target * topk_as_mask(topk[:, a:b], T)[..., :nk]).sum(-1)
            recall += (mass.to(torch.float64) * valid).sum()
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(recall)
        return loss, recall

    @staticmethod
    def backward(ctx, dloss, drecall):
        dq, dw, dk = ctx.saved_tensors
        return (dq * dloss.to(dq.dtype), dw * dloss.to(dw.dtype), dk * dloss.to(dk.dtype)) + (None,) * 7

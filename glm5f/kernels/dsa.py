"""DSA's two hot paths as torch custom ops: sparse MLA over each query's top-k latent rows (the MLA core, one call a
kernel replaces), and the indexer's top-k. The CPU runs blocked torch code; CUDA runs glm5f/kernels/triton_dsa.py's kernels.

Shape suffixes as in attention.py: B batch, S queries, T keys, H heads, K selected keys, C = R + P latent width,
I indexer heads, J index_head_dim.
"""

from __future__ import annotations

import functools
import warnings

import torch

from glm5f.core.ops import wide, wide_dtype
from glm5f.kernels.sparse_union import UNION_BLOCK_ROWS, union_plans, union_scores

SPARSE_BLOCK_ELEMS = 1 << 23  # bound on one query block's gathered rows plus scores, [B, s, K, C + 2H] elements
INDEXER_QUERY_CHUNK_ELEMS = 1 << 24  # bound on the indexer's per-chunk [B, S, I, T] fp32 scores
INDEXER_CPU_CHUNK_ELEMS = 1 << 22  # the CPU's, smaller: the same top-k, faster (docs/performance.md)
INDEXER_CAUSAL_CHUNKS = 4  # the CPU's fewest query chunks under a causal mask: 4 score 5/8 of the keys 1 would
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp64 compute keeps the torch code (fp32 accumulators)


@functools.cache
def triton_kernels():
    """glm5f.kernels.triton_dsa, or None (with one warning) where triton is not importable: CUDA then runs the torch code."""
    try:
        from glm5f.kernels import triton_dsa
    except ImportError as e:
        warnings.warn(f"glm5f.kernels.dsa: triton is not importable ({e}); sparse MLA and the indexer top-k run the "
                      "blocked torch code on CUDA (install triton for the fused kernels)", stacklevel=2)
        return None
    return triton_dsa


def _use_triton(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in TRITON_DTYPES for t in tensors) and triton_kernels() is not None


# ---- the blocked torch code (the CPU implementation) -------------------------------------------------------------

def sparse_block_size(B: int, K: int, C: int, H: int) -> int:
    """Queries per block of the blocked sparse core: its gathered latent rows [B, s, K, C] and its scores and
    probabilities [B, s, H, K] stay within SPARSE_BLOCK_ELEMS."""
    return max(1, SPARSE_BLOCK_ELEMS // max(1, B * K * (C + 2 * H)))


def gather_rows(x_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows [B, S, K, C] of x at each query's indices (in `dtype`, default x's), one index_select over the
    flattened batch; differentiable."""
    B, T, C = x_BxTxC.shape
    rows = (idx_BxSxK + T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]).flatten()
    out = x_BxTxC.reshape(B * T, C).index_select(0, rows).view(*idx_BxSxK.shape, C)
    return out if dtype is None else out.to(dtype)


def topk_as_mask(idx_BxSxK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, S, T], True at the selected keys."""
    sel = torch.zeros(*idx_BxSxK.shape[:2], num_keys, dtype=torch.bool, device=idx_BxSxK.device)
    return sel.scatter(-1, idx_BxSxK, True)


def block_scores(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale):
    """Scores [B, S, H, K] (fp32 or wider) of one block of queries over its selected rows, finfo.min where masked."""
    scores_BxSxHxK = torch.matmul(q_BxSxHxC, sel_BxSxKxC.transpose(-1, -2)).mul_(scale)
    if bias_BxSxK is not None:
        scores_BxSxHxK = scores_BxSxHxK + bias_BxSxK[:, :, None, :]
    return wide(scores_BxSxHxK).masked_fill_(~allowed_BxSxK[:, :, None, :],
                                             torch.finfo(wide_dtype(q_BxSxHxC.dtype)).min)


def softmax_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax over the last dim, its log-sum-exp as fp32): the log-sum-exp read off the largest probability,
    max - log(p_max) (p_max >= 1 / K, so well conditioned), which saves logsumexp's own exp pass."""
    probs = torch.softmax(scores, dim=-1)
    lse = scores.amax(-1).sub_(probs.amax(-1).log_())
    return probs, lse.float()


def _query_blocks(B, S, K, C, H, block, union):
    """Start and stop of each block of queries: `block` when given, else the union path's or the gather path's."""
    step = block or (max(1, UNION_BLOCK_ROWS // H) if union else sparse_block_size(B, K, C, H))
    return [(a, min(S, a + step)) for a in range(0, S, step)]


def _sparse_mla_torch(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block):
    """(out [B, S, H, value_dim], lse [B, S, H] fp32) over blocks of `block` queries (0: `sparse_block_size`, or
    the union path's); the forward keeps no gathered rows. A block whose queries select few distinct rows (and
    the latent in q's dtype) attends their union in one GEMM per batch row (glm5f/kernels/sparse_union.py), the others gather
    each query's rows."""
    B, S, H, C = q_BxSxHxC.shape
    dt = q_BxSxHxC.dtype
    union = latent_BxTxC.dtype == dt
    out_BxSxHxR = q_BxSxHxC.new_empty(B, S, H, value_dim)
    lse_BxSxH = q_BxSxHxC.new_empty(B, S, H, dtype=torch.float32)
    for a, b in _query_blocks(B, S, idx_BxSxK.shape[-1], C, H, block, union):
        bias = None if bias_BxSxK is None else bias_BxSxK[:, a:b]
        plans = union_plans(latent_BxTxC, idx_BxSxK, allowed_BxSxK, a, b, H) if union else None
        if plans is not None:
            for i, plan in enumerate(plans):
                rows_UxC = latent_BxTxC[i].index_select(0, plan[0])
                scores = union_scores(q_BxSxHxC[i, a:b], rows_UxC, plan, None if bias is None else bias[i],
                                      scale, dt)
                probs, lse_BxSxH[i, a:b] = softmax_lse(scores)
                probs = probs.to(dt)
                torch.mm(probs.view(-1, probs.shape[-1]), rows_UxC[:, :value_dim],
                         out=out_BxSxHxR[i, a:b].view(-1, value_dim))  # a batch row's queries a:b: contiguous
            continue
        sel = gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
        scores = block_scores(q_BxSxHxC[:, a:b], sel, allowed_BxSxK[:, a:b], bias, scale)
        probs, lse_BxSxH[:, a:b] = softmax_lse(scores)
        out_BxSxHxR[:, a:b] = torch.matmul(probs.to(dt), sel[..., :value_dim])
    return out_BxSxHxR, lse_BxSxH


def _sparse_mla_backward_torch(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK,
                               scale, value_dim, block):
    """(dq, dlatent): each block's rows gathered again and its softmax recomputed (identical to the forward's)."""
    B, S, H, C = q_BxSxHxC.shape
    T, dt, R = latent_BxTxC.shape[1], q_BxSxHxC.dtype, value_dim
    union = latent_BxTxC.dtype == dt
    dq_BxSxHxC = torch.empty_like(q_BxSxHxC)
    # each selected row's gradient is summed over the queries that chose it in the latent's dtype (as the
    # unblocked path's index_select backward does): with a wider latent exact, so independent of blocks and of
    # rank layouts (the union path, which sums a block's queries in its GEMM, runs only with the latent in q's dtype)
    dlatent = torch.zeros(B * T, C, dtype=latent_BxTxC.dtype, device=latent_BxTxC.device)
    offsets = T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]
    for a, b in _query_blocks(B, S, idx_BxSxK.shape[-1], C, H, block, union):
        q, dout, allowed = q_BxSxHxC[:, a:b], dout_BxSxHxR[:, a:b].to(dt), allowed_BxSxK[:, a:b]
        bias = None if bias_BxSxK is None else bias_BxSxK[:, a:b]
        plans = union_plans(latent_BxTxC, idx_BxSxK, allowed_BxSxK, a, b, H) if union else None
        if plans is not None:
            for i, plan in enumerate(plans):
                rows_UxC = latent_BxTxC[i].index_select(0, plan[0])
                probs_w = torch.softmax(union_scores(q[i], rows_UxC, plan, None if bias is None else bias[i], scale,
                                                     dt), dim=-1)
                U = rows_UxC.shape[0]
                probs = probs_w.to(dt).view(-1, U)
                dout_i = dout[i].reshape(-1, R)
                dprobs_w = wide(torch.matmul(dout_i, rows_UxC[:, :R].T)).view(probs_w.shape)
                dscores_w = dprobs_w.sub_((probs_w * dprobs_w).sum(-1, keepdim=True)).mul_(probs_w)
                if not bool(plan[1].any(-1).all()):  # a query with no allowed selection: zero where masked
                    dscores_w.masked_fill_(~plan[1][:, None, :], 0)  # (elsewhere its probabilities are 0 there)
                dscores = dscores_w.to(dt).mul_(scale).view(-1, U)
                torch.mm(dscores, rows_UxC, out=dq_BxSxHxC[i, a:b].view(-1, C))
                drows_UxC = torch.matmul(dscores.T, q[i].reshape(-1, C))
                drows_UxC[:, :R] += torch.matmul(probs.T, dout_i)
                dlatent.index_add_(0, plan[0] + i * T, drows_UxC)
            continue
        sel = gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
        probs_w = torch.softmax(block_scores(q, sel, allowed, bias, scale), dim=-1)
        probs = probs_w.to(dt)
        dprobs_w = wide(torch.matmul(dout, sel[..., :R].transpose(-1, -2)))
        dscores_w = probs_w * (dprobs_w - (probs_w * dprobs_w).sum(-1, keepdim=True))
        dscores = dscores_w.masked_fill_(~allowed[:, :, None, :], 0).to(dt).mul_(scale)
        dq_BxSxHxC[:, a:b] = torch.matmul(dscores, sel)
        dsel = torch.matmul(dscores.transpose(-1, -2), q)
        dsel[..., :R] += torch.matmul(probs.transpose(-1, -2), dout)
        dlatent.index_add_(0, (idx_BxSxK[:, a:b] + offsets).flatten(), dsel.reshape(-1, C).to(latent_BxTxC.dtype))
    return dq_BxSxHxC, dlatent.view(B, T, C)


def sparse_attention_unblocked(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                               allowed_BxSxK: torch.Tensor, scale: float, value_dim: int,
                               bias_BxSxK: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of `sparse_mla`: every query's rows gathered at once ([B, S, K, C]), plain autograd."""
    sel_BxSxKxC = gather_rows(latent_BxTxC, idx_BxSxK, q_BxSxHxC.dtype)
    scores_BxSxHxK = block_scores(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale)
    probs_BxSxHxK = torch.softmax(scores_BxSxHxK, dim=-1).to(q_BxSxHxC.dtype)
    return torch.einsum("bshk,bskr->bshr", probs_BxSxHxK, sel_BxSxKxC[..., :value_dim])


# ---- glm5f::sparse_mla --------------------------------------------------------------------------------------------

def _check_sparse_mla(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim):
    if q_BxSxHxC.ndim != 4 or latent_BxTxC.ndim != 3 or idx_BxSxK.ndim != 3:
        raise ValueError(f"sparse_mla expects q [B, S, H, C], latent [B, T, C], idx [B, S, K]; got "
                         f"{tuple(q_BxSxHxC.shape)}, {tuple(latent_BxTxC.shape)}, {tuple(idx_BxSxK.shape)}")
    B, S, H, C = q_BxSxHxC.shape
    if latent_BxTxC.shape[0] != B or latent_BxTxC.shape[2] != C or tuple(idx_BxSxK.shape[:2]) != (B, S):
        raise ValueError(f"sparse_mla: q is [B={B}, S={S}, H={H}, C={C}], so latent must be [{B}, T, {C}] and idx "
                         f"[{B}, {S}, K]; got latent {tuple(latent_BxTxC.shape)}, idx {tuple(idx_BxSxK.shape)}")
    if idx_BxSxK.dtype != torch.int64 or allowed_BxSxK.dtype != torch.bool:
        raise ValueError(f"sparse_mla expects int64 idx and bool allowed, got {idx_BxSxK.dtype} and "
                         f"{allowed_BxSxK.dtype} (cast them with .long() and .bool())")
    if allowed_BxSxK.shape != idx_BxSxK.shape or (bias_BxSxK is not None and bias_BxSxK.shape != idx_BxSxK.shape):
        raise ValueError(f"sparse_mla: allowed and bias must have idx's shape {tuple(idx_BxSxK.shape)}, got "
                         f"{tuple(allowed_BxSxK.shape)} and {None if bias_BxSxK is None else tuple(bias_BxSxK.shape)}")
    if not 0 < value_dim <= C:
        raise ValueError(f"sparse_mla: value_dim (the value channels leading each latent row) must be in 1..{C}, "
                         f"got {value_dim}")
    if torch.promote_types(latent_BxTxC.dtype, q_BxSxHxC.dtype) != latent_BxTxC.dtype:
        raise ValueError(f"sparse_mla computes in q's dtype {q_BxSxHxC.dtype} and sums row gradients in the "
                         f"latent's, which must be as wide; got latent {latent_BxTxC.dtype} (cast it up)")


@torch.library.custom_op("glm5f::sparse_mla", mutates_args=())
def sparse_mla(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
               allowed_BxSxK: torch.Tensor, bias_BxSxK: torch.Tensor | None, scale: float,
               value_dim: int, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over its K selected latent rows -> (out [B, S, H, value_dim], lse [B, S, H] fp32).

    Scores are q . row * scale (+ bias), finfo.min where not allowed, with an fp32 (or wider) softmax over the K
    selections: a query with no allowed selection averages its K rows (its lse is finfo.min). Values are the first
    value_dim channels of the rows, gathered in q's dtype (the compute dtype); the latent may be wider. lse is not
    differentiable (the backward ignores its gradient). The CPU runs blocks of `block` queries (0: as many as
    SPARSE_BLOCK_ELEMS allows), so memory is linear in S.
    """
    _check_sparse_mla(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim)
    return _sparse_mla_torch(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block)


@sparse_mla.register_kernel("cuda")
def sparse_mla_cuda(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block=0):
    _check_sparse_mla(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim)
    if _use_triton(q_BxSxHxC):  # any latent dtype: rows are cast to q's
        return triton_kernels().sparse_mla_forward(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK,
                                                   scale, value_dim)
    return _sparse_mla_torch(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block)


@sparse_mla.register_fake
def _(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block=0):
    _check_sparse_mla(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim)
    B, S, H, _ = q_BxSxHxC.shape
    return q_BxSxHxC.new_empty(B, S, H, value_dim), q_BxSxHxC.new_empty(B, S, H, dtype=torch.float32)


@torch.library.custom_op("glm5f::sparse_mla_backward", mutates_args=())
def sparse_mla_backward(dout_BxSxHxR: torch.Tensor, q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor,
                        idx_BxSxK: torch.Tensor, allowed_BxSxK: torch.Tensor, bias_BxSxK: torch.Tensor | None,
                        out_BxSxHxR: torch.Tensor, lse_BxSxH: torch.Tensor, scale: float,
                        value_dim: int, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [B, S, H, C], dlatent [B, T, C]) of `sparse_mla`; dlatent sums each row's gradient over the queries
    that chose it, in the latent's dtype. The CPU recomputes the softmax (out and lse serve the CUDA kernels)."""
    return _sparse_mla_backward_torch(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK,
                                      scale, value_dim, block)


@sparse_mla_backward.register_kernel("cuda")
def sparse_mla_backward_cuda(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK,
                             out_BxSxHxR, lse_BxSxH, scale, value_dim, block=0):
    if _use_triton(q_BxSxHxC):  # any latent dtype: rows are cast to q's
        return triton_kernels().sparse_mla_backward(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK,
                                                    allowed_BxSxK, bias_BxSxK, out_BxSxHxR, lse_BxSxH, scale)
    return _sparse_mla_backward_torch(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK,
                                      scale, value_dim, block)


@sparse_mla_backward.register_fake
def _(dout_BxSxHxR, q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, out_BxSxHxR, lse_BxSxH, scale,
      value_dim, block=0):
    return torch.empty_like(q_BxSxHxC), torch.empty_like(latent_BxTxC)


def _sparse_mla_setup_context(ctx, inputs, output):
    q, latent, idx, allowed, bias, scale, value_dim, block = inputs
    out, lse = output
    ctx.save_for_backward(q, latent, idx, allowed, bias, out, lse)
    ctx.scale, ctx.value_dim, ctx.block = scale, value_dim, block
    ctx.mark_non_differentiable(lse)


def _sparse_mla_autograd(ctx, dout_BxSxHxR, _dlse):
    q, latent, idx, allowed, bias, out, lse = ctx.saved_tensors
    dq, dlatent = sparse_mla_backward(dout_BxSxHxR, q, latent, idx, allowed, bias, out, lse, ctx.scale,
                                      ctx.value_dim, ctx.block)
    return dq, dlatent, None, None, None, None, None, None


sparse_mla.register_autograd(_sparse_mla_autograd, setup_context=_sparse_mla_setup_context)


def sparse_attention(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                     allowed_BxSxK: torch.Tensor, scale: float, value_dim: int,
                     bias_BxSxK: torch.Tensor | None = None, block: int = 0) -> torch.Tensor:
    """`sparse_mla`'s output [B, S, H, value_dim]. Under torch.func transforms (grad, vmap, jacrev) the same math
    runs unblocked through plain autograd ops (`sparse_attention_unblocked`), which functorch handles itself."""
    if torch._C._are_functorch_transforms_active():
        return sparse_attention_unblocked(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, scale, value_dim,
                                          bias_BxSxK)
    return sparse_mla(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale, value_dim, block)[0]


# ---- glm5f::topk_attention: the CPU's dense form of the same attention -------------------------------------------

DENSE_BLOCK_ELEMS = 1 << 22  # bound on one query block's [B, H, s, t] scores in `topk_attention`
DENSE_BLOCK_QUERIES = 128  # and its most queries (a block attends keys up to its last selection: causal blocks)


def topk_fill(idx_BxsxK: torch.Tensor, allowed_BxsxK: torch.Tensor, bias_BxsxK: torch.Tensor | None, t: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fill [B, s, t] to add to a block's scores over keys 0..t-1, the queries with no allowed selection [B, s]):
    log of how many times a query selected the key allowed (0 once, -inf never: so the softmax over keys equals
    the sparse one over its K selections, a row selected twice counted twice), plus the bias where selected. A
    query with no allowed selection averages its K rows: its fill is the log of how many times it selected the
    key, and its scores are that fill alone (`_dense_block_probs`)."""
    counts = torch.zeros(*idx_BxsxK.shape[:2], t, dtype=dtype, device=idx_BxsxK.device)
    none_Bxs = ~allowed_BxsxK.any(-1)
    weight = torch.where(none_Bxs[..., None], 1.0, allowed_BxsxK.to(dtype))
    counts.scatter_add_(2, idx_BxsxK, weight)
    fill = torch.zeros_like(counts).masked_fill_(counts == 0, float("-inf"))  # the log of 0 and 1, without log's cost
    if bool((counts > 1).any()):
        fill = torch.where(counts > 1, counts.log(), fill)
    if bias_BxsxK is not None:
        bias = bias_BxsxK.to(dtype).masked_fill(none_Bxs[..., None], 0)
        fill += torch.zeros_like(fill).scatter_(2, idx_BxsxK, bias)
    return fill, none_Bxs


def _dense_blocks(B, S, H, T):
    step = max(1, min(DENSE_BLOCK_QUERIES, DENSE_BLOCK_ELEMS // max(1, B * H * T)))
    return [(a, min(S, a + step)) for a in range(0, S, step)]


def _dense_block_probs(qs_BxHxsxD, k_BxHxTxD, idx_Bxsxk, allowed, bias):
    """A block's probabilities [B, H, s, t] (wide) from its queries times the scale, t keys (those up to its last
    selection), and its queries with no allowed selection."""
    t = int(idx_Bxsxk.max()) + 1
    scores = torch.matmul(qs_BxHxsxD, k_BxHxTxD[:, :, :t].transpose(-1, -2))
    fill, none_Bxs = topk_fill(idx_Bxsxk, allowed, bias, t, wide_dtype(scores.dtype))
    scores = wide(scores).add_(fill[:, None])
    if bool(none_Bxs.any()):
        scores = torch.where(none_Bxs[:, None, :, None], fill[:, None], scores)
    return torch.softmax(scores, dim=-1), t, none_Bxs


def _topk_attention_torch(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale):
    B, S, H, _ = q_BxSxHxD.shape
    dt = q_BxSxHxD.dtype
    v_BxHxTxV = v_BxHxTxV.contiguous()  # (a strided view would be copied by each block's GEMMs)
    qs_BxSxHxD = q_BxSxHxD * scale  # (the scale on the queries, not on each block's scores)
    out_BxSxHxV = q_BxSxHxD.new_empty(B, S, H, v_BxHxTxV.shape[-1])
    for a, b in _dense_blocks(B, S, H, k_BxHxTxD.shape[2]):
        bias = None if bias_BxSxK is None else bias_BxSxK[:, a:b]
        probs, t, _ = _dense_block_probs(qs_BxSxHxD[:, a:b].transpose(1, 2), k_BxHxTxD, idx_BxSxK[:, a:b],
                                         allowed_BxSxK[:, a:b], bias)
        out_BxSxHxV[:, a:b] = torch.matmul(probs.to(dt), v_BxHxTxV[:, :, :t]).transpose(1, 2)
    return out_BxSxHxV


def _check_topk_attention(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK):
    B, S, H, D = q_BxSxHxD.shape
    if (k_BxHxTxD.shape[:2] != (B, H) or k_BxHxTxD.shape[3] != D or v_BxHxTxV.shape[:3] != k_BxHxTxD.shape[:3]
            or tuple(idx_BxSxK.shape[:2]) != (B, S) or allowed_BxSxK.shape != idx_BxSxK.shape):
        raise ValueError(f"topk_attention expects q [B, S, H, D], k [B, H, T, D], v [B, H, T, V], idx and allowed "
                         f"[B, S, K]; got {tuple(q_BxSxHxD.shape)}, {tuple(k_BxHxTxD.shape)}, "
                         f"{tuple(v_BxHxTxV.shape)}, {tuple(idx_BxSxK.shape)}, {tuple(allowed_BxSxK.shape)}")


@torch.library.custom_op("glm5f::topk_attention", mutates_args=())
def topk_attention(q_BxSxHxD: torch.Tensor, k_BxHxTxD: torch.Tensor, v_BxHxTxV: torch.Tensor,
                   idx_BxSxK: torch.Tensor, allowed_BxSxK: torch.Tensor, bias_BxSxK: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """`sparse_mla`'s attention with per-head keys and values (kv_b applied to every key) -> out [B, S, H, V]:
    each block of queries scores every key up to its last selection, and `topk_fill` leaves each query the
    softmax over its K selections. Costs S x t per head instead of S x K, but in head widths (nope + rope, v)
    rather than the latent's (C, R); `attention.dense_topk_pays` says when that is less. Memory is linear in S."""
    _check_topk_attention(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK)
    return _topk_attention_torch(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale)


@topk_attention.register_fake
def _(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK, bias_BxSxK, scale):
    _check_topk_attention(q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK)
    return q_BxSxHxD.new_empty(*q_BxSxHxD.shape[:3], v_BxHxTxV.shape[-1])


@torch.library.custom_op("glm5f::topk_attention_backward", mutates_args=())
def topk_attention_backward(dout_BxSxHxV: torch.Tensor, q_BxSxHxD: torch.Tensor, k_BxHxTxD: torch.Tensor,
                            v_BxHxTxV: torch.Tensor, idx_BxSxK: torch.Tensor, allowed_BxSxK: torch.Tensor,
                            bias_BxSxK: torch.Tensor | None, out_BxSxHxV: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `topk_attention`, each block's probabilities recomputed, each query's sum of probability
    times its probability's gradient taken as dout . out (over V channels instead of t keys); a query with no
    allowed selection passes no gradient to its scores (as `sparse_mla_backward`)."""
    B, S, H, _ = q_BxSxHxD.shape
    dt = q_BxSxHxD.dtype
    v_BxHxTxV = v_BxHxTxV.contiguous()
    qs_BxSxHxD = q_BxSxHxD * scale
    dq = q_BxSxHxD.new_empty(q_BxSxHxD.shape)  # contiguous whatever the inputs' strides, as the fake kernel says
    dk, dv = k_BxHxTxD.new_zeros(k_BxHxTxD.shape), v_BxHxTxV.new_zeros(v_BxHxTxV.shape)
    rowsum_BxHxS = wide(dout_BxSxHxV.to(dt)).mul(wide(out_BxSxHxV)).sum(-1).transpose(1, 2)
    for a, b in _dense_blocks(B, S, H, k_BxHxTxD.shape[2]):
        qs = qs_BxSxHxD[:, a:b].transpose(1, 2)
        dout = dout_BxSxHxV[:, a:b].transpose(1, 2).to(dt)
        bias = None if bias_BxSxK is None else bias_BxSxK[:, a:b]
        probs_w, t, none_Bxs = _dense_block_probs(qs, k_BxHxTxD, idx_BxSxK[:, a:b], allowed_BxSxK[:, a:b], bias)
        probs = probs_w.to(dt)
        dv[:, :, :t] += torch.matmul(probs.transpose(-1, -2), dout)
        dprobs_w = wide(torch.matmul(dout, v_BxHxTxV[:, :, :t].transpose(-1, -2)))
        dscores_w = dprobs_w.sub_(rowsum_BxHxS[:, :, a:b, None]).mul_(probs_w)
        if bool(none_Bxs.any()):
            dscores_w.masked_fill_(none_Bxs[:, None, :, None], 0)
        dscores = dscores_w.to(dt)
        dq[:, a:b] = torch.matmul(dscores, k_BxHxTxD[:, :, :t]).mul_(scale).transpose(1, 2)
        dk[:, :, :t] += torch.matmul(dscores.transpose(-1, -2), qs)
    return dq, dk, dv


@topk_attention_backward.register_fake
def _(dout_BxSxHxV, q_BxSxHxD, k_BxHxTxD, v_BxHxTxV, idx_BxSxK, allowed_BxSxK, bias_BxSxK, out_BxSxHxV, scale):
    return tuple(t.new_empty(t.shape) for t in (q_BxSxHxD, k_BxHxTxD, v_BxHxTxV))


def _topk_attention_setup_context(ctx, inputs, output):
    q, k, v, idx, allowed, bias, scale = inputs
    ctx.save_for_backward(q, k, v, idx, allowed, bias, output)
    ctx.scale = scale


def _topk_attention_autograd(ctx, dout_BxSxHxV):
    q, k, v, idx, allowed, bias, out = ctx.saved_tensors
    return (*topk_attention_backward(dout_BxSxHxV, q, k, v, idx, allowed, bias, out, ctx.scale),
            None, None, None, None)


topk_attention.register_autograd(_topk_attention_autograd, setup_context=_topk_attention_setup_context)


# ---- glm5f::indexer_topk ------------------------------------------------------------------------------------------

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


def allowed_rows(q_index_S, key_valid_BxT, q_segment_BxS, k_segment_BxT, dense_BxSxT, start, stop, num_keys,
                 key_reach_BxT=None):
    """allowed [B or 1, stop - start, num_keys] for queries start:stop (what `Mask.rows` builds from its parts):
    the dense mask as given, else causal order, key padding, same document and, in a tree batch, query index <=
    the key's reach (the last query index that sees it)."""
    if dense_BxSxT is not None:
        return dense_BxSxT[:, start:stop, :num_keys]
    k_index = torch.arange(num_keys, device=q_index_S.device)
    allowed = (k_index[None, :] <= q_index_S[start:stop, None])[None]
    if key_valid_BxT is not None:
        allowed = allowed & key_valid_BxT[:, None, :num_keys]
    if q_segment_BxS is not None:
        allowed = allowed & (q_segment_BxS[:, start:stop, None] == k_segment_BxT[:, None, :num_keys])
    if key_reach_BxT is not None:
        allowed = allowed & (q_index_S[start:stop, None] <= key_reach_BxT[:, None, :num_keys])
    return allowed


def _indexer_scores_torch(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, start, stop, num_keys):
    """Index scores [B, stop - start, num_keys], unmasked: one GEMM for all heads, then ReLU, scale and the
    head-weighted sum in place (the order of attention.indexer_scores)."""
    B, _, I, J = q_BxSxIxJ.shape
    n = stop - start
    scores_BxSIxT = torch.bmm(wide(q_BxSxIxJ[:, start:stop]).reshape(B, n * I, J),
                              wide(keys_BxTxJ[:, :num_keys]).transpose(1, 2))
    scores_BSxIxT = scores_BxSIxT.mul_(J ** -0.5).relu_().view(B * n, I, -1)
    w_BSx1xI = w_BxSxI[:, start:stop].reshape(B * n, 1, I).to(scores_BSxIxT.dtype)
    return torch.bmm(w_BSx1xI, scores_BSxIxT).view(B, n, -1)


def _check_indexer(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, k):
    if q_BxSxIxJ.ndim != 4 or w_BxSxI.shape != q_BxSxIxJ.shape[:3] or keys_BxTxJ.ndim != 3:
        raise ValueError(f"indexer_topk expects q [B, S, I, J], w [B, S, I], keys [B, T, J]; got "
                         f"{tuple(q_BxSxIxJ.shape)}, {tuple(w_BxSxI.shape)}, {tuple(keys_BxTxJ.shape)}")
    B, S, _, J = q_BxSxIxJ.shape
    if keys_BxTxJ.shape[0] != B or keys_BxTxJ.shape[2] != J or q_index_S.shape != (S,):
        raise ValueError(f"indexer_topk: q is [B={B}, S={S}, I, J={J}], so keys must be [{B}, T, {J}] and q_index "
                         f"[{S}]; got {tuple(keys_BxTxJ.shape)} and {tuple(q_index_S.shape)}")
    if wide_dtype(q_BxSxIxJ.dtype) != wide_dtype(keys_BxTxJ.dtype):
        raise ValueError(f"indexer_topk scores in fp32 (fp64 for fp64 inputs): q is {q_BxSxIxJ.dtype} and keys "
                         f"{keys_BxTxJ.dtype}; cast both to one precision")
    if not 0 < k <= keys_BxTxJ.shape[1]:
        raise ValueError(f"indexer_topk: k must be in 1..T={keys_BxTxJ.shape[1]}, got {k} (pass min(topk, T))")


def _indexer_topk_torch(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT, q_segment_BxS, k_segment_BxT,
                        dense_BxSxT, bias_BxSxT, k, chunk_elems=INDEXER_CPU_CHUNK_ELEMS, key_reach_BxT=None):
    B, S, I, _ = q_BxSxIxJ.shape
    T = keys_BxTxJ.shape[1]
    chunk = max(1, chunk_elems // max(1, B * I * T))
    if dense_BxSxT is None:  # at least INDEXER_CAUSAL_CHUNKS chunks, each scoring only the keys its queries see
        chunk = min(chunk, -(-S // INDEXER_CAUSAL_CHUNKS))
    idx_BxSxK = torch.empty(B, S, k, dtype=torch.long, device=q_BxSxIxJ.device)
    # the last chunk first: causal chunks see more keys the later they are, so each chunk's buffers fit in the
    # memory the one before freed (in ascending order every chunk needs more, and the host heap only grows)
    for start in reversed(range(0, S, chunk)):
        stop = min(S, start + chunk)
        # keys past the chunk's last query are masked for all of it: they are not scored (half the causal work);
        # at least k keys are kept, so the picks past a query's visible keys are the same masked ones as over all T
        visible = T if dense_BxSxT is not None else min(T, int(q_index_S[start:stop].max()) + 1)
        num_keys = max(k, visible)
        scores = _indexer_scores_torch(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, start, stop, num_keys)
        if bias_BxSxT is not None:
            scores = scores + bias_BxSxT[:, start:stop, :num_keys]
        allowed = allowed_rows(q_index_S, key_valid_BxT, q_segment_BxS, k_segment_BxT, dense_BxSxT, start, stop,
                               num_keys, key_reach_BxT)
        idx_BxSxK[:, start:stop] = topk_first(scores.masked_fill_(~allowed, float("-inf")), k)
    return idx_BxSxK


@torch.library.custom_op("glm5f::indexer_topk", mutates_args=())
def indexer_topk(q_BxSxIxJ: torch.Tensor, w_BxSxI: torch.Tensor, keys_BxTxJ: torch.Tensor, q_index_S: torch.Tensor,
                 key_valid_BxT: torch.Tensor | None, q_segment_BxS: torch.Tensor | None,
                 k_segment_BxT: torch.Tensor | None, dense_BxSxT: torch.Tensor | None,
                 bias_BxSxT: torch.Tensor | None, k: int, key_reach_BxT: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k key indices [B, S, k] (int64) of the index scores sum_i w_i relu(q_i . key / sqrt(J)) (fp32, fp64 for
    fp64 inputs), plus bias, -inf where the mask forbids; equal scores go to the lower index (`topk_first`).

    q (roped) and w (scaled by I^-0.5) come projected. The mask: dense [B or 1, S, T] bool used as given, else
    key index <= q_index, key_valid [B or 1, T], q_segment == k_segment (same document) and q_index <=
    key_reach [B or 1, T] (a tree batch: `glm5f.model.tree`). A query with fewer than k allowed keys gets masked
    picks for the rest (its allowed mask at those indices is False).
    """
    _check_indexer(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, k)
    return _indexer_topk_torch(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT, q_segment_BxS,
                               k_segment_BxT, dense_BxSxT, bias_BxSxT, k, key_reach_BxT=key_reach_BxT)


@indexer_topk.register_kernel("cuda")
def indexer_topk_cuda(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT, q_segment_BxS, k_segment_BxT,
                      dense_BxSxT, bias_BxSxT, k, key_reach_BxT=None, chunk_elems=INDEXER_QUERY_CHUNK_ELEMS):
    _check_indexer(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, k)
    if not _use_triton(q_BxSxIxJ, w_BxSxI, keys_BxTxJ):
        return _indexer_topk_torch(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT, q_segment_BxS,
                                   k_segment_BxT, dense_BxSxT, bias_BxSxT, k, chunk_elems, key_reach_BxT)
    if key_reach_BxT is not None:
        raise ValueError("indexer_topk: the Triton index-score kernel takes no tree mask (key_reach); run tree "
                         "batches with the torch path (--data.share_prefixes false, or a CPU/fp64 run)")
    B, S = q_BxSxIxJ.shape[:2]
    T = keys_BxTxJ.shape[1]
    chunk = max(1, chunk_elems // max(1, B * T))  # the fused kernel keeps no per-head scores
    idx_BxSxK = torch.empty(B, S, k, dtype=torch.long, device=q_BxSxIxJ.device)
    for start in range(0, S, chunk):  # all T keys scored (no host sync on q_index); masked ones are -inf
        stop = min(S, start + chunk)
        scores = triton_kernels().indexer_scores(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT,
                                                 q_segment_BxS, k_segment_BxT, dense_BxSxT, bias_BxSxT, start, stop)
        idx_BxSxK[:, start:stop] = topk_first(scores, k)
    return idx_BxSxK


@indexer_topk.register_fake
def _(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, key_valid_BxT, q_segment_BxS, k_segment_BxT, dense_BxSxT,
      bias_BxSxT, k, key_reach_BxT=None):
    _check_indexer(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, q_index_S, k)
    B, S = q_BxSxIxJ.shape[:2]
    return q_BxSxIxJ.new_empty(B, S, k, dtype=torch.long)

"""The MLA core over latent rows: each query attends, with every head, to its selected latent rows (sparse, the
hot path of DSA) or to every allowed key (dense). One call, `sparse_attention`, that a kernel can replace.

Shape suffixes as in attention.py: B batch, S queries, T keys, H heads, K selected keys, C = R + P latent width.
"""

from __future__ import annotations

import torch

from glm5f.ops import wide, wide_dtype


SPARSE_BLOCK_ELEMS = 1 << 23  # bound on one query block's gathered rows plus scores, [B, s, K, C + 2H] elements


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


def block_probs(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale):
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
            sel = gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
            probs = block_probs(q_BxSxHxC[:, a:b], sel, allowed_BxSxK[:, a:b],
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
            sel = gather_rows(latent_BxTxC, idx_BxSxK[:, a:b], dt)
            probs_w = block_probs(q, sel, allowed, None if bias_BxSxK is None else bias_BxSxK[:, a:b], scale)
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
    sel_BxSxKxC = gather_rows(latent_BxTxC, idx_BxSxK, q_BxSxHxC.dtype)
    probs_BxSxHxK = block_probs(q_BxSxHxC, sel_BxSxKxC, allowed_BxSxK, bias_BxSxK, scale).to(q_BxSxHxC.dtype)
    return torch.einsum("bshk,bskr->bshr", probs_BxSxHxK, sel_BxSxKxC[..., :value_dim])


def topk_as_mask(idx_BxSxK: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool [B, S, T], True at the selected keys."""
    sel = torch.zeros(*idx_BxSxK.shape[:2], num_keys, dtype=torch.bool, device=idx_BxSxK.device)
    return sel.scatter(-1, idx_BxSxK, True)

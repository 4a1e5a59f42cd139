"""The model's head as losses: next-token targets (`shift_labels`, MTP's `mtp_inputs` / `mtp_targets`), token
cross-entropies, and the chunked head (`head_token_losses`: hidden states -> per-token losses, the [tokens, vocab]
logits never held whole). Decoding, log-probabilities and every objective read the head through these.

Shape suffixes: B batch, S sequence, V vocabulary, N tokens, D model width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5f.core import IGNORE_INDEX
from glm5f.core.ops import rms_norm, wide, wide_dtype
from glm5f.model.decoder import head_logits
from glm5f.model.env import packed_segments


# ---- next-token targets and the chunked head --------------------------------------------------------------------------------------------------

def shift_labels(labels_BxS: torch.Tensor) -> torch.Tensor:
    """targets [B, S]: the label of the next token at each position; the last position gets IGNORE_INDEX."""
    return F.pad(labels_BxS[:, 1:], (0, 1), value=IGNORE_INDEX)


def cross_entropy_sum(logits_BxSxV: torch.Tensor, targets_BxS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 token cross-entropies, number of targets != IGNORE_INDEX), for token-weighted means.

    The sum is taken in fp64, so a loss summed over ranks or micro-batches does not depend on how the tokens were
    split (the gradient is the same as of an fp32 sum).
    """
    loss_N = token_losses(logits_BxSxV.flatten(0, 1), targets_BxS.flatten())
    return loss_N.sum(dtype=torch.float64), (targets_BxS != IGNORE_INDEX).sum()


def token_losses(logits_NxV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [N] of each token in fp32 (fp64 for fp64 logits), 0 where the target is IGNORE_INDEX."""
    return F.cross_entropy(wide(logits_NxV), targets_N, ignore_index=IGNORE_INDEX, reduction="none")


# Logits per chunk of the LM head and its cross-entropy (`head_loss_sum`): 2^25, 216 tokens of GLM-5's 154,880-word
# vocabulary. A chunk's logits, their fp32 copy, log-probabilities and gradients then take the same memory (bf16
# activations: docs/memory.md), whatever the tokens per rank; a GEMM of 216 rows still keeps an accelerator busy.
HEAD_CHUNK_ELEMS = 2**25


def head_chunk_rows(vocab_size: int, chunk_elems: int | None = None) -> int:
    """Tokens per chunk of `head_loss_sum` for a vocabulary of vocab_size (chunk_elems logits, default
    HEAD_CHUNK_ELEMS)."""
    return max(1, (HEAD_CHUNK_ELEMS if chunk_elems is None else chunk_elems) // vocab_size)


def head_loss_sum(head: dict, x_BxSxD: torch.Tensor, targets_BxS: torch.Tensor, eps: float,
                  chunk_elems: int | None = None) -> torch.Tensor:
    """`cross_entropy_sum` (its fp64 sum) of the logits of hidden states x [B, S, D] through `head` (the final norm
    and LM head, `model.main_head`; an MTP depth's): the sum of `head_token_losses`."""
    return head_token_losses(head, x_BxSxD, targets_BxS, eps, chunk_elems).sum(dtype=torch.float64)


def head_token_losses(head: dict, x_BxSxD: torch.Tensor, targets_BxS: torch.Tensor, eps: float,
                      chunk_elems: int | None = None) -> torch.Tensor:
    """Cross-entropy [B * S] of each token (`token_losses`: fp32, 0 where the target is IGNORE_INDEX; minus the
    target's log-probability) of the logits of hidden states x [B, S, D] through `head`, computed over chunks of
    tokens (`HeadLosses`) so that the [tokens, vocab] logits are never held whole. Each token's loss is the one
    `model.head_logits` then `token_losses` give."""
    rows = head_chunk_rows(head["weight"].shape[0], chunk_elems)
    return HeadLosses.apply(x_BxSxD.flatten(0, 1), head["norm"], head["weight"], targets_BxS.flatten(), eps, rows)


class HeadLosses(torch.autograd.Function):
    """Token cross-entropies [N] of hidden states x [N, D] through a norm [D] and an LM head [V, D]
    (`model.head_logits`, then `token_losses`), `rows` tokens at a time. The forward keeps x (and no logits); the
    backward recomputes each chunk's logits, takes their gradient through the cross-entropy by autograd, and makes
    the head's gradient with one in-place GEMM per chunk into a single [V, D] buffer, x's and the norm's by
    autograd through the norm: the same operations as autograd through the whole logits, one chunk at a time."""

    @staticmethod
    def forward(ctx, x_NxD, norm_D, head_VxD, targets_N, eps, rows):
        ctx.save_for_backward(x_NxD, norm_D, head_VxD, targets_N)
        ctx.eps, ctx.rows = eps, rows
        head = {"norm": norm_D, "weight": head_VxD}
        return torch.cat([token_losses(head_logits(head, x_NxD[i:i + rows], eps), targets_N[i:i + rows])
                          for i in range(0, max(len(x_NxD), 1), rows)])

    @staticmethod
    def backward(ctx, grad_N):
        x_NxD, norm_D, head_VxD, targets_N = ctx.saved_tensors
        need_x, need_norm, need_head = ctx.needs_input_grad[:3]
        rows, eps = ctx.rows, ctx.eps
        dt = torch.promote_types(x_NxD.dtype, head_VxD.dtype)  # the dtype `linear` computes in
        w_VxD = head_VxD.detach().to(dt)
        norm = norm_D.detach().requires_grad_(need_norm)
        grad_x = torch.empty_like(x_NxD) if need_x else None
        grad_norm = grad_head = None
        for i in range(0, len(x_NxD), rows):
            with torch.enable_grad():
                x_RxD = x_NxD[i:i + rows].detach().requires_grad_(need_x)
                xn_RxD = rms_norm(norm, x_RxD, eps).to(dt)
                logits_RxV = F.linear(xn_RxD.detach(), w_VxD).requires_grad_()
                loss_R = token_losses(logits_RxV.to(x_NxD.dtype), targets_N[i:i + rows])
                (dlogits_RxV,) = torch.autograd.grad(loss_R, logits_RxV, grad_N[i:i + rows])
            del logits_RxV, loss_R
            if need_head:
                xn = xn_RxD.detach()
                grad_head = dlogits_RxV.T @ xn if grad_head is None else grad_head.addmm_(dlogits_RxV.T, xn)
            if need_x or need_norm:
                inputs = [t for t in (x_RxD, norm) if t.requires_grad]
                grads = list(torch.autograd.grad(xn_RxD, inputs, dlogits_RxV @ w_VxD))
                if need_x:
                    grad_x[i:i + rows] = grads.pop(0)
                if need_norm:
                    grad_norm = grads[0] if grad_norm is None else grad_norm + grads[0]
        if need_head and grad_head is None:  # no tokens
            grad_head = torch.zeros_like(head_VxD)
        if need_norm and grad_norm is None:
            grad_norm = torch.zeros_like(norm_D)
        return (grad_x, grad_norm, None if grad_head is None else grad_head.to(head_VxD.dtype), None, None, None)


def causal_lm_loss(logits_BxSxV: torch.Tensor, labels_BxS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: labels shifted by one, IGNORE_INDEX (-100) skipped (0 if none is left)."""
    if labels_BxS.shape != logits_BxSxV.shape[:2]:
        raise ValueError(f"labels must be [batch, seq] = {list(logits_BxSxV.shape[:2])}, got {list(labels_BxS.shape)}")
    total, count = cross_entropy_sum(logits_BxSxV, shift_labels(labels_BxS))
    return (total / count.clamp(min=1)).to(wide_dtype(logits_BxSxV.dtype))


def mtp_inputs(input_ids_BxS: torch.Tensor, depth: int) -> torch.Tensor:
    """Input ids [B, S] of MTP depth `depth` (>= 1): t_{i+depth} at position i, 0 past the end (ignored there)."""
    return F.pad(input_ids_BxS[:, depth:], (0, depth), value=0)


def mtp_targets(labels_BxS: torch.Tensor, depth: int, position_ids_BxS: torch.Tensor | None = None,
                valid_BxS: torch.Tensor | None = None) -> torch.Tensor:
    """Targets [B, S] of MTP depth `depth` (>= 1): the label of t_{i+depth+1} at position i, IGNORE_INDEX where
    that is past the end, in another packed document than i (`env.packed_segments`), or where i, i+depth or
    i+depth+1 is padding (valid_BxS 0). Taken on whole sequences, as shift_labels."""
    B, S = labels_BxS.shape
    k = depth + 1
    out = torch.full_like(labels_BxS, IGNORE_INDEX)
    if k >= S:
        return out
    keep = torch.ones(B, S - k, dtype=torch.bool, device=labels_BxS.device)
    seg = None if position_ids_BxS is None else packed_segments(position_ids_BxS.expand(B, S))
    if seg is not None:
        keep &= seg[:, k:] == seg[:, :-k]
    if valid_BxS is not None:
        v = valid_BxS.bool()
        keep &= v[:, :-k] & v[:, depth:S - 1] & v[:, k:]
    out[:, :-k] = torch.where(keep, labels_BxS[:, k:], IGNORE_INDEX)
    return out

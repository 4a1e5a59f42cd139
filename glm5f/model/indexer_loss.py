"""The DSA lightning indexer's training objective: the KL from the main attention's head-summed probabilities
(detached) to the softmax of the index scores, over a layer group's queries, with a memory-bounded gradient; for
GLM-5.3's pooled indexer, from the attention's mass per pool to the softmax of the pool scores (`Pooling`).

Shape suffixes as in attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from glm5f.core.config import GLM5Config
from glm5f.kernels.dsa import block_scores, gather_rows, topk_as_mask
from glm5f.core.ops import wide

if TYPE_CHECKING:
    from glm5f.model.env import Env, Mask

INDEXER_LOSS_BLOCK_ELEMS = 1 << 23  # bound on one query block's scores of both attentions, [B, s, keys, ~2H + 3I]


@dataclass(frozen=True)
class Pooling:
    """GLM-5.3's pooled indexer as its loss sees it (`glm5f.model.kpool`): the student's keys are pool keys laid out at
    each complete pool's last token; `candidates` the mask of the pool ends each query may score; the selection
    (`kl`'s topk [B, S, W]) holds the `pools` chosen pools' `kpool` tokens each in order, then the query's own
    pool's tail; `allowed` [B, S, W] which of its slots count."""

    kpool: int
    pools: int
    candidates: Mask
    allowed: torch.Tensor

    def ends(self, x_BxSxW: torch.Tensor) -> torch.Tensor:
        """The selection's entries at each chosen pool's last token [B, S, pools]."""
        return x_BxSxW[..., self.kpool - 1:self.pools * self.kpool:self.kpool]

    def per_pool(self, target_BxSxW: torch.Tensor) -> torch.Tensor:
        """A distribution over the selection's token slots summed per chosen pool [B, S, pools]."""
        return target_BxSxW[..., :self.pools * self.kpool].unflatten(-1, (self.pools, self.kpool)).sum(-1)

    def at_ends(self, target_BxSxT: torch.Tensor) -> torch.Tensor:
        """A distribution over keys 0..T-1 summed over each window of kpool keys ending at each key [B, S, T]
        (a complete pool's mass at its last token)."""
        return sum(F.pad(target_BxSxT, (j, 0))[..., :target_BxSxT.shape[-1]] for j in range(self.kpool))


def kl(q_BxSxIxJ: torch.Tensor, w_BxSxI: torch.Tensor, keys_BxTxJ: torch.Tensor, targets: tuple,
       topk_BxSxK: torch.Tensor | None, cfg: GLM5Config, env: Env,
       block_elems: int = INDEXER_LOSS_BLOCK_ELEMS, pooling: Pooling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL sum, recall sum): fp64 sums over this rank's valid queries of the indexer's distillation loss.

    The student: a full layer's index queries [B, S, I, J], head weights [B, S, I] and index keys [B, T, J], with
    their graph to the indexer's leaves. `targets`: per layer of the group, its detached absorbed queries
    [B, S, H, C] and latent rows [B, T, C]. `topk_BxSxK`: the group's selected keys (None: every key).

    Per query, over its key set (env.objectives.indexer_loss "dense": every key it may see; "sparse": its
    selected top-k): the target is the main attention's probabilities (fp32 softmax of the MLA scores), summed
    over heads and L1-normalised, of each layer in `targets`, averaged over them, detached; the student is the
    log-softmax of the index scores sum_i w_i relu(q_i . k / sqrt(J)) over the same keys; the loss is
    KL(target || student). Recall is the target's mass on the selected keys (1 where every key is selected, and
    in sparse mode). Only the student's inputs get gradients, and through them the indexer's leaves.

    With `pooling` (GLM-5.3), keys_BxTxJ are pool keys at pool ends and topk_BxSxK the pooled selection; the
    target's head-summed probabilities (over every visible token for "dense", over the selection's tokens for
    "sparse") are summed per pool, kept on the pools the student scores (dense: every candidate pool; sparse:
    the chosen ones) and L1-normalised; the student is the log-softmax of the pool scores over those pools.
    Recall counts 1 for a query without a candidate pool.
    """
    B = q_BxSxIxJ.shape[0]
    I, J, H = cfg.index_n_heads, cfg.index_head_dim, cfg.num_attention_heads
    latent_BxTxC = targets[0][1]
    topk = None if topk_BxSxK is None or (pooling is None and topk_BxSxK.shape[-1] >= keys_BxTxJ.shape[1]) \
        else topk_BxSxK
    sparse = env.objectives.indexer_loss == "sparse" and topk is not None
    C = latent_BxTxC.shape[-1]
    width = topk.shape[-1] if sparse else keys_BxTxJ.shape[1]
    block = max(1, block_elems // max(1, B * width * (2 * H + 3 * I + 8 + (C + J if sparse else 0))))
    return _IndexerKL.apply(q_BxSxIxJ, w_BxSxI, keys_BxTxJ, targets, topk, env.mask.query_valid(B), env.mask,
                            cfg.softmax_scale, sparse, block, pooling)


class _IndexerKL(torch.autograd.Function):
    """The indexer's KL over query blocks, with its gradient taken block by block in the forward (the student's
    [B, s, I, keys] scores live for one block only); the backward scales the saved input gradients."""

    @staticmethod
    def forward(ctx, q_BxSxIxJ, w_BxSxI, keys_BxTxJ, targets, topk, valid_BxS, mask, scale, sparse, block,
                pooling):
        """targets: ((qa_BxSxHxC, latent_BxTxC) per layer): the target is the mean of their distributions."""
        want = any(ctx.needs_input_grad[:3])
        B, S = valid_BxS.shape
        T, J = keys_BxTxJ.shape[1:]
        grads = [torch.zeros_like(t) for t in (q_BxSxIxJ, w_BxSxI, keys_BxTxJ)] if want else []
        loss = torch.zeros((), dtype=torch.float64, device=q_BxSxIxJ.device)
        recall = torch.zeros_like(loss)
        keys_d = keys_BxTxJ.detach().requires_grad_(want)
        if sparse:  # as the sparse path sees them (Mask.at takes every query's indices)
            allowed_BxSxK = mask.at(topk) if pooling is None else pooling.allowed
            bias_BxSxK = mask.bias_at(topk)
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
                rows = (gather_rows(latent_BxTxC, idx, qa_BxSxHxC.dtype) if sparse
                        else latent_BxTxC[:, None, :nk].to(qa_BxSxHxC.dtype))
                # the target: heads' probabilities summed, zero off the key set, L1-normalised
                probs = torch.softmax(block_scores(qa_BxSxHxC[:, a:b], rows, allowed, bias, scale), dim=-1).sum(2)
                target = probs.masked_fill_(~allowed, 0)
                layer_targets.append(target / target.sum(-1, keepdim=True).clamp(min=torch.finfo(target.dtype).tiny))
            target = layer_targets[0] if len(layer_targets) == 1 else sum(layer_targets) / len(layer_targets)
            student_idx = idx if sparse else None
            if pooling is not None:  # the target's mass per pool, on the pools the student scores
                if sparse:
                    student_idx, allowed = pooling.ends(idx), pooling.ends(allowed)
                    target = pooling.per_pool(target)
                else:
                    allowed = pooling.candidates.rows(a, b, nk)
                    target = pooling.at_ends(target)
                target = target.masked_fill_(~allowed, 0)
                total = target.sum(-1, keepdim=True)
                target = target / total.clamp(min=torch.finfo(target.dtype).tiny)
            with torch.enable_grad():  # in the keys' dtype: each key's gradient is summed over queries in it
                k = wide(keys_d)
                q = q_BxSxIxJ[:, a:b].detach().to(k.dtype).requires_grad_(want)
                w = w_BxSxI[:, a:b].detach().to(k.dtype).requires_grad_(want)
                if sparse:
                    z = torch.einsum("bsij,bskj->bsik", q, gather_rows(k, student_idx))
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
            if sparse or topk is None:
                mass = target.sum(-1)
            else:
                chosen = topk[:, a:b] if pooling is None else pooling.ends(topk[:, a:b])
                mass = (target * topk_as_mask(chosen, T)[..., :nk]).sum(-1)
            if pooling is not None:
                mass = torch.where(total[..., 0] > 0, mass, 1.0)
            recall += (mass.to(torch.float64) * valid).sum()
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(recall)
        return loss, recall

    @staticmethod
    def backward(ctx, dloss, drecall):
        dq, dw, dk = ctx.saved_tensors
        return (dq * dloss.to(dq.dtype), dw * dloss.to(dw.dtype), dk * dloss.to(dk.dtype)) + (None,) * 8

"""The union path of the CPU's sparse MLA (glm5f/kernels/dsa.py): a block of queries that selects few distinct latent
rows attends their union in one GEMM per batch row, instead of gathering each query's rows.

Shape suffixes as in kernels.py; s queries of one block of one batch row, U rows in their union.
"""

from __future__ import annotations

import torch

from glm5f.core.ops import wide_dtype

UNION_BLOCK_ROWS = 256  # queries x heads of one block of the union path: the rows of its GEMMs


def union_width(K: int, H: int) -> int:
    """The most distinct rows a block of queries may select for the union path to take it: per selected row it
    does the work of every query of the block, which pays while the block's GEMM outruns the queries' own
    [H, C] x [C, K] products by as much (the ratios per head count: docs/performance.md, "Choices in the code"):
    32 / H times K, and at least min(3, 48 / H) times K (3K at 16 heads; 48 / H times between 17 and 47 heads)."""
    return int(K * max(1.0, 32 / H, min(3.0, 48 / H)))


def union_plan(idx_sxK, allowed_sxK, num_keys, max_width):
    """How one batch row's block of s queries attends the union of its selections in one GEMM, or None (the
    union is wider than max_width, or a query selects a row twice, which the gather path counts twice): (the
    union's key indices [U], sorted; keep [s, U]: selected and allowed; selected [s, U]; each selection's column
    in the union [s, K])."""
    s, K = idx_sxK.shape
    present_T = torch.zeros(num_keys, dtype=torch.bool, device=idx_sxK.device)
    present_T[idx_sxK.flatten()] = True
    cols_U = present_T.nonzero().flatten()
    if cols_U.numel() > max_width:
        return None
    loc_sxK = (present_T.cumsum(0) - 1)[idx_sxK]
    selected_sxU = torch.zeros(s, cols_U.numel(), dtype=torch.bool, device=idx_sxK.device).scatter_(1, loc_sxK, True)
    if int(selected_sxU.sum()) != s * K:
        return None
    keep_sxU = torch.zeros_like(selected_sxU).scatter_(1, loc_sxK, allowed_sxK)
    return cols_U, keep_sxU, selected_sxU, loc_sxK


def union_scores(q_sxHxC, rows_UxC, plan, bias_sxK, scale, dtype):
    """`block_scores` of one batch row's block over its union rows: scores [s, H, U] (wide), finfo.min where
    selected but not allowed, -inf where not selected (so a query with no allowed selection averages its K rows).
    The masks are added in place: 0 where kept, and a score plus finfo.min rounds to finfo.min (|score| is far
    below half its spacing, 2^103), plus -inf is -inf."""
    cols_U, keep_sxU, selected_sxU, loc_sxK = plan
    s, H, C = q_sxHxC.shape
    scores_sxHxU = torch.matmul(q_sxHxC.reshape(s * H, C), rows_UxC.T).mul_(scale).view(s, H, -1)
    if bias_sxK is not None:
        bias_sxU = bias_sxK.new_zeros(s, cols_U.numel()).scatter_(1, loc_sxK, bias_sxK)
        scores_sxHxU = scores_sxHxU + bias_sxU[:, None, :]
    wd = wide_dtype(dtype)
    fill_sxU = torch.full(selected_sxU.shape, float("-inf"), dtype=wd, device=q_sxHxC.device)
    fill_sxU.masked_fill_(selected_sxU, torch.finfo(wd).min).masked_fill_(keep_sxU, 0.0)
    scores_sxHxU = scores_sxHxU if scores_sxHxU.dtype == wd else scores_sxHxU.to(wd)
    return scores_sxHxU.add_(fill_sxU[:, None, :])


def union_plans(latent_BxTxC, idx_BxSxK, allowed_BxSxK, a, b, H):
    """Each batch row's `union_plan` for queries a:b, or None when any row has none."""
    B, T = latent_BxTxC.shape[:2]
    plans = []
    for i in range(B):
        plan = union_plan(idx_BxSxK[i, a:b], allowed_BxSxK[i, a:b], T, union_width(idx_BxSxK.shape[-1], H))
        if plan is None:
            return None
        plans.append(plan)
    return plans

"""Sigmoid-routed mixture of experts with shared experts, computed grouped (tokens sorted by expert).

Shape suffixes: N tokens, D hidden, E experts, K experts per token, F expert hidden (moe_intermediate_size),
M = N * K routed rows.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from glm5f.core.config import GLM5Config
from glm5f.core.layers import Kind, LayerSpec, Leaf, LeafKind, swiglu_leaves
from glm5f.core.ops import adapter_input, linear, swiglu, swiglu_mlp, wide

if TYPE_CHECKING:
    from glm5f.model.env import Env


def router_scores(p: dict, x_NxD: torch.Tensor) -> torch.Tensor:
    """The router's sigmoid scores [N, E] (fp32, or fp64 in fp64 runs), before the correction bias."""
    return linear(p, wide(x_NxD)).sigmoid()


def route(p: dict, x_NxD: torch.Tensor, cfg: GLM5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K experts [N, K] and their weights [N, K] (fp32, or fp64 in fp64 runs)."""
    return select_experts(p, router_scores(p, x_NxD), cfg)


def select_experts(p: dict, scores_NxE: torch.Tensor, cfg: GLM5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` from the router's scores [N, E].

    Sigmoid scores in fp32; e_score_correction_bias shifts the *choice* only (the weights are unbiased scores);
    with n_group > 1 only the topk_group groups with the best top-2 sums are eligible; weights are normalised
    when norm_topk_prob and scaled by routed_scaling_factor.
    """
    choice_NxE = scores_NxE + p["e_score_correction_bias"].to(scores_NxE.dtype)
    G = cfg.n_group
    if cfg.topk_group < G:
        N, E = choice_NxE.shape
        group_NxG = choice_NxE.view(N, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep_NxG = torch.zeros_like(group_NxG, dtype=torch.bool).scatter(
            1, group_NxG.topk(cfg.topk_group, dim=-1, sorted=False).indices, True)
        choice_NxE = choice_NxE.masked_fill(~keep_NxG.repeat_interleave(E // G, dim=1), float("-inf"))
    idx_NxK = choice_NxE.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    return idx_NxK, expert_weights(scores_NxE, idx_NxK, cfg)


def expert_weights(scores_NxE: torch.Tensor, idx_NxK: torch.Tensor, cfg: GLM5Config) -> torch.Tensor:
    """The gate weights [N, K] of experts idx: their unbiased scores, normalised over the K when norm_topk_prob,
    scaled by routed_scaling_factor (differentiable in the scores: the router learns through them)."""
    w_NxK = scores_NxE.gather(1, idx_NxK)
    if cfg.norm_topk_prob:
        w_NxK = w_NxK / (w_NxK.sum(-1, keepdim=True) + 1e-20)
    return w_NxK * cfg.routed_scaling_factor


def replay_experts(scores_NxE: torch.Tensor, own_NxK: torch.Tensor, recorded_NxK: torch.Tensor,
                   cfg: GLM5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, K], weights [N, K]) under routing replay: the recorded experts where a token has them (a row
    of -1: none, its router's choice `own_NxK` stays), weighted as the router weights its own (`expert_weights`)."""
    idx_NxK = torch.where(recorded_NxK[:, :1] >= 0, recorded_NxK, own_NxK)
    return idx_NxK, expert_weights(scores_NxE, idx_NxK, cfg)


def _grouped_mm_ok(x: torch.Tensor, *ws: torch.Tensor) -> bool:
    """torch's grouped_mm needs 16-byte aligned rows, fp32/bf16/fp16 (bf16 only on CUDA)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in ws)


def grouped_matmul(x_MxIn: torch.Tensor, w_ExOutxIn: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Row block e of x (rows sorted by expert, counts_E rows each) times w[e]^T -> [M, Out].

    Uses torch's grouped GEMM where it applies; otherwise scatters rows into an [E, max_count, In] buffer and
    runs one batched matmul. Either way no Python loop over experts. Computed in the wider of the two dtypes,
    returned in x's (as `linear`).
    """
    out_dtype = x_MxIn.dtype
    x_MxIn = x_MxIn.to(torch.promote_types(out_dtype, w_ExOutxIn.dtype))
    w_ExOutxIn = w_ExOutxIn.to(x_MxIn.dtype)
    # on FakeTensors (the memory plan's trace) the op stands in for the fallback too, whose width reads the data
    if _grouped_mm_ok(x_MxIn, w_ExOutxIn) or isinstance(x_MxIn, FakeTensor):
        offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
        if torch._C._are_functorch_transforms_active():  # torch.func differentiates torch's op itself
            return F.grouped_mm(x_MxIn, w_ExOutxIn.transpose(-1, -2), offs=offs).to(out_dtype)
        return grouped_mm(x_MxIn, w_ExOutxIn, offs).to(out_dtype)
    E = w_ExOutxIn.shape[0]
    expert_M = torch.repeat_interleave(torch.arange(E, device=x_MxIn.device), counts_E, output_size=x_MxIn.shape[0])
    start_E = torch.cumsum(counts_E, 0) - counts_E
    slot_M = torch.arange(x_MxIn.shape[0], device=x_MxIn.device) - start_E[expert_M]
    width = int(counts_E.max()) if x_MxIn.shape[0] else 0
    buf = x_MxIn.new_zeros(E, width, x_MxIn.shape[1]).index_put((expert_M, slot_M), x_MxIn)
    return torch.bmm(buf, w_ExOutxIn.transpose(-1, -2))[expert_M, slot_M].to(out_dtype)


@torch.library.custom_op("glm5f::grouped_mm", mutates_args=())
def grouped_mm(x_MxIn: torch.Tensor, w_ExOutxIn: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM, rows [offs[e-1], offs[e]) of x times w[e]^T -> [M, Out], as an op whose fake takes
    every dtype (torch's own takes bf16 only), so fp32 MoE layers trace under FakeTensor and torch.compile."""
    return F.grouped_mm(x_MxIn, w_ExOutxIn.transpose(-1, -2), offs=offs_E)


@grouped_mm.register_fake
def _(x_MxIn, w_ExOutxIn, offs_E):
    return x_MxIn.new_empty(x_MxIn.shape[0], w_ExOutxIn.shape[1])


@torch.library.custom_op("glm5f::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(dy_MxOut: torch.Tensor, x_MxIn: torch.Tensor, w_ExOutxIn: torch.Tensor,
                        offs_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, In], dw [E, Out, In]) of `grouped_mm`, the products torch's own backward takes (bit for bit)."""
    dy_MxOut = dy_MxOut.contiguous()  # autograd may hand an expanded gradient; the grouped GEMM takes real strides
    return (F.grouped_mm(dy_MxOut, w_ExOutxIn, offs=offs_E),
            F.grouped_mm(dy_MxOut.transpose(0, 1), x_MxIn, offs=offs_E))


@grouped_mm_backward.register_fake
def _(dy_MxOut, x_MxIn, w_ExOutxIn, offs_E):
    return torch.empty_like(x_MxIn), torch.empty_like(w_ExOutxIn)


def _grouped_mm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_autograd(ctx, dy_MxOut):
    x_MxIn, w_ExOutxIn, offs_E = ctx.saved_tensors
    return *grouped_mm_backward(dy_MxOut, x_MxIn, w_ExOutxIn, offs_E), None


grouped_mm.register_autograd(_grouped_mm_autograd, setup_context=_grouped_mm_setup_context)


def expert_linear(p: dict, x_MxIn: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Each expert's projection of its block of rows: x W_e^T, plus with a LoRA adapter (p's "lora_A" [E, r, In],
    "lora_B" [E, Out, r], spec "lora") scale * (dropout(x) A_e^T) B_e^T, both through the grouped GEMM."""
    y_MxOut = grouped_matmul(x_MxIn, p["weight"], counts_E)
    if "lora_A" not in p:
        return y_MxOut
    h_MxR = grouped_matmul(adapter_input(p, x_MxIn), p["lora_A"], counts_E)
    return y_MxOut + grouped_matmul(h_MxR, p["lora_B"], counts_E) * p["lora"].scale


def expert_ffn(p: dict, x_MxD: torch.Tensor, counts_E: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU of each expert over its block of rows (rows sorted by expert), with GLM-5.3's clamp at `limit`."""
    weights = [p[k]["weight"] for k in ("gate_proj", "up_proj", "down_proj")]
    if _fused_ok(p, x_MxD, weights):
        return ExpertSwiGLU.apply(x_MxD, counts_E, *weights, limit)
    gate = expert_linear(p["gate_proj"], x_MxD, counts_E)
    up = expert_linear(p["up_proj"], x_MxD, counts_E)
    return expert_linear(p["down_proj"], swiglu(gate, up, limit), counts_E)


def _fused_ok(p: dict, x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `ExpertSwiGLU` computes the experts: no adapter, weights in the rows' dtype (a run with fp64 sums
    keeps the op-by-op path), torch's grouped GEMM applies, and no torch.func transform is active."""
    return (not any("lora_A" in p[k] for k in ("gate_proj", "up_proj", "down_proj"))
            and all(w.dtype == x.dtype for w in weights)
            and (_grouped_mm_ok(x, *weights) or isinstance(x, FakeTensor))
            and not torch._C._are_functorch_transforms_active())


class ExpertSwiGLU(torch.autograd.Function):
    """`expert_ffn`'s grouped SwiGLU, the same products in the same order, keeping for the backward only the rows
    and the gate and up projections [M, F] (autograd would keep silu(gate) and the product too): the backward
    recomputes those two from the gate and up."""

    @staticmethod
    def forward(ctx, x_MxD, counts_E, w_gate_ExFxD, w_up_ExFxD, w_down_ExDxF, limit):
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        gate_MxF = grouped_mm(x_MxD, w_gate_ExFxD, offs_E)
        up_MxF = grouped_mm(x_MxD, w_up_ExFxD, offs_E)
        ctx.save_for_backward(x_MxD, offs_E, w_gate_ExFxD, w_up_ExFxD, w_down_ExDxF, gate_MxF, up_MxF)
        ctx.limit = limit
        return grouped_mm(swiglu(gate_MxF, up_MxF, limit), w_down_ExDxF, offs_E)

    @staticmethod
    def backward(ctx, dy_MxD):
        x_MxD, offs_E, w_gate_ExFxD, w_up_ExFxD, w_down_ExDxF, gate_MxF, up_MxF = ctx.saved_tensors
        limit = ctx.limit
        if limit is not None:
            gate_c, up_c = gate_MxF.clamp(max=limit), up_MxF.clamp(-limit, limit)
        else:
            gate_c, up_c = gate_MxF, up_MxF
        silu_MxF = F.silu(gate_c)
        dh_MxF, dw_down = grouped_mm_backward(dy_MxD, silu_MxF * up_c, w_down_ExDxF, offs_E)
        dgate_MxF = torch.ops.aten.silu_backward(dh_MxF * up_c, gate_c)
        dup_MxF = dh_MxF.mul_(silu_MxF)
        del silu_MxF, dh_MxF
        if limit is not None:  # outside the clamps' ranges their gradients are zero
            dgate_MxF = dgate_MxF.masked_fill_(gate_MxF > limit, 0)
            dup_MxF = dup_MxF.masked_fill_((up_MxF > limit) | (up_MxF < -limit), 0)
        dx_MxD, dw_gate = grouped_mm_backward(dgate_MxF, x_MxD, w_gate_ExFxD, offs_E)
        del dgate_MxF
        dx_up_MxD, dw_up = grouped_mm_backward(dup_MxF, x_MxD, w_up_ExFxD, offs_E)
        dx_MxD += dx_up_MxD
        return dx_MxD, None, dw_gate, dw_up, dw_down, None


def sort_by_expert(idx_NxK: torch.Tensor, num_experts: int):
    """(order [M]: routed rows sorted by expert (stable), counts [E]) for the flattened (token, slot) rows; counts
    has a fixed size (no read of the indices, as bincount's max would be)."""
    flat_M = idx_NxK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    return order_M, flat_M.new_zeros(num_experts).index_add_(0, flat_M, torch.ones_like(flat_M))


def routed_experts(p: dict, x_NxD: torch.Tensor, idx_NxK: torch.Tensor, w_NxK: torch.Tensor, num_experts: int,
                   experts: Callable | None = None, limit: float | None = None) -> torch.Tensor:
    """sum_k w[n, k] * expert_{idx[n, k]}(x[n]) -> [N, D]: rows sorted by expert, computed grouped by `expert_ffn`
    (with the SwiGLU clamp at `limit`), through `experts(p, rows [M, D], counts [E], ffn) -> [M, D]` where given
    (the layout's `experts`, which may send rows to the ranks owning their experts)."""
    N, K = idx_NxK.shape
    order_M, counts_E = sort_by_expert(idx_NxK, num_experts)
    x_MxD = x_NxD.index_select(0, order_M // K)
    ffn = expert_ffn if limit is None else functools.partial(expert_ffn, limit=limit)
    y_MxD = ffn(p, x_MxD, counts_E) if experts is None else experts(p, x_MxD, counts_E, ffn)
    if torch._C._are_functorch_transforms_active():  # torch.func differentiates the op-by-op form itself
        y_MxD = y_MxD * w_NxK.reshape(-1)[order_M, None]
        return torch.zeros_like(y_MxD).index_copy(0, order_M, y_MxD).view(N, K, y_MxD.shape[-1]).sum(1).to(x_NxD.dtype)
    return WeightedSum.apply(y_MxD, w_NxK, order_M).to(x_NxD.dtype)


class WeightedSum(torch.autograd.Function):
    """sum_k w[n, k] * y[row of (n, k)] -> [N, D] from the expert outputs y [M, D] in expert order (order_M: the
    (token, slot) row of each), keeping for the backward the outputs once, in token order (autograd would keep them
    in expert order and weighted as well)."""

    @staticmethod
    def forward(ctx, y_MxD, w_NxK, order_M):
        N, K = w_NxK.shape
        at_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(len(order_M), device=order_M.device))
        y_NKxD = y_MxD.index_select(0, at_M)
        ctx.save_for_backward(y_NKxD, w_NxK, order_M)
        return (y_NKxD * w_NxK.reshape(-1, 1)).view(N, K, y_NKxD.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, dout_NxD):
        y_NKxD, w_NxK, order_M = ctx.saved_tensors
        N, K = w_NxK.shape
        dw_NxK = (dout_NxD[:, None, :] * y_NKxD.view(N, K, y_NKxD.shape[-1])).sum(-1)
        dy_MxD = dout_NxD.index_select(0, order_M // K).mul_(w_NxK.reshape(-1)[order_M, None])
        return dy_MxD, dw_NxK, None


def seq_aux_loss(scores_BxSxE: torch.Tensor, idx_BxSxK: torch.Tensor, env: Env) -> torch.Tensor:
    """This rank's share (fp64) of sum over sequences of L_seq = sum_i f_i P_i.

    Per sequence of T valid tokens (env.valid_BxS; all when None): f_i = E / (K T) * (tokens that chose expert
    i), P_i = (1/T) sum_t s'_{t,i}, s' the scores normalised over all E experts. f and T count every rank's part
    of the sequence (env.seq_sum);
    f is a constant, so the rank's share is sum over its valid tokens of sum_i (f_i / T) s'_{t,i}, and the
    shares add up to the loss and its gradient over the ranks. Sequences without a valid token add 0.
    """
    B, S, E = scores_BxSxE.shape
    K = idx_BxSxK.shape[-1]
    with torch.no_grad():
        valid = env.valid_BxS if env.valid_BxS is not None else torch.ones(B, S, device=scores_BxSxE.device)
        valid_BxS = valid.to(torch.float64)
        chosen_BxE = valid_BxS.new_zeros(B, E).scatter_add_(1, idx_BxSxK.reshape(B, S * K),
                                                            valid_BxS.repeat_interleave(K, dim=1))
        stats_BxE1 = env.seq_sum(torch.cat([chosen_BxE, valid_BxS.sum(1, keepdim=True)], dim=1))
        counts_BxE, T_B = stats_BxE1[:, :E], stats_BxE1[:, E].clamp(min=1)
        coef_BxE = counts_BxE * (E / (K * T_B[:, None] ** 2))  # f_i / T
    share_BxSxE = scores_BxSxE / scores_BxSxE.sum(-1, keepdim=True)
    return torch.einsum("bse,bs,be->", share_BxSxE.to(torch.float64), valid_BxS, coef_BxE)


def moe(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, env: Env, routing_BxSxK: torch.Tensor | None = None):
    """Routed experts (computed by env.experts) plus shared experts. Returns (output [B, S, D], expert indices
    [N, K] of each token, aux): aux holds "seq_aux_loss" (see `seq_aux_loss`) when env.objectives asks for it.
    `routing_BxSxK`: recorded experts to use instead of the router's choice (`replay_experts`; the indices returned
    are those used)."""
    x_NxD = x_BxSxD.reshape(-1, x_BxSxD.shape[-1])
    scores_NxE = router_scores(p["gate"], x_NxD)
    idx_NxK, w_NxK = select_experts(p["gate"], scores_NxE, cfg)
    if routing_BxSxK is not None:
        idx_NxK, w_NxK = replay_experts(scores_NxE, idx_NxK, routing_BxSxK.reshape(idx_NxK.shape), cfg)
    y_NxD = routed_experts(p["experts"], x_NxD, idx_NxK, w_NxK, cfg.n_routed_experts, env.experts, cfg.swiglu_limit)
    if "shared_experts" in p:
        y_NxD = y_NxD + swiglu_mlp(p["shared_experts"], x_NxD, cfg.swiglu_limit)
    aux = {}
    if env.objectives.seq_aux:
        B, S = x_BxSxD.shape[:2]
        aux["seq_aux_loss"] = seq_aux_loss(scores_NxE.view(B, S, -1), idx_NxK.view(B, S, -1), env)
    return y_NxD.view_as(x_BxSxD), idx_NxK, aux


# ---- the kind record (glm5f.core.layers) -------------------------------------------------------------------------------

def moe_mlp(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env) -> tuple[torch.Tensor, dict]:
    """`moe`, with the layer's recorded experts where the batch holds "routing" (`Env.routing`)."""
    y_BxSxD, expert_idx_NxK, aux = moe(p, x_BxSxD, cfg, env, env.routing.get(layer))
    return y_BxSxD, {"expert_idx": expert_idx_NxK, **aux}


def _moe_params(c: GLM5Config, spec: LayerSpec) -> dict:
    E, D, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
    p = {
        "gate": {"weight": Leaf((E, D), "normal"), "e_score_correction_bias": Leaf((E,), "zeros")},
        "experts": {"gate_proj": {"weight": Leaf((E, I, D), "normal")},
                    "up_proj": {"weight": Leaf((E, I, D), "normal")},
                    "down_proj": {"weight": Leaf((E, D, I), "normal")}},
    }
    if c.n_shared_experts:
        p["shared_experts"] = swiglu_leaves(D, I * c.n_shared_experts)
    return p


def _moe_macs(c: GLM5Config, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The router and each routed and shared expert slot."""
    D, F = c.hidden_size, c.moe_intermediate_size
    return D * c.n_routed_experts + 3 * D * F * (c.num_experts_per_tok + c.n_shared_experts), 0.0


MOE = Kind(
    moe_mlp, _moe_params,
    rows=(
        (r"\.mlp\.gate\.e_score_correction_bias$", LeafKind(("router",), fp32=True, optim="balance")),
        (r"\.mlp\.gate\.weight$", LeafKind(("router", "embed"), fp32=True)),
        (r"\.experts\.(gate|up)_proj\.weight$", LeafKind(("experts", "mlp", "embed"), optim="hidden")),
        (r"\.experts\.down_proj\.weight$", LeafKind(("experts", "embed", "mlp"), optim="hidden")),
    ),
    macs=_moe_macs, experts=True)

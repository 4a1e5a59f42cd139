"""Kimi Delta Attention (GLM-5.3's linear layers): the chunked delta rule as the `glm5f::kda` op with its own backward,
the naive recurrence it is checked against, and the KDA attention block over a layer's checkpoint-named params."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glm5f.ops import linear, wide_dtype

# Tokens x heads of one block of chunks: the op prepares (WY matrices, triangular solve) this many at a time, so its
# workspace is bounded whatever T is; across blocks only the [d_k, d_v] state per sequence and head travels.
BLOCK_ELEMS = 2**10
# Tokens per chunk (a power of two): the chunk's WY matrices are [CHUNK, CHUNK]; the CPU's faster size by bench/kda.py
# (docs/performance.md, "Choices in the code").
CHUNK = 32
# Elements of one piece of the layer's elementwise Functions (short convolutions, forget gate, gated norm): they
# work on whole heads at a time, as many as fit, so their temporaries stay small whatever T is.
PIECE_ELEMS = 2**20


@dataclass(frozen=True)
class KDAConfig:
    """The fields of a GLM-5.3 text config a KDA layer reads (Transformers' names, so a config carrying them can
    be passed in its place)."""

    hidden_size: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    rms_norm_eps: float = 1e-5


# ---- segments -----------------------------------------------------------------------------------------------------

def document_ids(segment_BxT: torch.Tensor) -> torch.Tensor:
    """Non-decreasing document ids from any segment labelling: a document starts where the label changes."""
    starts_BxT = torch.zeros_like(segment_BxT, dtype=torch.long)
    starts_BxT[:, 1:] = (segment_BxT[:, 1:] != segment_BxT[:, :-1]).long()
    return starts_BxT.cumsum(1)


# ---- the naive recurrence (the oracle, and one decode step) -------------------------------------------------------

def kda_recurrent(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, scale: float,
                  initial_state_BxHxKxV=None, segment_BxT=None):
    """The delta rule one token at a time, in the wider of fp32 and the inputs' dtype:
    S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T and o_t = scale * S_t^T q_t, the state [H, d_k,
    d_v] per sequence (zero, or initial_state, at the start; zero at each document start of segment_BxT).
    Returns (o [B, T, H, d_v] in q's dtype, final state)."""
    dt = wide_dtype(q_BxTxHxK.dtype)
    q, k, v, g, beta = (x.to(dt) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH))
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state_BxHxKxV is None else initial_state_BxHxKxV.to(dt)
    docs = None if segment_BxT is None else document_ids(segment_BxT)
    out = []
    for t in range(T):
        if docs is not None and t > 0:
            S = S * (docs[:, t] == docs[:, t - 1]).to(dt)[:, None, None, None]
        S = S * g[:, t].exp()[..., None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * scale)
    return torch.stack(out, 1).to(q_BxTxHxK.dtype), S


# ---- decayed products within a chunk ------------------------------------------------------------------------------
# P[t, j] = sum_c a[t, c] b[j, c] exp(G[t, c] - G[j, c]) for j <= t, G the in-chunk cumulative log decay. Never the
# [C, C, d] decay tensor: for each pair of sibling blocks of a binary split of the chunk (the later half L, the
# earlier E, r = G at E's last position), P[L, E] = (a_L exp(G_L - r)) (b_E exp(r - G_E))^T, both factors <= 1
# since G does not increase (g <= 0); the diagonal is a . b. log2(C) levels, each a batched matmul.

def _tiny(dtype) -> float:
    """The square root of the dtype's smallest normal number (1e-19 in fp32, 1e-154 in fp64)."""
    return torch.finfo(dtype).tiny ** 0.5


def _exp(x):
    """exp(x) of a decay exponent (<= 0), 0 below `_tiny`: a decay below it is zero to every sum, and the products
    of such factors would be subnormal, which slows CPU matmuls by an order of magnitude."""
    floor = math.log(_tiny(x.dtype))
    return x.clamp_min(floor).exp_().masked_fill_(x < floor, 0)  # exp is slow where it would underflow


def _flush(x):
    """x with its entries below `_tiny` in magnitude set to 0 (for the products of unit-norm keys and queries with
    decays: 12 orders of magnitude below fp32's resolution; the triangular solve makes subnormals of them)."""
    return x.masked_fill_(x.abs() < _tiny(x.dtype), 0)


def _levels(C: int):
    h = C // 2
    while h >= 1:
        yield h
        h //= 2


def _halves(x, h):
    """x [..., C, d] -> (later halves, earlier halves) of the sibling blocks of size h: [..., C / 2h, h, d] each."""
    xv = x.unflatten(-2, (x.shape[-2] // (2 * h), 2, h))
    return xv[..., 1, :, :], xv[..., 0, :, :]


def _block_view(P, h):
    """The [L, E] blocks of P [..., C, C] for sibling blocks of size h, as a writable view [..., C / 2h, h, h]."""
    C = P.shape[-1]
    n = C // (2 * h)
    P6 = P.view(*P.shape[:-2], n, 2, h, n, 2, h)
    return P6.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _level_factors(G):
    """(h, exp(G_L - r), exp(r - G_E)) of the sibling blocks of each size h."""
    out = []
    for h in _levels(G.shape[-2]):
        GL, GE = _halves(G, h)
        r = GE[..., -1:, :]
        out.append((h, _exp(GL - r), _exp(r - GE)))
    return out


def _decayed_scores(a, b, factors):
    """P [..., C, C] (zero above the diagonal) of a, b [..., C, d] and the `_level_factors` of G."""
    P = torch.diag_embed((a * b).sum(-1))
    for h, eL, eE in factors:
        aL, _ = _halves(a, h)
        _, bE = _halves(b, h)
        _block_view(P, h).copy_((aL * eL) @ (bE * eE).mT)
    return P


def _decayed_scores_backward(dP, a, b, factors):
    """(da, db, dG) of `_decayed_scores` for dP [..., C, C] (its entries above the diagonal are ignored)."""
    dP = dP.contiguous()
    diag = dP.diagonal(dim1=-2, dim2=-1)[..., None]
    da, db = diag * b, diag * a
    for h, eL, eE in factors:
        aL, _ = _halves(a, h)
        _, bE = _halves(b, h)
        dPb = _block_view(dP, h)
        daL, _ = _halves(da, h)
        _, dbE = _halves(db, h)
        daL += eL * (dPb @ (bE * eE))
        dbE += eE * (dPb.mT @ (aL * eL))
    return da, db, a * da - b * db


# ---- one block of chunks: the WY form -----------------------------------------------------------------------------

def _chunked(x, t0, t1, C, dt, fill=0.0):
    """x[:, t0:t1] ([B, T, H, d] or [B, T, H]) -> [B, H, n, C, d] (or [B, H, n, C]) in dt, padded with `fill`."""
    x = x[:, t0:t1].to(dt)
    pad = -x.shape[1] % C
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], 1)
    x = x.movedim(1, 2) if x.ndim == 4 else x.transpose(1, 2)
    return x.unflatten(2, (-1, C))


def _segment_masks(docs_BxT, t0, t1, C):
    """Masks of one block of chunks: same document [B, 1, n, C, C], continues the incoming state m0 [B, 1, n, C],
    reaches the outgoing state mend [B, 1, n, C], whole chunk continues mall [B, 1, n]."""
    d = docs_BxT[:, t0:t1]
    pad = -d.shape[1] % C
    if pad:
        d = torch.cat([d, d[:, -1:].expand(-1, pad)], 1)
    d = d.unflatten(1, (-1, C))
    prev = docs_BxT[:, max(t0 - 1, 0):max(t0 - 1, 0) + 1]
    prev = torch.cat([prev, d[:, :-1, -1]], 1)  # the document of the token before each chunk
    same = d[..., :, None] == d[..., None, :]
    m0 = d == prev[..., None]
    mend = d == d[..., -1:]
    return same[:, None], m0[:, None], mend[:, None], m0[:, None, :, -1]


class _Block:
    """The per-chunk matrices of one block of chunks (B, H, n chunks of C):
    delta = U - W S, o = Qg S + Aqk delta, S' = gC * S + Kd^T delta, S the state entering each chunk."""

    def __init__(self, q, k, v, g, beta, masks, scale):
        self.q, self.k, self.v, self.beta, self.scale = q, k, v, beta, scale
        C = k.shape[-2]
        tril = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        strict = tril.tril(-1)
        if masks is None:
            self.m0 = self.mend = self.mall = None
            self.lower, self.strict = tril, strict
        else:
            same, self.m0, self.mend, self.mall = masks
            self.lower, self.strict = tril & same, strict & same
        self.G = g.cumsum(-2)
        GC = self.G[..., -1:, :]
        self.E0 = _exp(self.G)  # exp(G), zero where the incoming state does not reach
        self.eK = _exp(GC - self.G)  # exp(G_C - G), zero where the token does not reach the outgoing state
        self.gC = _exp(GC[..., 0, :])
        if masks is not None:
            self.E0 = self.E0 * self.m0[..., None]
            self.eK = self.eK * self.mend[..., None]
            self.gC = self.gC * self.mall[..., None]
        self.factors = _level_factors(self.G)
        self.Pkk = _flush(_decayed_scores(k, k, self.factors).masked_fill_(~self.strict, 0))
        self.Akk = beta[..., None] * self.Pkk
        self.Aqk = _flush(scale * _decayed_scores(q, k, self.factors).masked_fill_(~self.lower, 0))
        self.Rw = beta[..., None] * k * self.E0
        self.Qg = scale * q * self.E0
        self.Kd = k * self.eK
        R = torch.cat([beta[..., None] * v, self.Rw], -1)
        eye = torch.eye(C, dtype=R.dtype, device=R.device).expand_as(self.Akk)
        self.inv = _flush(torch.linalg.solve_triangular(self.Akk, eye, upper=False, unitriangular=True))
        self.X = self.inv @ R  # (I + Akk)^-1 R
        self.U, self.W = (x.contiguous() for x in self.X.split([v.shape[-1], k.shape[-1]], -1))

    def backward(self, dU, dW, dQg, dAqk, dKd, dgC):
        """(dq, dk, dv, dg, dbeta) from the gradients of the per-chunk matrices."""
        dV = self.v.shape[-1]
        dR = self.inv.mT @ torch.cat([dU, dW], -1)
        dAkk = -(dR @ self.X.mT).masked_fill(~self.strict, 0)
        dRu, dRw = dR.split([dV, dR.shape[-1] - dV], -1)
        beta = self.beta[..., None]
        dkk, dkk2, dGkk = _decayed_scores_backward(beta * dAkk, self.k, self.k, self.factors)
        dqk, dkq, dGqk = _decayed_scores_backward(self.scale * dAqk.masked_fill(~self.lower, 0), self.q, self.k,
                                                  self.factors)
        dv = beta * dRu
        dbeta = (self.v * dRu).sum(-1) + (self.k * self.E0 * dRw).sum(-1) + (dAkk * self.Pkk).sum(-1)
        dk = beta * self.E0 * dRw + self.eK * dKd + dkk + dkk2 + dkq
        dq = self.scale * self.E0 * dQg + dqk
        tK = self.Kd * dKd
        dG = self.Rw * dRw + self.Qg * dQg - tK + dGkk + dGqk
        dG[..., -1, :] += tK.sum(-2) + dgC * self.gC
        dg = dG.flip(-2).cumsum(-2).flip(-2)
        return dq, dk, dv, dg, dbeta


# ---- the op -------------------------------------------------------------------------------------------------------

def _compute_dtype(*xs) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return wide_dtype(dt)


def _unchunk(x, length):
    """[B, H, n, C, d] (or [B, H, n, C]) -> its first `length` tokens as [B, length, H, d] (or [B, length, H])."""
    x = x.flatten(2, 3)[:, :, :length]
    return x.movedim(1, 2) if x.ndim == 4 else x.transpose(1, 2)


def _layout(B, H, K, C):
    """(chunks per block, batch rows, heads) of the lane groups the op runs one after another: blocks of at least
    K tokens (the op saves one [d_k, d_v] state per block, so per token and head at most d_v numbers), as many rows
    and heads as keep a group's block within BLOCK_ELEMS token-heads (at least one head of one row), and with room
    left, longer blocks."""
    per = max(-(-K // C), 1)
    lanes = max(1, BLOCK_ELEMS // (per * C))
    heads = min(H, lanes)
    rows = min(B, max(1, lanes // heads))
    return max(per, BLOCK_ELEMS // (rows * heads * C)), rows, heads


def _groups(B, H, K, C):
    """(chunks per block, the (batch slice, head slice) of each lane group)."""
    per, rows, heads = _layout(B, H, K, C)
    return per, [(slice(b, b + rows), slice(h, h + heads)) for b in range(0, B, rows) for h in range(0, H, heads)]


def _blocks(T, C, per):
    """(first token, end token) of each block of `per` chunks (a function of the shapes only)."""
    return [(c0 * C, min((c0 + per) * C, T)) for c0 in range(0, -(-T // C), per)]


def workspace_bytes(B: int, T: int, H: int, d_k: int, d_v: int, dtype: torch.dtype,
                    chunk: int = CHUNK) -> tuple[int, int]:
    """(forward, backward) bytes the op holds beyond its inputs and outputs: one block of one lane group, its WY
    matrices, states and temporaries, in the wider of fp32 and dtype, with d = max(d_k, d_v) and N the block's
    token-heads: 44 N d forward, (49 + 3 d / chunk) N d backward (a bound on the most torch's allocator held at
    once at d 32-256, T 512-4K, one or many blocks: tests/test_kda.py)."""
    per, rows, heads = _layout(B, H, d_k, chunk)
    N = rows * heads * min(per * chunk, -(-T // chunk) * chunk)
    d, size = max(d_k, d_v), wide_dtype(dtype).itemsize
    return 44 * N * d * size, round((49 + 3 * d / chunk) * N * d * size)


def _block(q, k, v, g, beta, docs, t0, t1, C, dt, scale):
    masks = None if docs is None else _segment_masks(docs, t0, t1, C)
    return _Block(*(_chunked(x, t0, t1, C, dt) for x in (q, k, v, g, beta)), masks, scale)


def _scan(blk, S):
    """The state through a block's chunks from S -> (the state entering each chunk [B, H, n, d_k, d_v], delta,
    the state leaving the block)."""
    S_n = blk.U.new_empty(*S.shape[:2], blk.U.shape[2], *S.shape[2:])
    delta = torch.empty_like(blk.U)
    for i in range(blk.U.shape[2]):  # the state crosses the chunks one by one
        S_n[:, :, i] = S
        delta[:, :, i] = blk.U[:, :, i] - blk.W[:, :, i] @ S
        S = blk.gC[:, :, i, :, None] * S + blk.Kd[:, :, i].mT @ delta[:, :, i]
    return S_n, delta, S


def _kda_forward(q, k, v, g, beta, initial_state, segment, scale, chunk):
    B, T, H, K = k.shape
    V = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, beta)
    docs = None if segment is None else document_ids(segment)
    per, groups = _groups(B, H, K, chunk)
    blocks = _blocks(T, chunk, per)
    o = q.new_empty(B, T, H, V)
    states = q.new_empty(B, H, len(blocks), K, V, dtype=dt)
    final = q.new_empty(B, H, K, V, dtype=dt)
    for bs, hs in groups:
        lanes = [x[bs, :, hs] for x in (q, k, v, g, beta)]
        S = final[bs, hs].zero_() if initial_state is None else initial_state[bs, hs].to(dt)
        for b, (t0, t1) in enumerate(blocks):
            blk = _block(*lanes, None if docs is None else docs[bs], t0, t1, chunk, dt, scale)
            states[bs, hs, b] = S
            S_n, delta, S = _scan(blk, S)
            o[bs, t0:t1, hs] = _unchunk(blk.Qg @ S_n + blk.Aqk @ delta, t1 - t0)
        final[bs, hs] = S
    return o, final, states


def _kda_backward(do, dstate, q, k, v, g, beta, initial_state, segment, states, scale, chunk):
    B, T, H, K = k.shape
    dt = states.dtype
    docs = None if segment is None else document_ids(segment)
    grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    dinit = torch.empty_like(dstate, dtype=dt if initial_state is None else initial_state.dtype)
    per, groups = _groups(B, H, K, chunk)
    blocks = _blocks(T, chunk, per)
    for bs, hs in groups:
        lanes = [x[bs, :, hs] for x in (q, k, v, g, beta)]
        dS = dstate[bs, hs].to(dt)
        for b in reversed(range(len(blocks))):
            t0, t1 = blocks[b]
            blk = _block(*lanes, None if docs is None else docs[bs], t0, t1, chunk, dt, scale)
            n = blk.U.shape[2]
            S_n, delta, _ = _scan(blk, states[bs, hs, b])
            dO = _chunked(do[bs, :, hs], t0, t1, chunk, dt)
            from_o, from_o_state = blk.Aqk.mT @ dO, blk.Qg.mT @ dO
            dS_after = torch.empty_like(S_n)  # the gradient of the state leaving each chunk
            ddelta = torch.empty_like(delta)
            for i in reversed(range(n)):
                dS_after[:, :, i] = dS
                ddelta[:, :, i] = from_o[:, :, i] + blk.Kd[:, :, i] @ dS
                dS = from_o_state[:, :, i] + blk.gC[:, :, i, :, None] * dS - blk.W[:, :, i].mT @ ddelta[:, :, i]
            block_grads = blk.backward(ddelta, -ddelta @ S_n.mT, dO @ S_n.mT, dO @ delta.mT, delta @ dS_after.mT,
                                       (S_n * dS_after).sum(-1))
            for full, part in zip(grads, block_grads):
                full[bs, t0:t1, hs] = _unchunk(part, t1 - t0)
        dinit[bs, hs] = dS
    return (*grads, dinit)


def _check_kda(q, k, v, g, beta, initial_state, segment, chunk):
    B, T, H, K = k.shape
    if q.shape != k.shape or g.shape != k.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"kda: expected q, k, g [B, T, H, d_k], v [B, T, H, d_v], beta [B, T, H]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                         f"{tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"kda: initial_state must be [B, H, d_k, d_v] = {(B, H, K, v.shape[-1])}, got "
                         f"{tuple(initial_state.shape)}")
    if segment is not None and segment.shape != (B, T):
        raise ValueError(f"kda: segment must be [B, T] = {(B, T)} document ids, got {tuple(segment.shape)}")
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"kda: chunk must be a power of two, got {chunk}")


@torch.library.custom_op("glm5f::kda", mutates_args=())
def kda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           initial_state: torch.Tensor | None, segment: torch.Tensor | None, scale: float,
           chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked delta rule of `kda_recurrent` -> (o [B, T, H, d_v] in q's dtype, final state [B, H, d_k, d_v],
    the state entering each block of chunks [B, H, blocks, d_k, d_v] (the backward recomputes the chunks' from
    them; not differentiable)); state and arithmetic in the wider of fp32 and the inputs' dtype."""
    _check_kda(q, k, v, g, beta, initial_state, segment, chunk)
    return _kda_forward(q, k, v, g, beta, initial_state, segment, scale, chunk)


@kda_op.register_fake
def _(q, k, v, g, beta, initial_state, segment, scale, chunk):
    _check_kda(q, k, v, g, beta, initial_state, segment, chunk)
    B, T, H, K = k.shape
    V, dt = v.shape[-1], _compute_dtype(q, k, v, g, beta)
    return (q.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=dt),
            q.new_empty(B, H, len(_blocks(T, chunk, _layout(B, H, K, chunk)[0])), K, V, dtype=dt))


@torch.library.custom_op("glm5f::kda_backward", mutates_args=())
def kda_backward_op(do: torch.Tensor, dstate: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                    segment: torch.Tensor | None, states: torch.Tensor, scale: float,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dinitial_state) of `kda_op`: each chunk's WY matrices are recomputed from the
    inputs, the state's gradient walks the chunks backwards."""
    return _kda_backward(do, dstate, q, k, v, g, beta, initial_state, segment, states, scale, chunk)


@kda_backward_op.register_fake
def _(do, dstate, q, k, v, g, beta, initial_state, segment, states, scale, chunk):
    dinit = dstate.new_empty(dstate.shape, dtype=states.dtype if initial_state is None else initial_state.dtype)
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), dinit)


def _kda_setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, segment, scale, chunk = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, segment, output[2])
    ctx.scale, ctx.chunk, ctx.has_initial = scale, chunk, initial_state is not None
    ctx.mark_non_differentiable(output[2])


def _kda_autograd(ctx, do, dstate, _dstates):
    q, k, v, g, beta, initial_state, segment, states = ctx.saved_tensors
    *grads, dinit = kda_backward_op(do, dstate, q, k, v, g, beta, initial_state, segment, states, ctx.scale,
                                    ctx.chunk)
    return (*grads, dinit if ctx.has_initial else None, None, None, None)


kda_op.register_autograd(_kda_autograd, setup_context=_kda_setup_context)


def _fla_chunk_kda():
    """fla-core's chunk_kda when installed (CUDA only), else None."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def fla_kda(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, scale: float, initial_state_BxHxKxV=None):
    """`kda` by fla-core's chunk_kda (None when it is not installed). Its kernels take q, k, v and beta in one dtype
    (a dot of fp32 and bf16 tiles does not compile, bench/kernels_fla.py), so q, k and beta are rounded to v's
    (the layer's: glm5f's layers normalise q and k in fp32); g (fp32 in glm5f's layers) is passed as it is, and o
    is returned in q's dtype."""
    chunk_kda = _fla_chunk_kda()
    if chunk_kda is None:
        return None
    dt = v_BxTxHxV.dtype
    o, state = chunk_kda(q_BxTxHxK.to(dt), k_BxTxHxK.to(dt), v_BxTxHxV, g_BxTxHxK, beta_BxTxH.to(dt), scale=scale,
                         initial_state=initial_state_BxHxKxV, output_final_state=True)
    return o.to(q_BxTxHxK.dtype), state


def kda(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, scale: float | None = None,
        initial_state_BxHxKxV=None, segment_BxT=None, chunk: int = CHUNK):
    """o_t = scale * S_t^T q_t of the delta rule S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T
    (g <= 0: the per-channel log decay; the state is reset at each document start of segment_BxT) ->
    (o [B, T, H, d_v] in q's dtype, final state [B, H, d_k, d_v]). scale defaults to d_k ** -0.5.

    On CUDA without segments, fla-core's `chunk_kda` when it is installed (`fla_kda`; its kernels are compiled
    ahead of time by bench/kernels_fla.py and run by bench/device_check.py), else the `glm5f::kda` op."""
    scale = q_BxTxHxK.shape[-1] ** -0.5 if scale is None else scale
    if q_BxTxHxK.is_cuda and segment_BxT is None and q_BxTxHxK.dtype != torch.float64:
        out = fla_kda(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, scale, initial_state_BxHxKxV)
        if out is not None:
            return out
    o, state, _ = kda_op(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxK, beta_BxTxH, initial_state_BxHxKxV,
                         segment_BxT, scale, chunk)
    return o, state


# ---- the KDA attention block --------------------------------------------------------------------------------------
# Three autograd Functions that save only their inputs and recompute the elementwise rest in the backward, so a
# layer keeps about as many [T, H, d] tensors as the delta rule needs (the layer's memory is linear in T, with a
# small constant).

def _heads(rows: int, n_channels: int, head_dim: int):
    """(head slice, channel slice) of each group of whole heads the Functions below work on at a time: as many
    heads as keep rows x channels within PIECE_ELEMS (at least one), so their temporaries stay that small."""
    per = max(1, PIECE_ELEMS // max(1, rows * head_dim))
    H = n_channels // head_dim
    return [(slice(h, min(h + per, H)), slice(h * head_dim, min(h + per, H) * head_dim)) for h in range(0, H, per)]


class _ShortConv(torch.autograd.Function):
    """silu(causal depthwise convolution) of x [B, S, H * d] with weight [H * d, 1, W], taps not crossing a document
    start (docs [B, S] or None), computed in the wider of fp32, x's and the weight's dtype and rounded to x's; with
    `normalize`, then L2-normalised per head in fp32 (or wider): y / sqrt(|y|^2 + 1e-6). Returns [B, S, H, d]."""

    @staticmethod
    def _valid(docs, W):
        """valid[i - 1] [B, S - i, 1]: token t and t - i are in one document."""
        return None if docs is None else [(docs[:, i:] == docs[:, :-i])[:, :, None]
                                          for i in range(1, min(W, docs.shape[1]))]

    @staticmethod
    def _pre(x, w, valid):
        W = w.shape[-1]
        pre = x * w[:, 0, W - 1]
        for i in range(1, min(W, x.shape[1])):
            tap = x[:, :-i] * w[:, 0, W - 1 - i]
            pre[:, i:] += tap if valid is None else tap * valid[i - 1]
        return pre

    @staticmethod
    def forward(ctx, x, w, docs, head_dim: int, normalize: bool):
        ctx.save_for_backward(x, w, docs)
        ctx.head_dim, ctx.normalize = head_dim, normalize
        dt = wide_dtype(torch.promote_types(x.dtype, w.dtype))
        valid = _ShortConv._valid(docs, w.shape[-1])
        out = x.new_empty(*x.shape[:2], x.shape[-1] // head_dim, head_dim,
                          dtype=wide_dtype(x.dtype) if normalize else x.dtype)
        for hs, sl in _heads(x.shape[0] * x.shape[1], x.shape[-1], head_dim):
            y = F.silu(_ShortConv._pre(x[..., sl].to(dt), w[sl].to(dt), valid), inplace=True).to(x.dtype)
            y = y.unflatten(-1, (-1, head_dim))
            if normalize:
                y = y.to(out.dtype)
                y = y * torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6)
            out[:, :, hs] = y
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w, docs = ctx.saved_tensors
        dt = wide_dtype(torch.promote_types(x.dtype, w.dtype))
        W = w.shape[-1]
        valid = _ShortConv._valid(docs, W)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        for hs, sl in _heads(x.shape[0] * x.shape[1], x.shape[-1], ctx.head_dim):
            xs, ws = x[..., sl].to(dt), w[sl].to(dt)
            pre = _ShortConv._pre(xs, ws, valid)
            s = torch.sigmoid(pre)
            dy = dout[:, :, hs].to(dt)
            if ctx.normalize:
                y = (pre * s).to(x.dtype).to(dt).unflatten(-1, (-1, ctx.head_dim))
                r = torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6)
                y *= r
                dy = r * (dy - y * (dy * y).sum(-1, keepdim=True))
                del y, r
            dy = dy.flatten(-2)
            dpre = dy * s * (1 + pre * (1 - s))
            del pre, s, dy
            dxs = dpre * ws[:, 0, W - 1]
            dws = torch.zeros_like(ws)
            dws[:, 0, W - 1] = (dpre * xs).sum((0, 1))
            for i in range(1, min(W, x.shape[1])):
                dp = dpre[:, i:] if valid is None else dpre[:, i:] * valid[i - 1]
                dxs[:, :-i] += dp * ws[:, 0, W - 1 - i]
                dws[:, 0, W - 1 - i] = (dp * xs[:, :-i]).sum((0, 1))
            dx[..., sl], dw[sl] = dxs, dws
        return dx, dw, None, None, None


class _ForgetGate(torch.autograd.Function):
    """The per-channel log decay g [B, S, H, d] <= 0 from f [B, S, H * d] (f_b(f_a(x))), dt_bias [H * d] and A_log
    [H], in the wider of fp32, f's and dt_bias's dtype: with z = f + dt_bias and rate = exp(A_log),
    lower_bound * sigmoid(rate * z), or -rate * softplus(z) (threshold 20) without a lower bound."""

    @staticmethod
    def _z(f, dt_bias, A_log, hs, sl, head_dim):
        """(z [B, S, c], the rate of each of the c channels) of the heads hs (channels sl)."""
        dt = wide_dtype(torch.promote_types(f.dtype, dt_bias.dtype))
        return f[..., sl].to(dt) + dt_bias[sl].to(dt), A_log[hs].to(dt).exp().repeat_interleave(head_dim)

    @staticmethod
    def forward(ctx, f, dt_bias, A_log, head_dim: int, lower_bound):
        ctx.save_for_backward(f, dt_bias, A_log)
        ctx.head_dim, ctx.lower_bound = head_dim, lower_bound
        g = f.new_empty(*f.shape[:2], f.shape[-1] // head_dim, head_dim,
                        dtype=wide_dtype(torch.promote_types(f.dtype, dt_bias.dtype)))
        for hs, sl in _heads(f.shape[0] * f.shape[1], f.shape[-1], head_dim):
            z, rate = _ForgetGate._z(f, dt_bias, A_log, hs, sl, head_dim)
            if lower_bound is not None:
                gh = lower_bound * torch.sigmoid(rate * z)
            else:
                gh = -rate * F.softplus(z, threshold=20.0)
            g[:, :, hs] = gh.unflatten(-1, (-1, head_dim))
        return g

    @staticmethod
    def backward(ctx, dg):
        f, dt_bias, A_log = ctx.saved_tensors
        df, ddt, dA = torch.empty_like(f), torch.empty_like(dt_bias), torch.empty_like(A_log)
        for hs, sl in _heads(f.shape[0] * f.shape[1], f.shape[-1], ctx.head_dim):
            z, rate = _ForgetGate._z(f, dt_bias, A_log, hs, sl, ctx.head_dim)
            dgh = dg[:, :, hs].flatten(-2).to(z.dtype)
            if ctx.lower_bound is not None:
                s = torch.sigmoid(rate * z)
                du = dgh * ctx.lower_bound * s * (1 - s)  # the gradient of u = rate * z
                dz, drate = du * rate, (du * z).sum((0, 1))
            else:
                dz = -dgh * rate * torch.where(z > 20.0, 1.0, torch.sigmoid(z))
                drate = -(dgh * F.softplus(z, threshold=20.0)).sum((0, 1))
            drate = drate.unflatten(-1, (-1, ctx.head_dim)).sum(-1)  # per head
            df[..., sl], ddt[sl], dA[hs] = dz, dz.sum((0, 1)), drate * rate[::ctx.head_dim]
        return df, ddt, dA, None, None


class _GatedNorm(torch.autograd.Function):
    """weight * RMSNorm(o) * sigmoid(gate) over the last dim of o, gate [B, S, H, d], in the wider of fp32, o's and
    the weight's dtype, returned in o's."""

    @staticmethod
    def _parts(o, gate, weight, eps, hs):
        dt = wide_dtype(torch.promote_types(o.dtype, weight.dtype))
        o32 = o[:, :, hs].to(dt)
        r = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
        return o32 * r, r, torch.sigmoid(gate[:, :, hs].to(dt)), weight.to(dt)

    @staticmethod
    def _groups(o):
        return [hs for hs, _ in _heads(o.shape[0] * o.shape[1], o.shape[2] * o.shape[3], o.shape[3])]

    @staticmethod
    def forward(ctx, o, gate, weight, eps: float):
        ctx.save_for_backward(o, gate, weight)
        ctx.eps = eps
        out = torch.empty_like(o)
        for hs in _GatedNorm._groups(o):
            n, _, sg, w = _GatedNorm._parts(o, gate, weight, eps, hs)
            out[:, :, hs] = w * n * sg
        return out

    @staticmethod
    def backward(ctx, dy):
        o, gate, weight = ctx.saved_tensors
        do, dgate = torch.empty_like(o), torch.empty_like(gate)
        dweight = 0
        for hs in _GatedNorm._groups(o):
            n, r, sg, w = _GatedNorm._parts(o, gate, weight, ctx.eps, hs)
            dyh = dy[:, :, hs].to(n.dtype)
            dwn = dyh * sg  # the gradient of w * n
            dweight = dweight + (dwn * n).flatten(0, -2).sum(0)
            dn = dwn * w
            do[:, :, hs] = r * (dn - n * (dn * n).mean(-1, keepdim=True))
            dgate[:, :, hs] = dyh * w * n * sg * (1 - sg)
        return do, dgate, dweight.to(weight.dtype), None


def _log_decay(p: dict, x_BxSxD: torch.Tensor, cfg) -> torch.Tensor:
    """The forget gate's per-channel log decay g [B, S, H, d_k] (f_b_proj(f_a_proj(x)), bounded below)."""
    f = linear(p["f_b_proj"], linear(p["f_a_proj"], x_BxSxD))
    return _ForgetGate.apply(f, p["dt_bias"], p["A_log"], cfg.linear_head_dim, cfg.linear_lower_bound)


def _gated_out(p: dict, o_BxSxHxV: torch.Tensor, x_BxSxD: torch.Tensor, cfg) -> torch.Tensor:
    """The delta rule's output through the gated per-head RMSNorm (gate from x) and o_proj: [B, S, D]."""
    gate = linear(p["g_b_proj"], linear(p["g_a_proj"], x_BxSxD)).unflatten(-1, (-1, cfg.linear_head_dim))
    return linear(p["o_proj"], _GatedNorm.apply(o_BxSxHxV.to(x_BxSxD.dtype), gate, p["o_norm"]["weight"],
                                                cfg.rms_norm_eps).flatten(-2))


def kda_attention(p: dict, x_BxSxD: torch.Tensor, cfg, segment_BxS: torch.Tensor | None = None,
                  chunk: int = CHUNK) -> torch.Tensor:
    """GLM-5.3's KDA attention block over a linear-attention layer's `self_attn` params (checkpoint names:
    {q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, dt_bias, A_log, b_proj, g_a_proj, g_b_proj, o_norm, o_proj):
    q, k, v projections, a causal depthwise short convolution with SiLU, L2-normalised q and k, the forget gate,
    beta = sigmoid(b_proj(x)), the delta rule (`kda`), a gated per-head RMSNorm and o_proj. cfg: a `KDAConfig`
    or any config with its fields. segment_BxS: document ids of packed rows (state and convolution restart)."""
    K = cfg.linear_head_dim
    docs = None if segment_BxS is None else document_ids(segment_BxS)

    # Each branch from x is recomputed in the backward (checkpoint): the layer keeps x, the delta rule's inputs
    # and states and its output, whatever the branches make on the way.
    def qkv(name):
        return _ShortConv.apply(linear(p[f"{name}_proj"], x_BxSxD), p[f"{name}_conv1d"]["weight"], docs, K,
                                name != "v")

    q, k, v = (checkpoint(qkv, name, use_reentrant=False) for name in "qkv")
    g = checkpoint(_log_decay, p, x_BxSxD, cfg, use_reentrant=False)
    beta = torch.sigmoid(linear(p["b_proj"], x_BxSxD))
    o, _ = kda(q, k, v, g, beta, K ** -0.5, None, segment_BxS, chunk)
    return checkpoint(_gated_out, p, o, x_BxSxD, cfg, use_reentrant=False)


# ---- decoding: a layer's state carried from one call to the next --------------------------------------------------

def kda_attention_step(p: dict, x_BxSxD: torch.Tensor, cfg, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """`kda_attention` of S new tokens continuing the sequence whose state `cache` holds (`layers._kda_cache`):
    "recurrent" [B, H, d_k, d_v], the delta rule's state after the tokens so far (fp32, or wider), and "conv_q",
    "conv_k", "conv_v" [B, kernel - 1, H d], the last inputs of each short convolution (zeros before the first
    token, as the convolution pads). Both are updated in place. One token runs the recurrence itself
    (`kda_recurrent`), more the chunked `kda`. No gradients; no packed documents (one sequence per row)."""
    K, W = cfg.linear_head_dim, cfg.linear_conv_kernel_dim

    def qkv(name):
        proj_BxSxC = linear(p[f"{name}_proj"], x_BxSxD)
        tail = cache[f"conv_{name}"]
        seq_BxUxC = torch.cat([tail.to(proj_BxSxC.dtype), proj_BxSxC], 1)
        tail.copy_(seq_BxUxC[:, seq_BxUxC.shape[1] - tail.shape[1]:])
        return _ShortConv.apply(seq_BxUxC, p[f"{name}_conv1d"]["weight"], None, K, name != "v")[:, W - 1:]

    q, k, v = (qkv(name) for name in "qkv")
    g = _log_decay(p, x_BxSxD, cfg)
    beta = torch.sigmoid(linear(p["b_proj"], x_BxSxD))
    state = cache["recurrent"]
    if x_BxSxD.shape[1] == 1:
        o, new_state = kda_recurrent(q, k, v, g, beta, K ** -0.5, state)
    else:
        o, new_state = kda(q, k, v, g, beta, K ** -0.5, state)
    state.copy_(new_state)
    return _gated_out(p, o, x_BxSxD, cfg)


# ---- context parallelism ------------------------------------------------------------------------------------------
# Under CP a rank holds some of the N equal chunks of each sequence (two of 2 cp: `parallel.cp_positions`). A
# chunk's final state and outputs are affine in the state S_in entering it: S_out = A S_in + B and
# o_t = o0_t + S_in^T p_t. The delta rule run over the chunk from the state [0 | I] with d_k zero value columns
# appended gives them all: the final state [B | A] and the outputs [o0 | p]. The ranks exchange their chunks' maps
# ([d_k, d_v + d_k] per head), each composes those before its own chunks in sequence order (a chunk whose first
# token starts a document enters with a zero state), and the short convolution reads the kernel - 1 rows of x
# before each chunk from the rank that holds them. Gradients flow back through the exchanges.

def _chunk_docs(docs_BxT: torch.Tensor, start: int, length: int, before: int) -> torch.Tensor:
    """Document ids [B, before + length] of positions start - before .. start + length - 1 (the first document's
    before position 0, whose rows are zero: the projections have no bias, so taps over them add nothing)."""
    pos = torch.arange(start - before, start + length, device=docs_BxT.device)
    return docs_BxT[:, pos.clamp(min=0)]


def _halo(tails_BxNxRxD: torch.Tensor, c: int, rows: int) -> torch.Tensor:
    """The `rows` rows of x before chunk c [B, rows, D] from every chunk's last rows in order, zero before the
    sequence (a chunk shorter than the halo lends all its rows)."""
    before = tails_BxNxRxD[:, :c].flatten(1, 2)
    before = before[:, before.shape[1] - min(rows, before.shape[1]):]
    return F.pad(before, (0, 0, rows - before.shape[1], 0))


class _ComposeStates(torch.autograd.Function):
    """The state [B, upto, H, d_k, d_v] entering each of the first `upto` chunks, from every chunk's map
    [B, N, H, d_k, d_v + d_k] = [B | A] (S_out = A S_in + B) in sequence order and continues_BxN, whether each
    chunk's first token continues the document before it (the first chunk enters with a zero state). Its own
    backward walks the chunks back, so autograd keeps the maps and states whatever the number of chunks."""

    @staticmethod
    def forward(ctx, maps, continues_BxN, upto: int):
        K = maps.shape[-2]
        offset, transition = maps.split([maps.shape[-1] - K, K], -1)
        cont = continues_BxN[:, :upto, None, None, None].to(maps.dtype)
        states = offset.new_empty(offset[:, :upto].shape)
        S = offset.new_zeros(offset[:, 0].shape)
        for c in range(upto):
            S = S * cont[:, c]
            states[:, c] = S
            S = transition[:, c] @ S + offset[:, c]
        ctx.save_for_backward(transition, states, cont)
        return states

    @staticmethod
    def backward(ctx, dstates):
        transition, states, cont = ctx.saved_tensors
        upto, K = states.shape[1], transition.shape[-1]
        dmaps = transition.new_zeros(*transition.shape[:-1], states.shape[-1] + K)
        dS = torch.zeros_like(states[:, 0])  # the gradient of the state leaving chunk c
        for c in reversed(range(upto)):
            dmaps[:, c, ..., :-K] = dS
            dmaps[:, c, ..., -K:] = dS @ states[:, c].mT
            dS = (dstates[:, c] + transition[:, c].mT @ dS) * cont[:, c]
        return dmaps, None, None


def kda_attention_cp(p: dict, x_BxSxD: torch.Tensor, cfg, starts: tuple[int, ...], segment_BxT: torch.Tensor | None,
                     gather, chunk: int = CHUNK) -> torch.Tensor:
    """`kda_attention` on a context-parallel rank: x_BxSxD holds len(starts) equal chunks of the sequences back to
    back, chunk i from sequence position starts[i]; segment_BxT: document ids of all T positions (None: one document
    per row); gather: the layout's `chunks` verb ([B, len(starts), ...], a value per chunk held -> [B, N, ...], one
    per chunk of the sequence, in order). Returns [B, S, D]: what `kda_attention` over the whole sequences gives at
    these positions."""
    K, W = cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    B, S, D = x_BxSxD.shape
    n = len(starts)
    L = S // n
    x_BxnxLxD = x_BxSxD.unflatten(1, (n, L))
    tails_BxNxRxD = gather(x_BxnxLxD[:, :, L - min(W - 1, L):])
    N = tails_BxNxRxD.shape[1]
    index = [s // L for s in starts]
    docs_BxT = torch.zeros(B, N * L, dtype=torch.long, device=x_BxSxD.device) if segment_BxT is None else \
        document_ids(segment_BxT).expand(B, -1)
    # the held chunks side by side in the batch dim [n B, ...], each after the W - 1 rows before it
    xe = torch.cat([torch.cat([_halo(tails_BxNxRxD, c, W - 1), x_BxnxLxD[:, i]], 1) for i, c in enumerate(index)])
    docs_e = torch.cat([_chunk_docs(docs_BxT, c * L, L, W - 1) for c in index])
    x_c = x_BxnxLxD.movedim(1, 0).flatten(0, 1)

    def qkv(name):
        return _ShortConv.apply(linear(p[f"{name}_proj"], xe), p[f"{name}_conv1d"]["weight"], docs_e, K,
                                name != "v")[:, W - 1:]

    q, k, v = (checkpoint(qkv, name, use_reentrant=False) for name in "qkv")
    g = checkpoint(_log_decay, p, x_c, cfg, use_reentrant=False)
    beta = torch.sigmoid(linear(p["b_proj"], x_c))
    nB, _, H, V = v.shape
    dt = _compute_dtype(q, k, v, g, beta)
    eye = torch.eye(K, dtype=dt, device=v.device).expand(nB, H, K, K)
    start_state = torch.cat([eye.new_zeros(nB, H, K, V), eye], -1)
    o, maps = kda(q, k, torch.cat([v, v.new_zeros(nB, L, H, K)], -1), g, beta, K ** -0.5, start_state,
                  docs_e[:, W - 1:], chunk)
    o0, p_t = o.split([V, K], -1)
    maps_BxNxHxKx_ = gather(maps.unflatten(0, (n, B)).movedim(0, 1))
    first = torch.arange(1, N, device=docs_BxT.device) * L
    continues_BxN = F.pad(docs_BxT[:, first] == docs_BxT[:, first - 1], (1, 0), value=False)
    states = _ComposeStates.apply(maps_BxNxHxKx_, continues_BxN, max(index) + 1)
    incoming = torch.cat([states[:, c] for c in index])
    o = o0 + torch.einsum("bthk,bhkv->bthv", p_t, incoming.to(p_t.dtype))
    o = o.unflatten(0, (n, B)).movedim(0, 1).flatten(1, 2)
    return checkpoint(_gated_out, p, o, x_BxSxD, cfg, use_reentrant=False)

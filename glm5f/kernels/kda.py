"""Kimi Delta Attention's op (GLM-5.3's linear layers): the chunked delta rule as the `glm5f::kda` op with its own
backward, the naive recurrence it is checked against, and fla-core's `chunk_kda` where it runs (`fla_kda`)."""

from __future__ import annotations

import math

import torch

from glm5f.core.ops import wide_dtype

# Tokens x heads of one block of chunks: the op prepares (WY matrices, triangular solve) this many at a time, so its
# workspace is bounded whatever T is; across blocks only the [d_k, d_v] state per sequence and head travels.
BLOCK_ELEMS = 2**10
# Tokens per chunk (a power of two): the chunk's WY matrices are [CHUNK, CHUNK]; the CPU's faster size by bench/kda.py
# (docs/performance.md, "Choices in the code").
CHUNK = 32


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

def compute_dtype(*xs) -> torch.dtype:
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
    dt = compute_dtype(q, k, v, g, beta)
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
    V, dt = v.shape[-1], compute_dtype(q, k, v, g, beta)
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

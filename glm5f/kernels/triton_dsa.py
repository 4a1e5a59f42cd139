"""Triton kernels of DSA: sparse MLA forward and backward over gathered latent rows, and the indexer's scores.

Read each beside its torch oracle in glm5f/kernels/dsa.py; the launch wrappers check shapes and pass contiguous memory.
"""

import torch
import triton
import triton.language as tl

FP32_MIN = tl.constexpr(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: the torch path's masked score
DSEL_CHUNK_ELEMS = 1 << 28  # bound on the backward's per-selection row gradients [queries, K, C] per chunk
# (GLM-5, K = 2048 and C = 576: 227 queries a chunk, 0.5 GiB in bf16)


def _pow2(n: int) -> int:
    """A block covering n: a power of two, at least 16 (tl.dot's smallest tile side)."""
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 as the torch path does (not TF32); half types in their own precision."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- sparse MLA ---------------------------------------------------------------------------------------------------
# q is [B*S, H, C]; a latent row splits into its value channels [0, R) and the rest [R, C) (the rope key), so both
# halves are power-of-two tiles (GLM-5: R = 512, C - R = 64). `query` numbers b * S + s.

@triton.jit
def _below(i, n: tl.constexpr, BLOCK: tl.constexpr):
    """i < n for a tile of BLOCK indices counted from a multiple of BLOCK; a constant all-true mask where BLOCK
    divides n (none kept in registers across the main loop: at 64 heads that decides whether the forward spills)."""
    return tl.full(i.shape, 1, tl.int1) if n >= BLOCK and n % BLOCK == 0 else i < n


@triton.jit
def _load_query(q_ptr, H: tl.constexpr, R: tl.constexpr, C: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """This program's query and block of heads h, the value (r) and rope (c) channels with their
    bounds, and the query's value half [heads, R] and rope half [heads, C - R]. The head blocks of a query are
    neighbouring programs, so its rows come from L2 after the first block reads them."""
    head_blocks: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    query = tl.program_id(0).to(tl.int64) // head_blocks
    h = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    c = R + tl.arange(0, BLOCK_P)
    h_ok, r_ok, c_ok = _below(h, H, BLOCK_H), _below(r, R, BLOCK_R), _below(c - R, C - R, BLOCK_P)
    q_ptrs = q_ptr + query * (H * C) + h[:, None] * C  # strides as constants, one 64-bit base per program
    q_r = tl.load(q_ptrs + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_p = tl.load(q_ptrs + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    return query, h, r, c, h_ok, r_ok, c_ok, q_r, q_p


@triton.jit
def _load_selections(idx_ptr, allowed_ptr, bias_ptr, query, S, T, K, C, k, HAS_BIAS: tl.constexpr, latent_ptr):
    """Selections k (a tile) of one query: (in range, allowed, bias fp32, the pointers of their latent rows)."""
    k_ok = k < K
    rows = tl.load(idx_ptr + query * K + k, mask=k_ok, other=0)
    allowed = tl.load(allowed_ptr + query * K + k, mask=k_ok, other=0) != 0
    bias = tl.zeros(k.shape, tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + query * K + k, mask=k_ok, other=0.0).to(tl.float32)
    return k_ok, allowed, bias, latent_ptr + ((query // S) * T + rows[:, None]) * C


@triton.jit
def _load_rows(row_ptrs, k_ok, r, r_ok, c, c_ok, dtype: tl.constexpr):
    """The selected latent rows in `dtype`: value half [k, R], rope half [k, C - R]."""
    v = tl.load(row_ptrs + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
    kp = tl.load(row_ptrs + c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
    return v.to(dtype), kp.to(dtype)


@triton.jit
def _masked(s, allowed, k_ok, bias, scale):
    """Scores [heads, k] in fp32 from the products s = q . row: s * scale + bias, finfo.min where not allowed, -inf
    past K."""
    s = s * scale + bias[None, :]
    s = tl.where(allowed[None, :], s, FP32_MIN)
    return tl.where(k_ok[None, :], s, float("-inf"))


@triton.jit
def _masked_scores(q_r, q_p, v, kp, allowed, k_ok, bias, scale, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`_masked` scores of whole rows. Without ROPE (C = R: GLM-5.3's latent) the rope half is empty and not
    multiplied."""
    s = tl.dot(q_r, tl.trans(v), input_precision=DOT_PRECISION)
    if ROPE:
        s += tl.dot(q_p, tl.trans(kp), input_precision=DOT_PRECISION)
    return _masked(s, allowed, k_ok, bias, scale)


@triton.jit
def _chunked_products(q_ptrs, dout_ptrs, row_ptrs, h_ok, k_ok, R: tl.constexpr, C: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """(q . row, dout . value) [heads, k] in fp32, summed over chunks of BLOCK_C channels loaded from memory (q and
    dout rows h at q_ptrs, dout_ptrs; latent rows k at row_ptrs). For IEEE fp32 dots, which Triton 3.9 runs on
    the CUDA cores holding each thread's whole reduction in registers: over R = 512 channels that spills, over a
    chunk it does not. The price is reads: q and dout again for every tile (a program's own recent loads, meant
    to come from L1 or L2; not yet measured on a device)."""
    s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
    dprob = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        value = cc < R
        rows_c = tl.load(row_ptrs + cc[None, :], mask=k_ok[:, None] & (cc < C)[None, :], other=0.0)
        q_c = tl.load(q_ptrs + cc[None, :], mask=h_ok[:, None] & (cc < C)[None, :], other=0.0)
        rows_c = rows_c.to(q_c.dtype)
        s += tl.dot(q_c, tl.trans(rows_c), input_precision=DOT_PRECISION)
        if c0 < R:  # a chunk holding value channels
            dout_c = tl.load(dout_ptrs + cc[None, :], mask=h_ok[:, None] & value[None, :], other=0.0)
            dprob += tl.dot(dout_c, tl.trans(rows_c), input_precision=DOT_PRECISION)
    return s, dprob


@triton.jit
def _sparse_mla_fwd_kernel(q_ptr, latent_ptr, idx_ptr, allowed_ptr, bias_ptr, out_ptr, lse_ptr,
                           S, T, K, scale, H: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out [query, heads, R] = softmax(scores) @ values, online over tiles of BLOCK_K selections; lse beside."""
    query, h, r, c, h_ok, r_ok, c_ok, q_r, q_p = _load_query(q_ptr, H, R, C, BLOCK_H, BLOCK_R, BLOCK_P)
    dtype = q_r.dtype

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # each head's running max score
    l = tl.zeros([BLOCK_H], tl.float32)  # sum of exp(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)  # sum of exp(score - m) * value
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok, allowed, bias, row_ptrs = _load_selections(idx_ptr, allowed_ptr, bias_ptr, query, S, T, K, C, k,
                                                         HAS_BIAS, latent_ptr)
        v, kp = _load_rows(row_ptrs, k_ok, r, r_ok, c, c_ok, dtype)
        s = _masked_scores(q_r, q_p, v, kp, allowed, k_ok, bias, scale, C > R, DOT_PRECISION)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out_ptrs = out_ptr + query * (H * R) + (h[:, None] * R + r[None, :])
    tl.store(out_ptrs, (acc / l[:, None]).to(dtype), mask=h_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + query * H + h, m + tl.log(l), mask=h_ok)


@triton.jit
def _sparse_mla_bwd_dq_kernel(q_ptr, latent_ptr, idx_ptr, allowed_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr,
                              dq_ptr, S, T, K, scale, H: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """dq [query, heads, C] = dscores @ rows, dscores = prob * (dout . value - delta) * scale where allowed. With
    BLOCK_C (fp32), the products q . row and dout . value over chunks of channels (`_chunked_products`)."""
    query, h, r, c, h_ok, r_ok, c_ok, q_r, q_p = _load_query(q_ptr, H, R, C, BLOCK_H, BLOCK_R, BLOCK_P)
    dtype = q_r.dtype
    dout_ptrs = dout_ptr + query * (H * R) + h[:, None] * R
    dout = tl.load(dout_ptrs + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + query * H + h, mask=h_ok, other=0.0)
    delta = tl.load(delta_ptr + query * H + h, mask=h_ok, other=0.0)

    dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    dq_p = tl.zeros([BLOCK_H, BLOCK_P], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok, allowed, bias, row_ptrs = _load_selections(idx_ptr, allowed_ptr, bias_ptr, query, S, T, K, C, k,
                                                         HAS_BIAS, latent_ptr)
        if BLOCK_C:  # the rows' chunks first, then the whole rows again (just loaded: L1 or L2) for dq
            s, dprob = _chunked_products(q_ptr + query * (H * C) + h[:, None] * C, dout_ptrs, row_ptrs, h_ok, k_ok,
                                         R, C, BLOCK_H, BLOCK_K, BLOCK_C, DOT_PRECISION)
            s = _masked(s, allowed, k_ok, bias, scale)
            v, kp = _load_rows(row_ptrs, k_ok, r, r_ok, c, c_ok, dtype)
        else:
            v, kp = _load_rows(row_ptrs, k_ok, r, r_ok, c, c_ok, dtype)
            s = _masked_scores(q_r, q_p, v, kp, allowed, k_ok, bias, scale, C > R, DOT_PRECISION)
            dprob = tl.dot(dout, tl.trans(v), input_precision=DOT_PRECISION)
        prob = tl.exp(s - lse[:, None])
        dscore = tl.where(allowed[None, :] & k_ok[None, :], prob * (dprob - delta[:, None]), 0.0) * scale
        dq_r += tl.dot(dscore.to(dtype), v, input_precision=DOT_PRECISION)
        if C > R:
            dq_p += tl.dot(dscore.to(dtype), kp, input_precision=DOT_PRECISION)
    dq_ptrs = dq_ptr + query * (H * C) + h[:, None] * C
    tl.store(dq_ptrs + r[None, :], dq_r.to(dtype), mask=h_ok[:, None] & r_ok[None, :])
    if C > R:
        tl.store(dq_ptrs + c[None, :], dq_p.to(dtype), mask=h_ok[:, None] & c_ok[None, :])


@triton.jit
def _sparse_mla_bwd_rows_kernel(q_ptr, latent_ptr, idx_ptr, allowed_ptr, bias_ptr, dout_ptr, lse_ptr, delta_ptr,
                                has_key_ptr, drow_ptr, first_query, S, T, K, scale, H: tl.constexpr, R: tl.constexpr,
                                C: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                                DOT_PRECISION: tl.constexpr):
    """Each selection's row gradient [k, C] (not yet summed over queries), over all heads in blocks of BLOCK_H:
    dscores^T @ q, plus prob^T @ dout on the value channels. A query with no allowed key averaged its K rows.
    A query's tiles are neighbouring programs, so its q and dout come from L2 after the first tile reads them.
    With BLOCK_C (fp32), the products q . row and dout . value over chunks of channels (`_chunked_products`)."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    query = first_query + tl.program_id(0).to(tl.int64) // k_blocks
    k = (tl.program_id(0) % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_R)
    c = R + tl.arange(0, BLOCK_P)
    r_ok, c_ok = _below(r, R, BLOCK_R), _below(c - R, C - R, BLOCK_P)
    k_ok, allowed, bias, row_ptrs = _load_selections(idx_ptr, allowed_ptr, bias_ptr, query, S, T, K, C, k, HAS_BIAS,
                                                     latent_ptr)
    dtype = q_ptr.dtype.element_ty
    v, kp = _load_rows(row_ptrs, k_ok, r, r_ok, c, c_ok, dtype)  # not kept with BLOCK_C (only its chunks are read)
    has_key = tl.load(has_key_ptr + query) != 0
    uniform = tl.where(k_ok, 1.0 / K, 0.0)

    drow_r = tl.zeros([BLOCK_K, BLOCK_R], tl.float32)
    drow_p = tl.zeros([BLOCK_K, BLOCK_P], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = _below(h, H, BLOCK_H)
        q_ptrs = q_ptr + query * (H * C) + h[:, None] * C
        dout_ptrs = dout_ptr + query * (H * R) + h[:, None] * R
        lse = tl.load(lse_ptr + query * H + h, mask=h_ok, other=0.0)
        delta = tl.load(delta_ptr + query * H + h, mask=h_ok, other=0.0)
        if BLOCK_C:
            s, dprob = _chunked_products(q_ptrs, dout_ptrs, row_ptrs, h_ok, k_ok, R, C, BLOCK_H, BLOCK_K, BLOCK_C,
                                         DOT_PRECISION)
            s = _masked(s, allowed, k_ok, bias, scale)
        q_r = tl.load(q_ptrs + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        q_p = tl.load(q_ptrs + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
        dout = tl.load(dout_ptrs + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if not BLOCK_C:
            s = _masked_scores(q_r, q_p, v, kp, allowed, k_ok, bias, scale, C > R, DOT_PRECISION)
            dprob = tl.dot(dout, tl.trans(v), input_precision=DOT_PRECISION)
        prob = tl.exp(s - lse[:, None])
        prob = tl.where(h_ok[:, None], tl.where(has_key, prob, uniform[None, :]), 0.0)
        dscore = tl.where(allowed[None, :] & k_ok[None, :], prob * (dprob - delta[:, None]), 0.0) * scale
        dscore_t = tl.trans(dscore.to(dtype))
        drow_r += tl.dot(dscore_t, q_r, input_precision=DOT_PRECISION)
        drow_r += tl.dot(tl.trans(prob.to(dtype)), dout, input_precision=DOT_PRECISION)
        if C > R:
            drow_p += tl.dot(dscore_t, q_p, input_precision=DOT_PRECISION)
    drow_ptrs = drow_ptr + (query - first_query) * K * C + k[:, None] * C
    tl.store(drow_ptrs + r[None, :], drow_r.to(dtype), mask=k_ok[:, None] & r_ok[None, :])
    if C > R:
        tl.store(drow_ptrs + c[None, :], drow_p.to(dtype), mask=k_ok[:, None] & c_ok[None, :])


@triton.jit
def _segment_sum_kernel(drow_ptr, order_ptr, starts_ptr, dlatent_ptr, C,
                        BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """dlatent[row] += the row gradients order[starts[row]:starts[row + 1]] (the selections of that latent row,
    sorted), in dlatent's dtype and a fixed order: deterministic, no atomics."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cols_ok = cols < C
    out_ptrs = dlatent_ptr + row * C + cols
    acc = tl.load(out_ptrs, mask=cols_ok, other=0.0)
    first, stop = tl.load(starts_ptr + row), tl.load(starts_ptr + row + 1)
    for n0 in range(first, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        src = tl.load(order_ptr + n, mask=n_ok, other=0)
        g = tl.load(drow_ptr + src[:, None] * C + cols[None, :], mask=n_ok[:, None] & cols_ok[None, :], other=0.0)
        acc += tl.sum(g.to(acc.dtype), 0)
    tl.store(out_ptrs, acc, mask=cols_ok)


def _check_selections(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim):
    B, S, H, C = q_BxSxHxC.shape
    if latent_BxTxC.shape[::2] != (B, C) or idx_BxSxK.shape[:2] != (B, S) or allowed_BxSxK.shape != idx_BxSxK.shape:
        raise ValueError(f"sparse MLA kernels: q [B={B}, S={S}, H={H}, C={C}] needs latent [{B}, T, {C}], idx and "
                         f"allowed [{B}, {S}, K]; got {tuple(latent_BxTxC.shape)}, {tuple(idx_BxSxK.shape)}, "
                         f"{tuple(allowed_BxSxK.shape)}")
    if bias_BxSxK is not None and bias_BxSxK.shape != idx_BxSxK.shape:
        raise ValueError(f"sparse MLA kernels: bias must be [B, S, K] = {tuple(idx_BxSxK.shape)}, got "
                         f"{tuple(bias_BxSxK.shape)}")
    if not 0 < value_dim <= C:
        raise ValueError(f"sparse MLA kernels: value_dim must be in 1..C={C}, got {value_dim}")


# Blocks and warps of each sparse MLA kernel: (BLOCK_H, BLOCK_K, BLOCK_C, num_warps, num_stages) for half-precision
# inputs (tensor-core dots) and for fp32 (IEEE dots on the CUDA cores), the choices of bench/kernels.py's report at
# GLM-5's shapes on sm_90a (docs/kernels.md). The forward keeps all 64 heads of a query in one program (8
# warps: a [64, 512] fp32 accumulator is 128 registers a thread), so each selected row is read once per query.
# BLOCK_C: the backward's fp32 products over chunks of that many channels (`_chunked_products`; 0: whole rows, and
# the forward always takes whole rows).
MLA_BLOCKS = {
    "forward": {"half": (64, 16, 0, 8, 2), "fp32": (32, 16, 0, 16, 2)},
    "dq": {"half": (32, 16, 0, 8, 2), "fp32": (32, 32, 16, 8, 2)},
    "rows": {"half": (32, 32, 0, 8, 2), "fp32": (16, 32, 16, 16, 2)},
}


def mla_constants(kernel: str, dtype: torch.dtype, H: int, R: int, C: int, has_bias: bool,
                  block_h: int | None = None, block_k: int | None = None, block_c: int | None = None) -> dict:
    """The constexprs and launch options (num_warps, num_stages) of sparse MLA kernel `kernel` ("forward", "dq",
    "rows") for q's dtype and the layer's sizes (H heads, R value channels of C); block_h, block_k, block_c
    (0: whole rows) override."""
    bh, bk, bc, warps, stages = MLA_BLOCKS[kernel]["fp32" if dtype == torch.float32 else "half"]
    chunks = {} if kernel == "forward" else dict(BLOCK_C=bc if block_c is None else block_c)
    return dict(H=H, R=R, C=C, HAS_BIAS=has_bias, BLOCK_H=min(block_h or bh, _pow2(H)), BLOCK_K=block_k or bk,
                BLOCK_R=_pow2(R), BLOCK_P=_pow2(C - R), **chunks, DOT_PRECISION=_dot_precision(dtype),
                num_warps=warps, num_stages=stages)


def segment_sum_constants(C: int) -> dict:
    return dict(BLOCK_N=16, BLOCK_C=min(128, _pow2(C)))


def _mla_operands(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK):
    """Contiguous operands and the sizes (S, T, K) every sparse MLA kernel takes."""
    operands = (q_BxSxHxC.contiguous(), latent_BxTxC.contiguous(), idx_BxSxK.contiguous(), allowed_BxSxK.contiguous(),
                (allowed_BxSxK if bias_BxSxK is None else bias_BxSxK).contiguous())
    return operands, (q_BxSxHxC.shape[1], latent_BxTxC.shape[1], idx_BxSxK.shape[-1])


def sparse_mla_forward(q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor, idx_BxSxK: torch.Tensor,
                       allowed_BxSxK: torch.Tensor, bias_BxSxK: torch.Tensor | None, scale: float, value_dim: int,
                       block_h: int | None = None, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, value_dim] in q's dtype, lse [B, S, H] fp32): `glm5f::sparse_mla` on the device."""
    _check_selections(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, value_dim)
    B, S, H, C = q_BxSxHxC.shape
    operands, sizes = _mla_operands(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK)
    consts = mla_constants("forward", q_BxSxHxC.dtype, H, value_dim, C, bias_BxSxK is not None, block_h, block_k)
    out_BxSxHxR = q_BxSxHxC.new_empty(B, S, H, value_dim)
    lse_BxSxH = q_BxSxHxC.new_empty(B, S, H, dtype=torch.float32)
    grid = (B * S * triton.cdiv(H, consts["BLOCK_H"]),)
    _sparse_mla_fwd_kernel[grid](*operands, out_BxSxHxR, lse_BxSxH, *sizes, scale, **consts)
    return out_BxSxHxR, lse_BxSxH


def sparse_mla_backward(dout_BxSxHxR: torch.Tensor, q_BxSxHxC: torch.Tensor, latent_BxTxC: torch.Tensor,
                        idx_BxSxK: torch.Tensor, allowed_BxSxK: torch.Tensor, bias_BxSxK: torch.Tensor | None,
                        out_BxSxHxR: torch.Tensor, lse_BxSxH: torch.Tensor, scale: float, block_h: int | None = None,
                        block_k: int | None = None, block_c: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [B, S, H, C], dlatent [B, T, C] in the latent's dtype): `glm5f::sparse_mla_backward` on the device.

    dlatent is deterministic: per query chunk, every selection's row gradient is written out, the selections are
    sorted by latent row (stable) and each row's segment summed in order into dlatent.
    """
    R = out_BxSxHxR.shape[-1]
    _check_selections(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK, R)
    B, S, H, C = q_BxSxHxC.shape
    T, K = latent_BxTxC.shape[1], idx_BxSxK.shape[-1]
    operands, sizes = _mla_operands(q_BxSxHxC, latent_BxTxC, idx_BxSxK, allowed_BxSxK, bias_BxSxK)
    dq_consts, rows_consts = (mla_constants(kernel, q_BxSxHxC.dtype, H, R, C, bias_BxSxK is not None, block_h, block_k,
                                            block_c) for kernel in ("dq", "rows"))
    dout = dout_BxSxHxR.to(q_BxSxHxC.dtype).contiguous()
    delta_BxSxH = (dout.float() * out_BxSxHxR.float()).sum(-1)  # sum_k prob * dprob: the softmax's backward term
    lse_BxSxH = lse_BxSxH.contiguous()
    dq_BxSxHxC = torch.empty_like(operands[0])
    _sparse_mla_bwd_dq_kernel[(B * S * triton.cdiv(H, dq_consts["BLOCK_H"]),)](
        *operands, dout, lse_BxSxH, delta_BxSxH, dq_BxSxHxC, *sizes, scale, **dq_consts)

    has_key_BxS = allowed_BxSxK.any(-1)
    rows = (idx_BxSxK + T * torch.arange(B, device=idx_BxSxK.device)[:, None, None]).flatten()
    dlatent = torch.zeros(B * T, C, dtype=latent_BxTxC.dtype, device=latent_BxTxC.device)
    all_rows = torch.arange(B * T + 1, device=idx_BxSxK.device)
    chunk = max(1, DSEL_CHUNK_ELEMS // (K * C))
    sum_consts = segment_sum_constants(C)
    for first in range(0, B * S, chunk):
        n = min(B * S - first, chunk)
        drow = q_BxSxHxC.new_empty(n * K, C)
        _sparse_mla_bwd_rows_kernel[(n * triton.cdiv(K, rows_consts["BLOCK_K"]),)](
            *operands, dout, lse_BxSxH, delta_BxSxH, has_key_BxS, drow, first, *sizes, scale, **rows_consts)
        sorted_rows, order = torch.sort(rows[first * K:(first + n) * K], stable=True)
        starts = torch.searchsorted(sorted_rows, all_rows)
        _segment_sum_kernel[(B * T, triton.cdiv(C, sum_consts["BLOCK_C"]))](drow, order, starts, dlatent, C,
                                                                            **sum_consts)
    return dq_BxSxHxC, dlatent.view(B, T, C)


# ---- the indexer --------------------------------------------------------------------------------------------------

@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, keys_ptr, q_index_ptr, key_valid_ptr, q_segment_ptr, k_segment_ptr,
                           dense_ptr, bias_ptr, out_ptr, S, T, I, J, first, n, key_valid_sb, q_segment_sb,
                           k_segment_sb, dense_sb, bias_sb, scale,
                           HAS_KEY_VALID: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_DENSE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_J: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """scores [b, queries, keys] = sum_i w_i relu(q_i . key * scale) (+ bias) in fp32, -inf where not allowed.
    The products q_i . key in q's dtype with fp32 accumulation: IEEE fp32 for fp32 inputs (the CPU's scores),
    tensor cores for half types. Tiles no query may see (most above a causal diagonal) skip the head loop."""
    b = tl.program_id(2).to(tl.int64)  # the key tiles of a query block are neighbouring programs: its q from L2
    s = first + tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)  # int64: S * T may pass 2^31
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_J)
    s_ok, t_ok, j_ok = s < first + n, t < T, j < J
    if HAS_DENSE:
        allowed = tl.load(dense_ptr + b * dense_sb + s[:, None] * T + t[None, :],
                          mask=s_ok[:, None] & t_ok[None, :], other=0) != 0
    else:
        q_index = tl.load(q_index_ptr + s, mask=s_ok, other=-1)
        allowed = t[None, :] <= q_index[:, None]
        if HAS_KEY_VALID:
            allowed &= (tl.load(key_valid_ptr + b * key_valid_sb + t, mask=t_ok, other=0) != 0)[None, :]
        if HAS_SEGMENTS:
            q_seg = tl.load(q_segment_ptr + b * q_segment_sb + s, mask=s_ok, other=0)
            k_seg = tl.load(k_segment_ptr + b * k_segment_sb + t, mask=t_ok, other=0)
            allowed &= q_seg[:, None] == k_seg[None, :]
    allowed &= s_ok[:, None] & t_ok[None, :]

    acc = tl.zeros([BLOCK_S, BLOCK_T], tl.float32)
    if tl.max(allowed.to(tl.int32)) > 0:
        keys = tl.load(keys_ptr + (b * T + t[:, None]) * J + j[None, :], mask=t_ok[:, None] & j_ok[None, :],
                       other=0.0).to(q_ptr.dtype.element_ty)
        for i in range(0, I):
            q_i = tl.load(q_ptr + ((b * S + s[:, None]) * I + i) * J + j[None, :], mask=s_ok[:, None] & j_ok[None, :],
                          other=0.0)
            w_i = tl.load(w_ptr + (b * S + s) * I + i, mask=s_ok, other=0.0).to(tl.float32)
            z = tl.dot(q_i, tl.trans(keys), input_precision=DOT_PRECISION) * scale
            acc += w_i[:, None] * tl.maximum(z, 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + b * bias_sb + s[:, None] * T + t[None, :], mask=s_ok[:, None] & t_ok[None, :],
                       other=0.0).to(tl.float32)
    out_ptrs = out_ptr + (b * n + s[:, None] - first) * T + t[None, :]
    tl.store(out_ptrs, tl.where(allowed, acc, float("-inf")), mask=s_ok[:, None] & t_ok[None, :])


def _batched(x: torch.Tensor | None, B: int, inner: tuple, what: str) -> tuple[torch.Tensor | None, int]:
    """(x contiguous, its batch stride: 0 where x is shared by the batch) for a mask part [B or 1, *inner]."""
    if x is None:
        return None, 0
    if x.shape[0] not in (1, B) or tuple(x.shape[1:]) != inner:
        raise ValueError(f"indexer scores: {what} must be [{B} or 1, {', '.join(map(str, inner))}], got "
                         f"{tuple(x.shape)}")
    x = x.contiguous()
    return x, (x.stride(0) if x.shape[0] == B else 0)


# (BLOCK_S, BLOCK_T, num_warps, num_stages) of the indexer's scores, for half-precision inputs (tensor cores) and
# fp32 (IEEE dots on the CUDA cores), from bench/kernels.py's report at GLM-5's shapes on sm_90a
INDEXER_BLOCKS = {"half": (32, 512, 8, 2), "fp32": (16, 16, 8, 3)}


def indexer_constants(dtype: torch.dtype, J: int, block_s: int | None = None, block_t: int | None = None) -> dict:
    """The block constexprs and launch options of the indexer's scores for q's dtype; block_s, block_t override."""
    bs, bt, warps, stages = INDEXER_BLOCKS["fp32" if dtype == torch.float32 else "half"]
    return dict(BLOCK_S=block_s or bs, BLOCK_T=block_t or bt, BLOCK_J=_pow2(J), DOT_PRECISION=_dot_precision(dtype),
                num_warps=warps, num_stages=stages)


def indexer_scores(q_BxSxIxJ: torch.Tensor, w_BxSxI: torch.Tensor, keys_BxTxJ: torch.Tensor, q_index_S: torch.Tensor,
                   key_valid_BxT: torch.Tensor | None, q_segment_BxS: torch.Tensor | None,
                   k_segment_BxT: torch.Tensor | None, dense_BxSxT: torch.Tensor | None,
                   bias_BxSxT: torch.Tensor | None, first: int, stop: int, block_s: int | None = None,
                   block_t: int | None = None) -> torch.Tensor:
    """Index scores [B, stop - first, T] fp32 of queries first:stop over all T keys, -inf where masked (the mask
    parts as `glm5f::indexer_topk` takes them; dense replaces the causal, padding and document parts)."""
    B, S, I, J = q_BxSxIxJ.shape
    T = keys_BxTxJ.shape[1]
    if w_BxSxI.shape != (B, S, I) or keys_BxTxJ.shape != (B, T, J) or q_index_S.shape != (S,):
        raise ValueError(f"indexer scores: q [B={B}, S={S}, I={I}, J={J}] needs w [{B}, {S}, {I}], keys "
                         f"[{B}, T, {J}], q_index [{S}]; got {tuple(w_BxSxI.shape)}, {tuple(keys_BxTxJ.shape)}, "
                         f"{tuple(q_index_S.shape)}")
    if (q_segment_BxS is None) != (k_segment_BxT is None):
        raise ValueError("indexer scores: q_segment and k_segment come together (document ids of queries and keys)")
    key_valid, key_valid_sb = _batched(key_valid_BxT, B, (T,), "key_valid")
    q_segment, q_segment_sb = _batched(q_segment_BxS, B, (S,), "q_segment")
    k_segment, k_segment_sb = _batched(k_segment_BxT, B, (T,), "k_segment")
    dense, dense_sb = _batched(dense_BxSxT, B, (S, T), "dense")
    bias, bias_sb = _batched(bias_BxSxT, B, (S, T), "bias")
    q_index = q_index_S.contiguous()
    unused = q_index  # a valid pointer for the parts a launch leaves out
    n = stop - first
    scores_BxSxT = torch.empty(B, n, T, dtype=torch.float32, device=q_BxSxIxJ.device)
    consts = indexer_constants(q_BxSxIxJ.dtype, J, block_s, block_t)
    grid = (triton.cdiv(T, consts["BLOCK_T"]), triton.cdiv(n, consts["BLOCK_S"]), B)
    _indexer_scores_kernel[grid](
        q_BxSxIxJ.contiguous(), w_BxSxI.contiguous(), keys_BxTxJ.contiguous(), q_index,
        unused if key_valid is None else key_valid, unused if q_segment is None else q_segment,
        unused if k_segment is None else k_segment, unused if dense is None else dense,
        unused if bias is None else bias, scores_BxSxT, S, T, I, J, first, n, key_valid_sb, q_segment_sb,
        k_segment_sb, dense_sb, bias_sb, J ** -0.5,
        HAS_KEY_VALID=key_valid is not None, HAS_SEGMENTS=q_segment is not None, HAS_DENSE=dense is not None,
        HAS_BIAS=bias is not None, **consts)
    return scores_BxSxT

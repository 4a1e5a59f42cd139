"""GLM-5.3's KDA attention layer over its checkpoint-named params: projections, short convolutions, the forget gate,
the delta rule (the `glm5f.kernels.kda` op), the gated norm and o_proj; its decode step and its context-parallel form."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glm5f.kernels.kda import CHUNK, compute_dtype, document_ids, kda, kda_recurrent, workspace_bytes
from glm5f.core.layers import Kind, LayerSpec, Leaf, LeafKind, linear_leaves, norm_leaves
from glm5f.core.ops import linear, wide_dtype

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
    """`kda_attention` of S new tokens continuing the sequence whose state `cache` holds (`_kda_cache`):
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
    dt = compute_dtype(q, k, v, g, beta)
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


# ---- tree batches (glm5f.model.tree) -----------------------------------------------------------------------------

def _tree_conv(x_BxSxC: torch.Tensor, w: torch.Tensor, anc_BxSxW: torch.Tensor, head_dim: int,
               normalize: bool) -> torch.Tensor:
    """`_ShortConv` along each token's path: tap i reads the token's i-th predecessor (`Tree.ancestors`), zero
    before its root. Returns [B, S, H, d] in _ShortConv's dtypes; differentiated by autograd."""
    dt = wide_dtype(torch.promote_types(x_BxSxC.dtype, w.dtype))
    x, w = x_BxSxC.to(dt), w.to(dt)
    W, C = w.shape[-1], x.shape[-1]
    pre = x * w[:, 0, W - 1]
    for i in range(1, W):
        idx_BxS = anc_BxSxW[..., i]
        tap = x.gather(1, idx_BxS.clamp(min=0)[..., None].expand(-1, -1, C)) * (idx_BxS >= 0)[..., None].to(dt)
        pre = pre + tap * w[:, 0, W - 1 - i]
    y = F.silu(pre).to(x_BxSxC.dtype).unflatten(-1, (-1, head_dim))
    if normalize:
        y = y.to(wide_dtype(x_BxSxC.dtype))
        y = y * torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6)
    return y


def kda_attention_tree(p: dict, x_BxSxD: torch.Tensor, cfg, tree, chunk: int = CHUNK) -> torch.Tensor:
    """`kda_attention` over a tree batch's rows (`glm5f.model.tree.Tree`): the short convolutions read each
    token's path, and each segment's delta rule starts from its parent's final state (zero at a root), so every
    token's output is the one its unshared sequences give; gradients flow back through the shared states."""
    K, W = cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    anc_BxSxW = tree.ancestors(W)
    q, k, v = (_tree_conv(linear(p[f"{n}_proj"], x_BxSxD), p[f"{n}_conv1d"]["weight"], anc_BxSxW, K, n != "v")
               for n in "qkv")
    g = _log_decay(p, x_BxSxD, cfg)
    beta = torch.sigmoid(linear(p["b_proj"], x_BxSxD))
    rows = []
    for b, segments in enumerate(tree.segments):
        finals, pieces = [], []
        for start, stop, parent in segments:
            part = (t[b:b + 1, start:stop] for t in (q, k, v, g, beta))
            o, final = kda(*part, K ** -0.5, None if parent < 0 else finals[parent], None, chunk)
            finals.append(final)
            pieces.append(o)
        rows.append(torch.cat(pieces, 1))
    return _gated_out(p, torch.cat(rows, 0), x_BxSxD, cfg)


# ---- the kind record (glm5f.core.layers) -------------------------------------------------------------------------------

def kda_block(p: dict, x_BxSxD: torch.Tensor, cfg, layer: int, env, carry):
    """A GLM-5.3 linear-attention layer (`kda_attention`): padding tokens' inputs zeroed (as the reference does),
    packed documents restart its state and convolution. With a carried state (`env.state`: decoding) it continues
    the sequence from it (`kda_attention_step`). Under CP (`kda_attention_cp`) this rank's queries are two equal
    chunks of each sequence (`Layout.share`); in a tree batch each segment continues its parent
    (`kda_attention_tree`). It passes no top-k on (the reference neither)."""
    if env.mask.dense is not None:
        raise ValueError("GLM-5.3's KDA layers take a 2D padding mask or packed position_ids, not a 4D mask")
    state = env.state(layer)
    x_BxSxD = x_BxSxD * env.mask.query_valid(x_BxSxD.shape[0])[..., None].to(x_BxSxD.dtype)
    if state is not None:
        return kda_attention_step(p, x_BxSxD, cfg, state), None, {}
    if env.mask.tree is not None:
        return kda_attention_tree(p, x_BxSxD, cfg, env.mask.tree), None, {}
    if env.layout.cp > 1:
        half = x_BxSxD.shape[1] // 2
        starts = (env.mask.q_index_host[0], env.mask.q_index_host[half])
        return kda_attention_cp(p, x_BxSxD, cfg, starts, env.mask.k_segment, env.chunks), None, {}
    return kda_attention(p, x_BxSxD, cfg, env.mask.q_segment), None, {}


def _kda_params(c, spec: LayerSpec) -> dict:
    """A KDA layer's self_attn as its checkpoint names it (`kda_attention`): q, k, v projections [H d, D] and
    their depthwise short convolutions [H d, 1, kernel], the forget gate (f_a [d, D], f_b [H d, d], dt_bias [H d],
    A_log [H]), beta's b_proj [H, D], the output gate (g_a, g_b), the per-head o_norm [d] and o_proj [D, H d]."""
    H, K, D = c.linear_num_heads, c.linear_head_dim, c.hidden_size
    p = {f"{n}_proj": linear_leaves(H * K, D) for n in "qkv"}
    p.update({f"{n}_conv1d": {"weight": Leaf((H * K, 1, c.linear_conv_kernel_dim), "normal")} for n in "qkv"})
    p.update(f_a_proj=linear_leaves(K, D), f_b_proj=linear_leaves(H * K, K), dt_bias=Leaf((H * K,), "zeros"),
             A_log=Leaf((H,), "zeros"), b_proj=linear_leaves(H, D), g_a_proj=linear_leaves(K, D),
             g_b_proj=linear_leaves(H * K, K), o_norm=norm_leaves(K), o_proj=linear_leaves(D, H * K))
    return p


def _kda_cache(c, spec: LayerSpec, batch: int, capacity: int, dtype: torch.dtype,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """The state `kda_attention_step` carries (not per position: it holds the tokens so far, whatever the
    capacity): "recurrent" [B, H, d_k, d_v] the delta rule's state in the wider of fp32 and dtype, "conv_q",
    "conv_k", "conv_v" [B, kernel - 1, H d] each short convolution's last inputs."""
    H, K, W = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    out = {"recurrent": torch.zeros(batch, H, K, K, dtype=wide_dtype(dtype), device=device)}
    out.update({f"conv_{n}": torch.zeros(batch, W - 1, H * K, dtype=dtype, device=device) for n in "qkv"})
    return out


def _kda_macs(c, spec: LayerSpec, seq: int) -> tuple[float, float]:
    """The projections (q, k, v, forget gate, beta, output gate, o_proj), the short convolutions and the delta
    rule per head as the chunked form computes it (`CHUNK`-token chunks: the state's read and update, 4 d^2, and
    the causal half of the chunk's scores and values, CHUNK d)."""
    H, K, D = c.linear_num_heads, c.linear_head_dim, c.hidden_size
    proj = 4 * D * H * K + 2 * (D * K + K * H * K) + D * H
    return proj + 3 * H * K * c.linear_conv_kernel_dim + H * (4 * K * K + CHUNK * K), 0.0


def _kda_transient(c, spec: LayerSpec, B: int, S: int, T: int, act: torch.dtype,
                   weight: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes inside the `glm5f::kda` op: its block workspace (`kda.workspace_bytes`), and in the
    backward the gradients of q, k, v and g it returns ([B, S, H, d] each in the wider of fp32 and act). Under CP
    (S < T) the values carry d_k more columns (`kda_attention_cp`)."""
    H, K = c.linear_num_heads, c.linear_head_dim
    V = K if S == T else 2 * K
    fwd, bwd = workspace_bytes(B, S, H, K, V, act)
    return fwd, bwd + B * S * H * (3 * K + V) * wide_dtype(act).itemsize


KDA = Kind(
    kda_block, _kda_params,
    rows=(  # as in the reference, the convolutions and the decay's parameters stay fp32
        (r"\.self_attn\.[qkv]_proj\.weight$", LeafKind(("linear_heads", "embed"))),
        (r"\.self_attn\.[qkv]_conv1d\.weight$", LeafKind(("linear_heads", "conv", "conv"), fp32=True)),
        (r"\.self_attn\.[fg]_a_proj\.weight$", LeafKind(("linear_dim", "embed"))),
        (r"\.self_attn\.[fg]_b_proj\.weight$", LeafKind(("linear_heads", "linear_dim"))),
        (r"\.self_attn\.(dt_bias|A_log)$", LeafKind(("linear_heads",), fp32=True)),
        (r"\.self_attn\.b_proj\.weight$", LeafKind(("linear_heads", "embed"))),
        (r"\.self_attn\.o_norm\.weight$", LeafKind(("linear_dim",))),
    ),
    macs=_kda_macs, transient=_kda_transient, cache=_kda_cache, recurrent=True)

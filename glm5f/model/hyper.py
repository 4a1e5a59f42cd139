"""Manifold-constrained hyper-connections (mHC, GLM-5.3): N residual streams per token, collapsed into a block's
input by `hc_collapse` and the block's output expanded back by `hc_expand`, as pure functions of a layer's params.

Shape suffixes: B batch, S tokens, N streams (hc_mult), D hidden, W = (2 + N) N mixing weights per token.
"""

from __future__ import annotations

import torch

from glm5f.core.layers import Kind, Leaf, LeafKind, norm_leaves
from glm5f.core.ops import linear, rms_norm, wide


def hc_streams(x_BxSxD: torch.Tensor, n: int) -> torch.Tensor:
    """The model's first streams [B, S, N, D]: every stream a copy of the token embedding."""
    return x_BxSxD[:, :, None, :].expand(-1, -1, n, -1).contiguous()


def hc_head(streams_BxSxNxD: torch.Tensor) -> torch.Tensor:
    """The final hidden state [B, S, D]: the streams' unweighted mean (before the final norm)."""
    return streams_BxSxNxD.mean(dim=2)


def sinkhorn(comb_Nx_xN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly-stochastic matrices [..., N, N] from positive ones: columns normalised first, then iters - 1
    (row, column) rounds, each sum offset by eps."""
    comb_Nx_xN = comb_Nx_xN / (comb_Nx_xN.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb_Nx_xN = comb_Nx_xN / (comb_Nx_xN.sum(dim=-1, keepdim=True) + eps)
        comb_Nx_xN = comb_Nx_xN / (comb_Nx_xN.sum(dim=-2, keepdim=True) + eps)
    return comb_Nx_xN


def hc_weights(p: dict, streams_BxSxNxD: torch.Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    """(pre [B, S, N], post [B, S, N], comb [B, S, N, N]) of one hyper-connection (p: "fn" [W, N D], "base" [W],
    "scale" [3]), in fp32 (fp64 in fp64 runs).

    The flattened streams are RMS-normalised without a scale (x rsqrt(mean x^2 + rms_eps)) and projected by fn to
    W logits; with a = logits * scale + base per part: pre = sigmoid(a_pre) + hc_eps, post = 2 sigmoid(a_post),
    comb = sinkhorn(softmax(a_comb over each row) + hc_eps).
    """
    B, S, N, _ = streams_BxSxNxD.shape
    flat_BxSxND = wide(streams_BxSxNxD.reshape(B, S, -1))
    flat_BxSxND = flat_BxSxND * torch.rsqrt(flat_BxSxND.square().mean(-1, keepdim=True) + rms_eps)
    logits_BxSxW = linear({"weight": p["fn"]}, flat_BxSxND)
    base_W, scale_3 = p["base"].to(logits_BxSxW.dtype), p["scale"].to(logits_BxSxW.dtype)
    pre_w, post_w, comb_w = logits_BxSxW.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base_W.split([N, N, N * N])
    pre_BxSxN = torch.sigmoid(pre_w * scale_3[0] + pre_b) + hc_eps
    post_BxSxN = 2 * torch.sigmoid(post_w * scale_3[1] + post_b)
    comb_BxSxNxN = torch.softmax((comb_w * scale_3[2] + comb_b).view(B, S, N, N), dim=-1) + hc_eps
    return pre_BxSxN, post_BxSxN, sinkhorn(comb_BxSxNxN, sinkhorn_iters, hc_eps)


def hc_collapse(pre_BxSxN: torch.Tensor, streams_BxSxNxD: torch.Tensor) -> torch.Tensor:
    """The block's input [B, S, D]: the streams weighted by pre and summed, in fp32 (or wider), cast back."""
    return (pre_BxSxN[..., None] * streams_BxSxNxD).sum(dim=2).to(streams_BxSxNxD.dtype)


def hc_expand(post_BxSxN: torch.Tensor, comb_BxSxNxN: torch.Tensor, out_BxSxD: torch.Tensor,
              streams_BxSxNxD: torch.Tensor) -> torch.Tensor:
    """The next streams [B, S, N, D]: stream j = post_j * out + sum_i comb_ij * stream i, in the streams' dtype."""
    dt = streams_BxSxNxD.dtype
    mixed_BxSxNxD = torch.matmul(comb_BxSxNxN.to(dt).transpose(-1, -2), streams_BxSxNxD)
    return post_BxSxN.to(dt)[..., None] * out_BxSxD.to(dt)[:, :, None, :] + mixed_BxSxNxD


def hc_block(p: dict, streams_BxSxNxD: torch.Tensor, block, rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    """A block (attention or MLP) wrapped in a hyper-connection: `block(x [B, S, D]) -> (out [B, S, D], extra)`
    runs on the collapsed streams; returns (the next streams [B, S, N, D], extra)."""
    pre, post, comb = hc_weights(p, streams_BxSxNxD, rms_eps, hc_eps, sinkhorn_iters)
    out_BxSxD, extra = block(hc_collapse(pre, streams_BxSxNxD))
    return hc_expand(post, comb, out_BxSxD, streams_BxSxNxD), extra


def hc_params(p: dict, block: str) -> dict:
    """A layer's hyper-connection around `block` ("attn" or "ffn") as `hc_weights` takes it, from the layer's
    checkpoint-named leaves hc_{block}_fn, hc_{block}_base and hc_{block}_scale."""
    return {part: p[f"hc_{block}_{part}"] for part in ("fn", "base", "scale")}


def hyper_residual(p: dict, streams_BxSxNxD: torch.Tensor, cfg, layer: int, env, carry, attention, mlp):
    """GLM-5.3's decoder layer around its attention and MLP functions: pre-norm attention, then pre-norm MLP, each
    in a hyper-connection over the hc_mult streams [B, S, N, D] (which the layer takes and returns in place of
    the residual stream). Returns (streams, the attention's carry, the layer's aux)."""
    hc = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def attend(x_BxSxD):
        out_BxSxD, next_carry, aux = attention(p["self_attn"], rms_norm(p["input_layernorm"]["weight"], x_BxSxD,
                                                                        cfg.rms_norm_eps), cfg, layer, env, carry)
        return out_BxSxD, (next_carry, aux)

    def feed_forward(x_BxSxD):
        x_norm_BxSxD = rms_norm(p["post_attention_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
        return mlp(p["mlp"], x_norm_BxSxD, cfg, layer, env)

    streams_BxSxNxD, (carry, aux) = hc_block(hc_params(p, "attn"), streams_BxSxNxD, attend, *hc)
    streams_BxSxNxD, mlp_aux = hc_block(hc_params(p, "ffn"), streams_BxSxNxD, feed_forward, *hc)
    return streams_BxSxNxD, carry, {**aux, **mlp_aux}


def hc_leaves(c) -> dict:
    """The Leaf tree of a layer's two hyper-connections, as the checkpoint names them: fn [W, N D] (normal), base
    [W] (zeros), scale [3] (ones)."""
    N, D = c.hc_mult, c.hidden_size
    W = (2 + N) * N
    return {f"hc_{block}_{part}": Leaf(shape, init) for block in ("attn", "ffn")
            for part, shape, init in (("fn", (W, N * D), "normal"), ("base", (W,), "zeros"),
                                      ("scale", (3,), "ones"))}


def _hyper_macs(c, spec, seq: int) -> tuple[float, float]:
    """Both hyper-connections: the mixing weights' projection of the N streams, the collapse, the expansion."""
    N, D = c.hc_mult, c.hidden_size
    return 2 * ((2 + N) * N * N * D + N * D + N * (N + 1) * D), 0.0


# The kind record (glm5f.core.layers): the two norms and both hyper-connections (their base and scale fp32, as in the
# reference); the model's hc_mult streams are copies of the embedding, their mean the last hidden state.
HYPER = Kind(
    hyper_residual,
    lambda c, spec: {"input_layernorm": norm_leaves(c.hidden_size),
                     "post_attention_layernorm": norm_leaves(c.hidden_size), **hc_leaves(c)},
    rows=((r"\.hc_(attn|ffn)_fn$", LeafKind(("hc", "embed"))),
          (r"\.hc_(attn|ffn)_(base|scale)$", LeafKind(("hc",), fp32=True))),
    macs=_hyper_macs, enter=lambda x_BxSxD, cfg: hc_streams(x_BxSxD, cfg.hc_mult), leave=hc_head)

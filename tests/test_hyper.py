"""glm5f/model/hyper.py: the mHC weights and the collapse against Transformers' Glm5NextTextHyperConnection (fp32 and fp64),
the expansion against a naive per-stream loop in fp64, and the final head against the streams' mean."""

import contextlib

import pytest
import torch

from glm5f.model.hyper import hc_collapse, hc_expand, hc_head, hc_streams, hc_weights, sinkhorn


def reference(n, D, iters, hc_eps, rms_eps, seed=0):
    """Transformers' hyper-connection of a tiny GLM-5.3 config, with random fn, base and scale."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    cfg = Glm5NextTextConfig(hidden_size=D, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=hc_eps, rms_norm_eps=rms_eps,
                             num_hidden_layers=4, index_topk=16, index_kpool=4)
    torch.manual_seed(seed)
    module = Glm5NextTextHyperConnection(cfg)
    with torch.no_grad():
        module.fn.normal_(0, 0.5)
        module.base.normal_(0, 1.0)
        module.scale.uniform_(0.5, 2.0)
    return module


@contextlib.contextmanager
def float_means(dtype):
    """Transformers' `.float()` casts as casts to `dtype`: its fp32 code run in fp64, as an fp64 reference."""
    orig = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self.to(dtype)
    try:
        yield
    finally:
        torch.Tensor.float = orig


def params_of(module, dtype=None):
    p = {"fn": module.fn.detach().clone(), "base": module.base.detach().clone(),
         "scale": module.scale.detach().clone()}
    return p if dtype is None else {k: v.to(dtype) for k, v in p.items()}


@pytest.mark.parametrize("n,iters", [(1, 1), (2, 3), (4, 20)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
def test_weights_and_collapse_match_transformers(n, iters, dtype, tol):
    D = 8
    module = reference(n, D, iters, hc_eps=1e-3, rms_eps=1e-5).to(dtype)
    streams = torch.randn(2, 5, n, D, dtype=dtype, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad(), float_means(dtype):
        post_ref, comb_ref, collapsed_ref = module(streams)
    with torch.no_grad():
        pre, post, comb = hc_weights(params_of(module), streams, 1e-5, 1e-3, iters)
        collapsed = hc_collapse(pre, streams)
    assert post.dtype == comb.dtype == torch.promote_types(dtype, torch.float32)
    assert (post - post_ref).abs().max() <= tol
    assert (comb - comb_ref).abs().max() <= tol
    assert collapsed.dtype == dtype and (collapsed - collapsed_ref).abs().max() <= tol * 10


def test_bf16_streams_compute_in_fp32_like_transformers():
    module = reference(4, 16, 20, hc_eps=1e-6, rms_eps=1e-5)
    streams = (torch.randn(1, 7, 4, 16, generator=torch.Generator().manual_seed(2)) * 5).bfloat16()
    p = params_of(module)
    p["fn"] = p["fn"].bfloat16()  # the compute weights of a bf16 run; base and scale stay fp32
    with torch.no_grad():
        module.fn.copy_(p["fn"].float())
        post_ref, comb_ref, collapsed_ref = module(streams)
        pre, post, comb = hc_weights(p, streams, 1e-5, 1e-6, 20)
    assert post.dtype == torch.float32
    assert (post - post_ref).abs().max() <= 1e-6 and (comb - comb_ref).abs().max() <= 1e-6
    assert torch.equal(hc_collapse(pre, streams), collapsed_ref)


def test_eps_is_inside_the_rsqrt():
    """rsqrt(mean + eps), not 1 / (rms + eps): on small streams the two differ, and so must the weights."""
    module = reference(2, 4, 2, hc_eps=1e-6, rms_eps=1e-2)
    streams = torch.full((1, 1, 2, 4), 0.05, dtype=torch.float64)
    p = params_of(module, torch.float64)
    pre, post, _ = hc_weights(p, streams, 1e-2, 1e-6, 2)
    flat = streams.reshape(1, 1, -1)
    other = flat / (flat.square().mean(-1, keepdim=True).sqrt() + 1e-2)
    logits = other @ p["fn"].T
    post_other = 2 * torch.sigmoid(logits[..., 2:4] * p["scale"][1] + p["base"][2:4])
    assert (post - post_other).abs().max() > 1e-3
    with torch.no_grad(), float_means(torch.float64):
        assert (post - module.double()(streams)[0]).abs().max() <= 1e-13


def test_sinkhorn_is_near_doubly_stochastic():
    m = torch.rand(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.1
    out = sinkhorn(m, 50, 0.0)
    assert (out.sum(-1) - 1).abs().max() <= 1e-10 and (out.sum(-2) - 1).abs().max() <= 1e-12


def test_expand_is_post_times_output_plus_comb_mixed_streams():
    g = torch.Generator().manual_seed(3)
    B, S, N, D = 2, 3, 4, 5
    post, comb = torch.rand(B, S, N, generator=g, dtype=torch.float64), torch.rand(B, S, N, N, generator=g,
                                                                                      dtype=torch.float64)
    out, streams = torch.randn(B, S, D, generator=g, dtype=torch.float64), torch.randn(B, S, N, D, generator=g,
                                                                                          dtype=torch.float64)
    naive = torch.empty(B, S, N, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            for j in range(N):
                naive[b, s, j] = post[b, s, j] * out[b, s] + sum(comb[b, s, i, j] * streams[b, s, i] for i in range(N))
    assert (hc_expand(post, comb, out, streams) - naive).abs().max() <= 1e-14


def test_streams_start_as_copies_and_the_head_is_their_mean():
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    streams = hc_streams(x, 4)
    assert streams.shape == (2, 3, 4, 5) and all(torch.equal(streams[:, :, i], x) for i in range(4))
    streams = streams + torch.randn_like(streams)
    assert torch.allclose(hc_head(streams), sum(streams[:, :, i] for i in range(4)) / 4, atol=1e-15)

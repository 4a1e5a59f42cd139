"""glm5f/model/attention.py: the sparse path against a masked-dense oracle, the CPU's dense top-k form against the sparse
path, DSA over every key as plain MLA (the model written out layer by layer), and a query with fewer visible keys
than k; equivalences searched by hypothesis."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from conftest import env_of, forward_by_layers
from glm5f.model.attention import (dense_mla, dense_topk_pays, indexer_keys, indexer_queries, indexer_topk, mla_core,
                                   mla_project, sparse_mla, topk_dense_mla)
from glm5f.parallel.layout import cp_position_list
from glm5f.kernels import dsa as kernels
from glm5f.model.env import Mask
from glm5f.kernels.dsa import topk_as_mask, topk_first
from glm5f.core.ops import linear

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)


def small_cfg(**kw):
    base = dict(index_topk_pattern=None, index_topk_freq=1)
    return glm5f.preset("glm5-tiny", **{**base, **kw})


@st.composite
def attention_case(draw):
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 12))
    heads = draw(st.integers(1, 3))
    cfg = small_cfg(num_attention_heads=heads,
                    kv_lora_rank=draw(st.sampled_from([4, 8])), qk_rope_head_dim=draw(st.sampled_from([2, 4])),
                    qk_nope_head_dim=draw(st.sampled_from([2, 4])), v_head_dim=draw(st.sampled_from([2, 4])),
                    index_topk=draw(st.integers(1, T)))
    return cfg, B, T, draw(st.integers(0, 2**31 - 1)), draw(st.booleans())


def random_inputs(cfg, B, T, seed, padded):
    g = torch.Generator().manual_seed(seed)
    H, C = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q_nope = torch.randn(B, T, H, cfg.qk_nope_head_dim, generator=g, dtype=torch.float64)
    q_rot = torch.randn(B, T, H, cfg.qk_rope_head_dim, generator=g, dtype=torch.float64)
    latent = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    kv_b = {"kv_b_proj": {"weight": torch.randn(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                                                generator=g, dtype=torch.float64)}}
    key_valid = torch.rand(B, T, generator=g) > 0.25 if padded else None
    mask = Mask(torch.arange(T), T, key_valid=key_valid)
    scores = torch.randn(B, T, T, generator=g).masked_fill(~mask.rows(0, T), float("-inf"))
    idx = topk_first(scores, min(cfg.index_topk, T))
    return q_nope, q_rot, latent, kv_b, mask, idx


@SETTINGS
@given(attention_case())
def test_sparse_attention_equals_masked_dense_oracle(case):
    cfg, B, T, seed, padded = case
    q_nope, q_rot, latent, kv_b, mask, idx = random_inputs(cfg, B, T, seed, padded)
    allowed = mask.rows(0, T) & topk_as_mask(idx, T)
    live = allowed.any(-1)  # rows with no visible key (padding queries) are garbage in any implementation
    inputs = [t.requires_grad_() for t in (q_nope, q_rot, latent, kv_b["kv_b_proj"]["weight"])]
    weight = torch.randn(B, T, cfg.num_attention_heads, cfg.v_head_dim, dtype=torch.float64) * live[..., None, None]
    sparse = sparse_mla(kv_b, q_nope, q_rot, latent, idx, mask, cfg)
    dense = dense_mla(kv_b, q_nope, q_rot, latent, mask, cfg, allowed_BxSxT=allowed)
    assert torch.allclose(sparse[live], dense[live], atol=1e-10, rtol=1e-9)
    g_sparse = torch.autograd.grad((sparse * weight).sum(), inputs)
    g_dense = torch.autograd.grad((dense * weight).sum(), inputs)
    for a, b in zip(g_sparse, g_dense):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-9)


@SETTINGS
@given(attention_case(), st.sampled_from(["plain", "explicit", "bias", "repeats"]), st.sampled_from([1, 3, 128]))
def test_dense_topk_form_equals_the_sparse_core(case, variant, block):
    """`topk_dense_mla` (per-head keys, the top-k as a mask: what the CPU runs where it costs less) computes
    `sparse_mla`'s outputs and gradients in fp64, every query included (padding ones with no allowed key average
    their K rows in both), in blocks of `block` queries, with an explicit `allowed`
    (GLM-5.3's pooled selection), a float mask's bias, and rows selected twice (counted twice by both)."""
    cfg, B, T, seed, padded = case
    q_nope, q_rot, latent, kv_b, mask, idx = random_inputs(cfg, B, T, seed, padded)
    g = torch.Generator().manual_seed(seed)
    allowed = None
    if variant == "explicit":
        allowed = mask.at(idx) & (torch.rand(idx.shape, generator=g) > 0.3)
    if variant == "bias":
        dense = mask.rows(0, T).expand(B, T, T)
        mask = Mask(torch.arange(T), T, dense=dense, bias=torch.randn(B, T, T, generator=g, dtype=torch.float64))
    if variant == "repeats":
        idx = torch.where(torch.rand(idx.shape, generator=g) > 0.5, idx, idx[..., :1])
    inputs = [t.requires_grad_() for t in (q_nope, q_rot, latent, kv_b["kv_b_proj"]["weight"])]
    weight = torch.randn(B, T, cfg.num_attention_heads, cfg.v_head_dim, generator=g, dtype=torch.float64)
    sparse = sparse_mla(kv_b, q_nope, q_rot, latent, idx, mask, cfg, allowed_BxSxK=allowed)
    default, kernels.DENSE_BLOCK_QUERIES = kernels.DENSE_BLOCK_QUERIES, block
    try:
        dense = topk_dense_mla(kv_b, q_nope, q_rot, latent, idx, mask, cfg, allowed_BxSxK=allowed)
        assert torch.allclose(dense, sparse, atol=1e-12, rtol=1e-10)
        for a, b in zip(torch.autograd.grad((dense * weight).sum(), inputs),
                        torch.autograd.grad((sparse * weight).sum(), inputs)):
            assert torch.allclose(a, b, atol=1e-11, rtol=1e-9)
    finally:
        kernels.DENSE_BLOCK_QUERIES = default


def test_the_dense_topk_form_runs_where_it_costs_the_cpu_less():
    """`dense_topk_pays` at the bench's shapes (B4, index_topk 128): the dense form at 512 tokens, 8 and 16 heads
    (measured 1.3x and 1.9x faster a layer), the sparse core at 2048 (1.6x and 1.4x slower dense, measured with an
    autograd version), for one query (decoding), with a latent wider than the queries (fp64 sums), and off the CPU."""
    def pays(S, heads=8, rank=128, q_dtype=torch.float32, latent_dtype=torch.float32, device="cpu"):
        cfg = glm5f.preset("glm5-tiny", num_attention_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=64,
                           qk_rope_head_dim=32, v_head_dim=64, index_topk=128, index_head_dim=64)
        q = torch.empty(4, S, heads, 64, dtype=q_dtype, device=device)
        latent = torch.empty(4, S if S > 1 else 4096, rank + 32, dtype=latent_dtype, device=device)
        return dense_topk_pays(cfg, q, latent, 128, causal=True)
    assert pays(512) and pays(512, heads=16, rank=256)
    assert not pays(2048) and not pays(2048, heads=16, rank=256)
    assert not pays(1) and not pays(512, latent_dtype=torch.float64) and not pays(512, device="meta")


@pytest.mark.parametrize("topk_dense", [False, True])
def test_query_parts_run_as_cp_ranks_hold_the_queries(topk_dense):
    """parts=2 (--train.query_parts), the sparse core and the dense top-k form: part r holds the queries CP rank r
    of 2 holds (chunks r and 3 - r of 4) and runs alone, so every output is bit for bit the one that part computes
    by itself, and each latent row's gradient is the sum of the parts' gradients, each taken over its own queries
    (as CP ranks sum theirs), which in fp32 rounds differently from one sum over all queries."""
    cfg = small_cfg(num_attention_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                    index_topk=8)
    B, T = 2, 48
    q_nope, q_rot, latent, kv_b, mask, idx = random_inputs(cfg, B, T, 7, False)
    q_nope, q_rot, latent = (t.float().requires_grad_() for t in (q_nope, q_rot, latent))
    kv_b = {"kv_b_proj": {"weight": kv_b["kv_b_proj"]["weight"].float()}}
    weight = torch.randn(B, T, cfg.num_attention_heads, cfg.v_head_dim, generator=torch.Generator().manual_seed(1))
    split = mla_core(kv_b, q_nope, q_rot, latent, idx, mask, cfg, 2, topk_dense=topk_dense)
    whole = mla_core(kv_b, q_nope, q_rot, latent, idx, mask, cfg, 1, topk_dense=topk_dense)
    g_split = torch.autograd.grad((split * weight).sum(), latent, retain_graph=True)[0]
    g_whole = torch.autograd.grad((whole * weight).sum(), latent)[0]
    g_parts = []
    for r in range(2):
        i = torch.tensor(cp_position_list(T, 2, r))
        part = mla_core(kv_b, q_nope[:, i], q_rot[:, i], latent, idx[:, i], Mask(i, T), cfg, 1,
                        topk_dense=topk_dense)
        assert torch.equal(split[:, i], part)
        g_parts.append(torch.autograd.grad((part * weight[:, i]).sum(), latent)[0])
    assert torch.equal(g_split, g_parts[0] + g_parts[1])
    assert not torch.equal(g_split, g_whole) and torch.allclose(g_split, g_whole, rtol=1e-5, atol=1e-6)


def naive_mla(p, x, cfg, layer, ctx, prev_topk):
    """Plain causal MLA from the definition: per-head keys and values, a causal softmax, no DSA at all."""
    B, S, _ = x.shape
    q_nope, q_rot, _, latent = mla_project(p, x, cfg, ctx)
    kv = linear(p["kv_b_proj"], latent[..., :cfg.kv_lora_rank]).view(B, S, cfg.num_attention_heads, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    scores = (torch.einsum("bshn,bthn->bhst", q_nope, k_nope)
              + torch.einsum("bshp,btp->bhst", q_rot, latent[..., cfg.kv_lora_rank:])) * cfg.softmax_scale
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhst,bthv->bshv", scores.softmax(-1), v)
    return linear(p["o_proj"], out.reshape(B, S, -1)), None, {}


@SETTINGS
@given(st.integers(2, 24), st.integers(0, 2**31 - 1))
def test_dsa_with_topk_at_least_sequence_is_plain_mla(S, seed):
    cfg = glm5f.preset("glm5-tiny", index_topk=S + seed % 3)
    params = glm5f.init_params(cfg, seed=seed % 1000)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))
    ours = glm5f.forward(params, cfg, ids)
    plain = forward_by_layers(params, cfg, ids, env_of(cfg, ids.shape), attend=naive_mla)
    assert (ours - plain).abs().max() <= 1e-5
    # the sparse kernel over every key agrees with the dense path too
    x = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    ctx = env_of(cfg, (2, S))
    p = params["model"]["layers"][0]["self_attn"]
    q_nope, q_rot, _, latent = mla_project(p, x, cfg, ctx)
    all_keys = torch.arange(S).flip(0).expand(2, S, S)
    assert torch.allclose(sparse_mla(p, q_nope, q_rot, latent, all_keys, ctx.mask, cfg),
                          dense_mla(p, q_nope, q_rot, latent, ctx.mask, cfg), atol=1e-5)


def test_fewer_visible_keys_than_k_never_attends_masked_keys():
    cfg = glm5f.preset("glm5-tiny")  # index_topk 16
    params = glm5f.init_params(cfg)
    S = 24
    ids = torch.randint(0, cfg.vocab_size, (1, S))
    mask = torch.ones(1, S, dtype=torch.long)
    mask[0, :S - 5] = 0  # only 5 visible keys for the last queries, fewer than k
    ctx = env_of(cfg, (1, S), mask)
    x = F.embedding(ids, params["model"]["embed_tokens"]["weight"])
    p = params["model"]["layers"][0]["self_attn"]["indexer"]
    q = mla_project(params["model"]["layers"][0]["self_attn"], x, cfg, ctx)[2]
    idx = indexer_topk(*indexer_queries(p, x, q, cfg, ctx), indexer_keys(p, x, cfg, ctx), ctx.mask, cfg.index_topk)
    allowed = ctx.mask.at(idx)
    assert int(allowed[0, -1].sum()) == 5  # every visible key is chosen, the other picks are flagged masked
    # and masked picks carry no weight: the output equals attention over the visible keys only
    alone = glm5f.forward(params, cfg, ids[:, S - 5:])
    padded = glm5f.forward(params, cfg, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    assert (padded[0, S - 5:] - alone[0]).abs().max() <= 1e-5


def test_half_run_scores_the_indexer_in_its_own_precision(monkeypatch):
    """A bf16 forward hands the indexer's top-k bf16 queries and keys (on CUDA: the kernel's tensor cores) and fp32
    head weights; an fp32 forward fp32 ones. The narrowing loses nothing, so on the CPU every layer picks what the
    widened (fp32) inputs pick."""
    cfg = small_cfg(index_topk=8)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = []

    def spy(q, w, keys, *rest):
        picks = orig(q, w, keys, *rest)
        wide_picks = orig(q.float(), w, keys.float(), *rest)
        seen.append((q.dtype, w.dtype, keys.dtype, torch.equal(picks, wide_picks)))
        return picks

    orig = glm5f.kernels.dsa.indexer_topk
    monkeypatch.setattr(glm5f.kernels.dsa, "indexer_topk", spy)
    for dtype in (torch.bfloat16, torch.float32):
        seen.clear()
        glm5f.forward(glm5f.init_params(cfg, dtype=dtype), cfg, ids)
        assert len(seen) == cfg.num_hidden_layers
        assert seen == [(dtype, torch.float32, dtype, True)] * len(seen)

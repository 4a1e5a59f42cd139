"""glm5f/attention.py: the sparse path against a masked-dense oracle, DSA over every key as plain MLA (the model
written out layer by layer), and a query with fewer visible keys than k; equivalences searched by hypothesis."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from conftest import env_of, forward_by_layers
from glm5f.attention import dense_mla, indexer_keys, indexer_queries, indexer_topk, mla_project, sparse_mla
from glm5f.env import Mask
from glm5f.kernels import topk_as_mask, topk_first
from glm5f.ops import linear

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


def test_sparse_attention_in_query_parts_sums_each_parts_key_gradients_apart():
    """parts=2 (--train.query_parts): every output as with all queries at once, bit for bit; each latent row's
    gradient is the sum of the two halves' gradients, each taken over its own queries alone (each half run as a
    CP rank runs its queries), which in fp32 rounds differently from the one sum over all queries."""
    cfg = small_cfg(num_attention_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                    index_topk=8)
    B, T = 2, 48
    q_nope, q_rot, latent, kv_b, mask, idx = random_inputs(cfg, B, T, 7, False)
    q_nope, q_rot, latent = (t.float().requires_grad_() for t in (q_nope, q_rot, latent))
    kv_b = {"kv_b_proj": {"weight": kv_b["kv_b_proj"]["weight"].float()}}
    weight = torch.randn(B, T, cfg.num_attention_heads, cfg.v_head_dim, generator=torch.Generator().manual_seed(1))
    whole = sparse_mla(kv_b, q_nope, q_rot, latent, idx, mask, cfg)
    split = sparse_mla(kv_b, q_nope, q_rot, latent, idx, mask, cfg, parts=2)
    assert torch.equal(split, whole)
    g_split = torch.autograd.grad((split * weight).sum(), latent)[0]
    g_whole = torch.autograd.grad((whole * weight).sum(), latent, retain_graph=True)[0]
    g_halves = [torch.autograd.grad((sparse_mla(kv_b, q_nope[:, a:a + T // 2], q_rot[:, a:a + T // 2], latent,
                                                idx[:, a:a + T // 2], Mask(torch.arange(a, a + T // 2), T), cfg)
                                     * weight[:, a:a + T // 2]).sum(), latent)[0] for a in (0, T // 2)]
    assert torch.equal(g_split, g_halves[0] + g_halves[1])
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

    orig = glm5f.kernels.indexer_topk
    monkeypatch.setattr(glm5f.kernels, "indexer_topk", spy)
    for dtype in (torch.bfloat16, torch.float32):
        seen.clear()
        glm5f.forward(glm5f.init_params(cfg, dtype=dtype), cfg, ids)
        assert len(seen) == cfg.num_hidden_layers
        assert seen == [(dtype, torch.float32, dtype, True)] * len(seen)

"""Property tests: equivalences stated once, searched over shapes, seeds and masks by hypothesis."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, jacrev, vmap

import glm5f
import glm5f.model as model_mod
from conftest import env_of
from glm5f.attention import dense_mla, indexer_keys, indexer_queries, indexer_topk, mla_project, sparse_mla
from glm5f.env import Mask
from glm5f.kernels import sparse_attention, sparse_attention_unblocked, topk_as_mask, topk_first
from glm5f.decode import extend, init_cache
from glm5f.moe import routed_experts
from glm5f.ops import linear, swiglu_mlp

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
@given(st.integers(1, 2), st.integers(1, 40), st.integers(1, 12), st.integers(1, 3), st.integers(1, 50),
       st.sampled_from(["causal", "padded", "packed", "bias"]), st.booleans(), st.integers(0, 2**31 - 1))
def test_blocked_sparse_core_equals_unblocked_oracle(B, T, K, H, block, kind, cp_shard, seed):
    """The blocked core (query blocks, gathers recomputed in the backward) against the all-at-once oracle, fp64:
    values and both gradients, ragged last blocks, padding, packed documents, an additive bias, a CP-like shard
    of the queries (global keys, local queries)."""
    g = torch.Generator().manual_seed(seed)
    K, R, P = min(K, T), 6, 2
    q_index = torch.arange(T)
    if cp_shard and T > 1:  # this rank's queries: a contiguous share of the sequence, as a CP chunk
        a = int(torch.randint(0, T - 1, (1,), generator=g))
        q_index = q_index[a:int(torch.randint(a + 1, T + 1, (1,), generator=g))]
    S = q_index.numel()
    key_valid = torch.rand(B, T, generator=g) > 0.3 if kind == "padded" else None
    seg = torch.randint(0, 3, (B, T), generator=g).sort(-1).values if kind == "packed" else None
    mask = Mask(q_index, T, key_valid=key_valid, q_segment=None if seg is None else seg[:, q_index], k_segment=seg)
    scores = torch.randn(B, S, T, generator=g).masked_fill(~mask.rows(0, S), float("-inf"))
    idx = topk_first(scores, K)
    allowed = mask.at(idx)
    bias = torch.randn(B, S, K, generator=g, dtype=torch.float64) if kind == "bias" else None
    q = torch.randn(B, S, H, R + P, generator=g, dtype=torch.float64).requires_grad_()
    latent = torch.randn(B, T, R + P, generator=g, dtype=torch.float64).requires_grad_()
    blocked = sparse_attention(q, latent, idx, allowed, 0.7, R, bias, block=block)
    oracle = sparse_attention_unblocked(q, latent, idx, allowed, 0.7, R, bias)
    assert torch.allclose(blocked, oracle, atol=1e-12, rtol=1e-10)
    w = torch.randn(blocked.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((blocked * w).sum(), (q, latent)),
                    torch.autograd.grad((oracle * w).sum(), (q, latent))):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)


def test_blocked_sparse_core_under_torch_func_matches_autograd():
    """torch.func.grad and vmap route through the unblocked oracle; they agree with eager autograd through the
    blocked core."""
    g = torch.Generator().manual_seed(0)
    B, S, T, H, R, P, K = 2, 9, 11, 3, 6, 2, 4
    q = torch.randn(B, S, H, R + P, generator=g, dtype=torch.float64)
    latent = torch.randn(B, T, R + P, generator=g, dtype=torch.float64)
    idx = topk_first(torch.randn(B, S, T, generator=g), K)
    allowed = idx <= torch.arange(S)[None, :, None]
    f = lambda q_, lat_: sparse_attention(q_, lat_, idx, allowed, 0.5, R, block=2).square().sum()  # noqa: E731
    eager = torch.autograd.grad(f(q.requires_grad_(), latent.requires_grad_()), (q, latent))
    func = grad(f, argnums=(0, 1))(q.detach(), latent.detach())
    for a, b in zip(eager, func):
        assert torch.allclose(a, b, atol=1e-12)
    per_example = vmap(lambda q1, l1, i1, a1: sparse_attention(q1[None], l1[None], i1[None], a1[None], 0.5, R)[0])(
        q.detach(), latent.detach(), idx, allowed)
    assert torch.allclose(per_example, sparse_attention(q.detach(), latent.detach(), idx, allowed, 0.5, R, block=3))


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
    orig = model_mod.attention
    model_mod.attention = naive_mla
    try:
        plain = glm5f.forward(params, cfg, ids)
    finally:
        model_mod.attention = orig
    assert (ours - plain).abs().max() <= 1e-5
    # the sparse kernel over every key agrees with the dense path too
    x = torch.randn(2, S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    ctx = env_of(cfg, (2, S))
    p = params["model"]["layers"][0]["self_attn"]
    q_nope, q_rot, _, latent = mla_project(p, x, cfg, ctx)
    all_keys = torch.arange(S).flip(0).expand(2, S, S)
    assert torch.allclose(sparse_mla(p, q_nope, q_rot, latent, all_keys, ctx.mask, cfg),
                          dense_mla(p, q_nope, q_rot, latent, ctx.mask, cfg), atol=1e-5)


@SETTINGS
@given(st.integers(1, 40), st.integers(1, 64), st.sampled_from([5, 8, 16]), st.sampled_from([3, 4, 8]),
       st.integers(1, 8), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_grouped_moe_equals_per_expert_oracle(N, D, F_, E, K, _, seed):
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    experts = {"gate_proj": {"weight": torch.randn(E, F_, D, generator=g) * D ** -0.5},
               "up_proj": {"weight": torch.randn(E, F_, D, generator=g) * D ** -0.5},
               "down_proj": {"weight": torch.randn(E, D, F_, generator=g) * F_ ** -0.5}}
    x = torch.randn(N, D, generator=g)
    idx = torch.rand(N, E, generator=g).argsort(-1)[:, :K]
    w = torch.rand(N, K, generator=g)
    leaves = [x, w, *(experts[k]["weight"] for k in ("gate_proj", "up_proj", "down_proj"))]
    for t in leaves:
        t.requires_grad_()

    def oracle(x, w, gate, up, down):
        every_NxD = vmap(lambda g_, u_, d_: swiglu_mlp(
            {"gate_proj": {"weight": g_}, "up_proj": {"weight": u_}, "down_proj": {"weight": d_}}, x))(gate, up, down)
        return (every_NxD[idx, torch.arange(N)[:, None]] * w[..., None]).sum(1)

    ours = routed_experts(experts, x, idx, w, E)
    ref = oracle(*leaves)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn(N, D, generator=g)
    for a, b in zip(torch.autograd.grad((ours * cot).sum(), leaves), torch.autograd.grad((ref * cot).sum(), leaves)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(st.integers(1, 30), st.integers(0, 30), st.integers(0, 2**31 - 1))
def test_cached_decode_equals_full_forward(prompt, new, seed):
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=seed % 997)
    S = prompt + new
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(seed))
    full = glm5f.forward(params, cfg, ids)
    cache = init_cache(cfg, 2, S)
    pos = torch.arange(S).expand(2, S)
    steps = [extend(params, cfg, cache, ids[:, :prompt], pos[:, :prompt])]
    steps += [extend(params, cfg, cache, ids[:, t:t + 1], pos[:, t:t + 1]) for t in range(prompt, S)]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.integers(18, 28), st.integers(0, 2**31 - 1))
def test_causality_through_gradients(S, seed):
    """The output at position t has zero derivative with respect to every input after t (torch.func.jacrev)."""
    cfg = glm5f.preset("glm5-tiny")  # index_topk 16 < S: sparse attention, shared indexer layer, MoE
    params = glm5f.init_params(cfg, seed=seed % 991)
    ctx = env_of(cfg, (1, S))
    x = torch.randn(1, S, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    probe = torch.randn(cfg.vocab_size, generator=torch.Generator().manual_seed(seed + 1))

    def per_position(x):
        return model_mod.apply_embeds(params, cfg, x, ctx)[0][0] @ probe  # [S]

    jac_SxS = jacrev(per_position)(x)[:, 0].abs().sum(-1)  # d out[t] / d x[s]
    assert torch.all(jac_SxS.triu(1) == 0)
    assert torch.all(jac_SxS.diagonal() > 0)
    t = S // 2
    g = grad(lambda x: per_position(x)[t])(x)
    assert torch.all(g[0, t + 1:] == 0) and g[0, : t + 1].abs().sum() > 0


@SETTINGS
@given(st.lists(st.integers(1, 40), min_size=2, max_size=3), st.integers(0, 2**31 - 1))
def test_padding_does_not_change_real_tokens(lengths, seed):
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=seed % 983)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    alone = [glm5f.forward(params, cfg, s[None])[0] for s in seqs]
    S = max(lengths)
    right = torch.zeros(len(seqs), S, dtype=torch.long)
    left = torch.zeros(len(seqs), S, dtype=torch.long)
    rmask, lmask = torch.zeros_like(right), torch.zeros_like(left)
    for i, s in enumerate(seqs):
        right[i, :len(s)], rmask[i, :len(s)] = s, 1
        left[i, S - len(s):], lmask[i, S - len(s):] = s, 1
    out_r = glm5f.forward(params, cfg, right, attention_mask=rmask)
    out_l = glm5f.forward(params, cfg, left, attention_mask=lmask,
                          position_ids=(lmask.cumsum(-1) - 1).clamp(min=0))
    for i, s in enumerate(seqs):
        assert (out_r[i, :len(s)] - alone[i]).abs().max() <= 1e-5
        assert (out_l[i, S - len(s):] - alone[i]).abs().max() <= 1e-5


def test_topk_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, -0.0, 0.0, float("-inf"), 2.0]])
    assert topk_first(scores, 4).sort().values.tolist() == [[0, 1, 2, 6]]
    assert topk_first(torch.tensor([[-1.5, -0.5, -2.0, -0.5]]), 2).sort().values.tolist() == [[1, 3]]


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


@SETTINGS
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.float64]))
def test_topk_first_is_a_stable_descending_sort(T, seed, dtype):
    """topk_first picks what a stable sort by descending fp32 score picks: ties (ReLU zeros, -0.0 and +0.0, -inf,
    repeated negatives) go to the lower index."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0.0, -0.0, 1.5, -1.5, 2.0**-140, -3.0, float("-inf"), float("inf")], dtype=dtype)
    scores = torch.where(torch.rand(3, T, generator=g) < 0.5, pool[torch.randint(0, len(pool), (3, T), generator=g)],
                         torch.randn(3, T, generator=g, dtype=dtype))
    k = int(torch.randint(1, T + 1, (), generator=g))
    want = torch.sort(scores.float() + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(topk_first(scores, k).sort().values, want.sort().values)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(block=st.integers(1, 3000), lo=st.integers(0, 40), n=st.integers(1, 40), lo1=st.integers(0, 8),
       n1=st.integers(1, 64))
def test_init_of_a_region_is_that_part_of_the_whole_init(block, lo, n, lo1, n1):
    """init_params(region=...) makes each leaf's part alone, block of rows by block of rows, equal to the same part
    of the whole init; the blocks (INIT_BLOCK_ELEMS elements) cut through the region anywhere."""
    import glm5f.params as params_mod

    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS", pad_token_id=7)
    whole = glm5f.flatten(glm5f.init_params(cfg, seed=1))
    old = params_mod.INIT_BLOCK_ELEMS
    params_mod.INIT_BLOCK_ELEMS = block
    try:
        def region(path, shape):
            if not shape:
                return ()
            return (slice(min(lo, shape[0]), min(lo + n, shape[0])),
                    *((slice(min(lo1, shape[1]), min(lo1 + n1, shape[1])),) if len(shape) > 1 else ()),
                    *(slice(0, d) for d in shape[2:]))
        parts = glm5f.flatten(glm5f.init_params(cfg, seed=1, region=region))
        blocked = glm5f.flatten(glm5f.init_params(cfg, seed=1))
    finally:
        params_mod.INIT_BLOCK_ELEMS = old
    for k, t in whole.items():
        assert torch.equal(parts[k], blocked[k][region(k, tuple(t.shape))]), k
        if blocked[k].numel() <= block:  # one block: the values of the unblocked init
            assert torch.equal(blocked[k], t), k

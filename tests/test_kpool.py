"""glm5f/model/kpool.py: the pooled indexer's pool keys and selected tokens against Transformers' Glm5NextTextIndexer
(pool sizes 1, 2, 4; with and without the tail; left and right padding), packed documents against each document
alone, and equal pool scores going to the lower pool."""

import pytest
import torch

from conftest import stable_topk
from glm5f.model.env import make_mask
from glm5f.model.kpool import index_key_and_gate, pool_keys, pooled_indexer, pooled_selection, pools


def hf_indexer(kpool, tail, topk=8, D=32, Q=16, I=8, J=16, seed=0, dtype=torch.float32):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = Glm5NextTextConfig(hidden_size=D, q_lora_rank=Q, index_n_heads=I, index_head_dim=J, index_topk=topk,
                             index_kpool=kpool, index_kpool_always_select_tail=tail, num_hidden_layers=4)
    torch.manual_seed(seed)
    module = Glm5NextTextIndexer(cfg, 0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)
    return module.to(dtype).eval()


def params_of(module):
    sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"wq_b": {"weight": sd["wq_b.weight"]}, "wk": {"weight": sd["wk.weight"]},
            "k_norm": {"weight": sd["k_norm.weight"], "bias": sd["k_norm.bias"]},
            "weights_proj": {"weight": sd["weights_proj.weight"]},
            "index_kpool_compress_ape": sd["index_kpool_compress_ape"],
            "index_kpool_compress_gate": sd["index_kpool_compress_gate"]}


def as_sets(idx_BxSxW, allowed_BxSxW, T):
    """[B, S, T] bool: the tokens each query attends."""
    B, S, _ = idx_BxSxW.shape
    out = torch.zeros(B, S, T + 1, dtype=torch.bool)
    out.scatter_(2, torch.where(allowed_BxSxW, idx_BxSxW.long(), T), True)
    return out[..., :T]


def padding(B, T):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T - 5:] = False  # right padding
    mask[1, :7] = False  # left padding: pools start at the first real token
    return mask


@pytest.mark.parametrize("kpool", [1, 2, 4])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_selection_matches_transformers(kpool, tail, padded):
    B, T, D, Q = 3, 29, 32, 16
    module = hf_indexer(kpool, tail)
    g = torch.Generator().manual_seed(kpool + 10 * tail)
    x, q_latent = torch.randn(B, T, D, generator=g), torch.randn(B, T, Q, generator=g)
    attention_mask = padding(B, T) if padded else torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad(), stable_topk():
        ref = module(x, q_latent, attention_mask, None)
    assert ref.shape[-1] == 8 + (kpool - 1 if tail else 0)
    p = params_of(module)
    mask = make_mask(attention_mask.long() if padded else None, torch.arange(T).expand(B, T), packed=False)
    with torch.no_grad():
        idx, allowed = pooled_indexer(p, x, q_latent, index_key_and_gate(p, x), mask, 8, kpool, tail)
    assert idx.shape[-1] == 8 + (kpool - 1 if tail else 0)
    ours, theirs = as_sets(idx, allowed, T), as_sets(ref, ref >= 0, T)
    real = attention_mask
    assert torch.equal(ours[real], theirs[real])
    assert not ours[~real].any()
    assert (ours.sum(-1) < T).any(), "some query must see fewer than all its keys (the selection is sparse)"
    if tail or kpool == 1:  # every real query sees a key: its own complete pool is a candidate, or its tail
        assert ours.any(-1)[real].all()
    else:  # the queries before their first complete pool see none
        assert not ours.any(-1)[real].all()


def test_pool_keys_match_transformers():
    kpool, B, T = 4, 2, 19
    module = hf_indexer(kpool, True)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones(B, T, dtype=torch.bool)
    attention_mask[1, :3] = False
    p = params_of(module)
    kg = index_key_and_gate(p, x)
    packed = torch.cat([kg, attention_mask[..., None].float()], dim=-1)
    with torch.no_grad():
        ref_keys, ref_idx, ref_valid = module.get_pooled_states(packed)
        where = pools(make_mask(attention_mask.long(), torch.arange(T).expand(B, T)), B, kpool)
        ours = pool_keys(kg[..., :16], kg[..., 16:], p["index_kpool_compress_ape"], where, kpool)
    for b in range(B):
        for j in range(ref_keys.shape[1]):
            end = int(ref_idx[b, j, -1])
            if ref_valid[b, j]:
                assert where.end[b, end] and (ours[b, end] - ref_keys[b, j]).abs().max() <= 1e-6
    assert int(where.end.sum()) == int(ref_valid.sum())


def test_packed_documents_pool_as_each_document_alone():
    kpool, topk, D, Q = 2, 4, 32, 16
    module = hf_indexer(kpool, True, topk=topk)
    p = params_of(module)
    lengths = [7, 12, 6]
    g = torch.Generator().manual_seed(7)
    x, q_latent = torch.randn(1, sum(lengths), D, generator=g), torch.randn(1, sum(lengths), Q, generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    T = sum(lengths)
    with torch.no_grad():
        idx, allowed = pooled_indexer(p, x, q_latent, index_key_and_gate(p, x), make_mask(None, positions), topk,
                                      kpool, True)
        packed = as_sets(idx, allowed, T)[0]
        start = 0
        for n in lengths:
            xs, qs = x[:, start:start + n], q_latent[:, start:start + n]
            i, a = pooled_indexer(p, xs, qs, index_key_and_gate(p, xs), make_mask(None, torch.arange(n)[None]),
                                  topk, kpool, True)
            alone = as_sets(i, a, n)[0]
            assert torch.equal(packed[start:start + n, start:start + n], alone)
            assert not packed[start:start + n, :start].any() and not packed[start:start + n, start + n:].any()
            start += n


def test_equal_pool_scores_go_to_the_lower_pool():
    """Every pool scores the same (zero keys): each query takes its lowest-indexed candidate pools."""
    kpool, topk, T = 2, 4, 12
    where = pools(make_mask(None, torch.arange(T)[None], packed=False), 1, kpool)
    q, w = torch.randn(1, T, 2, 4), torch.rand(1, T, 2)
    idx, allowed = pooled_selection(q, w, torch.zeros(1, T, 4), where, make_mask(None, torch.arange(T)[None]), topk,
                                    kpool, False)
    sets = as_sets(idx, allowed, T)[0]
    for s in range(T):
        complete = (s + 1) // kpool
        want = torch.zeros(T, dtype=torch.bool)
        want[:min(complete, topk // kpool) * kpool] = True
        assert torch.equal(sets[s], want), s


def nested(flat: dict) -> dict:
    """{"a.b.c": t} -> {"a": {"b": {"c": t}}}."""
    out = {}
    for key, t in flat.items():
        *head, last = key.split(".")
        node = out
        for h in head:
            node = node.setdefault(h, {})
        node[last] = t
    return out


@pytest.mark.parametrize("kpool,tail", [(1, False), (2, True), (4, True), (2, False), (4, False)])
@pytest.mark.parametrize("padded", [False, True])
def test_dsa_layer_matches_transformers_eager(kpool, tail, padded):
    """NoPE MLA over the pooled selection (sparse_mla with the selection's own allowed mask) against Transformers'
    attention module in eager mode. Without the tail, a query before its document's first complete pool has no
    key: Transformers' eager softmax then spreads it over every position (its sdpa path gives NaN); here it
    attends to nothing (zero output), and only the queries with a key are compared."""
    import glm5f
    from glm5f.model.attention import attention
    from glm5f.model.env import make_env
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    cfg = glm5f.preset("glm53-tiny", index_kpool=kpool, index_kpool_always_select_tail=tail, index_topk=8,
                       index_n_heads=8)
    from transformers import Glm5NextConfig
    text = Glm5NextConfig(**cfg.to_hf()).text_config
    text._attn_implementation = "eager"
    torch.manual_seed(kpool)
    module = Glm5NextTextAttention(text, 1).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    B, T = 3, 27
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    attention_mask = padding(B, T) if padded else torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad(), stable_topk():
        ref = module(x, attention_mask)[0]
    p = nested({k: v.detach() for k, v in module.state_dict().items()})
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long)}
    if padded:
        batch["attention_mask"] = attention_mask.long()
    _, env = make_env(cfg, batch, torch.float32)
    with torch.no_grad():
        ours, _, _ = attention(p, x, cfg, 1, env, None)
        idx, allowed = pooled_indexer(p["indexer"], x, module.q_a_layernorm(module.q_a_proj(x)),
                                      index_key_and_gate(p["indexer"], x), env.mask, 8, kpool, tail)
    has_key = allowed.any(-1) & attention_mask
    assert (ours - ref)[has_key].abs().max() <= 1e-6, (ours - ref)[has_key].abs().max()
    assert (ours[~allowed.any(-1)] == 0).all()
    assert has_key.sum() < attention_mask.sum() if not tail and kpool > 1 else torch.equal(has_key, attention_mask)

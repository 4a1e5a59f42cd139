"""glm5f/core/layers.py: what each layer is follows the config's schedules, and every per-layer table (parameters, decode
cache, FLOPs) follows what the layer is."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from glm5f.core.flops import flops_per_token
from glm5f.core.layers import LayerSpec, layer_cache, layer_spec
from glm5f.core.params import param_layout

@settings(max_examples=20, deadline=None, derandomize=True)
@given(pattern=st.lists(st.sampled_from("FS"), min_size=1, max_size=5).map(lambda s: "F" + "".join(s)),
       dense=st.integers(0, 6), mtp=st.integers(0, 2))
def test_layer_spec_follows_the_schedules_and_the_tables_follow_the_spec(pattern, dense, mtp):
    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=len(pattern), index_topk_pattern=pattern,
                       first_k_dense_replace=dense, num_nextn_predict_layers=mtp)
    layers = param_layout(cfg)["model"]["layers"]
    L = cfg.num_hidden_layers
    for i in range(L + mtp):
        spec = layer_spec(cfg, i)
        # the schedule as written: F/S per main layer, dense for the first `dense`; MTP layers index on their own
        # and take the last main layer's MLP
        indexer = {"F": "full", "S": "shared"}[pattern[i]] if i < L else "full"
        mlp = "dense" if min(i, L - 1) < dense else "moe"
        assert spec == LayerSpec("mla_dsa", indexer, mlp, "plain"), (i, spec)
        assert ("indexer" in layers[i]["self_attn"]) == (indexer == "full")
        assert ("experts" in layers[i]["mlp"]) == (mlp == "moe")
        if i < L:
            cache = layer_cache(cfg, i, 2, 5, torch.float32, "cpu")
            assert sorted(cache) == (["index_keys", "latent"] if indexer == "full" else ["latent"])
            assert tuple(cache["latent"].shape) == (2, 5, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_flops_count_each_layer_by_its_kinds():
    """Turning one shared layer into a full one adds exactly one indexer's forward FLOPs (by hand: wq_b, wk,
    weights_proj, and per visible key the scores and head weights); turning one MoE layer dense swaps the
    routed and shared slots for a dense MLP."""
    seq = 40
    a = glm5f.preset("glm5-tiny", index_topk_pattern="FFS")
    b = glm5f.preset("glm5-tiny", index_topk_pattern="FFF")
    D, Q, I, J = a.hidden_size, a.q_lora_rank, a.index_n_heads, a.index_head_dim
    indexer = Q * I * J + D * J + D * I + (seq + 1) / 2 * I * (J + 1)
    assert flops_per_token(b, seq) - flops_per_token(a, seq) == 2 * indexer
    c = glm5f.preset("glm5-tiny", first_k_dense_replace=2)
    F = a.moe_intermediate_size
    moe = D * a.n_routed_experts + 3 * D * F * (a.num_experts_per_tok + a.n_shared_experts)
    assert flops_per_token(c, seq) - flops_per_token(a, seq) == 2 * 3 * (3 * D * a.intermediate_size - moe)

"""Per-dimension logical axes: every leaf names each of its dims (params.LEAF_KINDS), the placements derived from
them by parallel.MESH_RULES are those of the former per-kind table, and layers take head counts from shapes
(attention over a subset of heads is that subset's share of the output, as tensor parallelism would compute it)."""

import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import glm5f
from glm5f.model.attention import attention
from glm5f.parallel.layout import placements
from glm5f.model.env import make_env
from glm5f.core.ops import swiglu_mlp
from glm5f.core.params import Leaf, flatten, leaf_kind, param_layout

# The table this replaced, frozen: one logical kind per leaf ("experts" for the stacked routed experts, "any" for
# the rest) and the (mesh, stored, gathered, gradient) placements of each kind.
OLD_KIND = [(re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$"), "experts"),
            (re.compile(r""), "any")]
OLD_MESH_RULES = {
    "any": ("fsdp", [Shard(0)], [Replicate()], [Partial()]),
    "experts": ("experts", [Shard(1), Shard(0)], [Replicate(), Shard(0)], [Partial(), Shard(0)]),
}


def layouts():
    """The leaves of a small MoE config with every optional leaf: biases, MTP layers with their own embedding and
    head, dense and MoE layers, full and shared indexer layers."""
    cfg = glm5f.preset("glm5-tiny", attention_bias=True, num_nextn_predict_layers=2, tie_word_embeddings=False)
    return flatten(param_layout(cfg, ("embed_tokens", "shared_head.head")), is_leaf=lambda x: isinstance(x, Leaf))


def test_every_dim_of_every_leaf_is_named():
    leaves = layouts()
    assert any(".mlp.experts." in p for p in leaves) and any(".indexer." in p for p in leaves)
    assert any("q_a_proj.bias" in p for p in leaves) and any("shared_head.head" in p for p in leaves)
    for path, leaf in leaves.items():
        assert len(leaf_kind(path).axes) == len(leaf.shape), path
    with pytest.raises(ValueError, match="no row of params.LEAF_KINDS matches the leaf model.adapter.weight"):
        leaf_kind("model.adapter.weight")
    with pytest.raises(ValueError, match="the logical axis 'rank' has no row in parallel.MESH_RULES"):
        placements(("rank", "embed"))


def test_derived_placements_are_the_old_tables():
    """Every leaf's (mesh, stored, gathered, gradient) placements derived from its axes equal the former table's."""
    for path in layouts():
        old = next(kind for pattern, kind in OLD_KIND if pattern.search("." + path))
        assert placements(leaf_kind(path).axes) == OLD_MESH_RULES[old], path
    # and by name, a few whose axes differ from their neighbours'
    assert placements(leaf_kind("model.layers.1.mlp.experts.down_proj.weight").axes)[:2] == \
        ("experts", [Shard(1), Shard(0)])
    assert placements(leaf_kind("model.layers.1.mlp.gate.weight").axes)[:2] == ("fsdp", [Shard(0)])
    assert placements(leaf_kind("model.layers.0.self_attn.o_proj.weight").axes)[:2] == ("fsdp", [Shard(0)])


def halves(p: dict, cfg, part: int) -> dict:
    """Layer params holding the heads of half `part` only: q_b_proj / kv_b_proj rows and o_proj columns of those
    heads (the o_proj bias on half 0), everything else whole: one rank's share under 2-way tensor parallelism.
    The config still says the full head count: the layers read it from the shapes."""
    H = cfg.num_attention_heads
    heads = slice(part * H // 2, (part + 1) * H // 2)

    def rows(w, per_head):
        return w.unflatten(0, (H, per_head))[heads].flatten(0, 1)
    q = {"weight": rows(p["q_b_proj"]["weight"], cfg.qk_head_dim)}
    kv = {"weight": rows(p["kv_b_proj"]["weight"], cfg.qk_nope_head_dim + cfg.v_head_dim)}
    o = {"weight": p["o_proj"]["weight"].unflatten(1, (H, cfg.v_head_dim))[:, heads].flatten(1)}
    if "bias" in p["o_proj"]:
        o["bias"] = p["o_proj"]["bias"] * (part == 0)
    return {**p, "q_b_proj": q, "kv_b_proj": kv, "o_proj": o}


@pytest.mark.parametrize("S", [12, 40])  # dense (every key) and sparse (index_topk 16 < 40 keys)
def test_attention_over_half_the_heads_is_half_the_sum(S):
    """Attention with the weights of half the heads (head counts taken from the shapes) gives that half's
    share of o_proj's output: the two halves sum to the whole layer's output (fp64, to rounding), as the all-reduce
    after o_proj would under tensor parallelism; likewise the MLP split over its hidden width, after down_proj."""
    cfg = glm5f.preset("glm5-tiny", attention_bias=True)
    params = glm5f.init_params(cfg, seed=1, dtype=torch.float64)
    x = torch.randn(2, S, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, env = make_env(cfg, {"input_ids": torch.zeros(2, S, dtype=torch.long)}, torch.float64)
    p = params["model"]["layers"][0]["self_attn"]
    whole, _, _ = attention(p, x, cfg, 0, env, None)
    parts = [attention(halves(p, cfg, part), x, cfg, 0, env, None)[0] for part in (0, 1)]
    assert not torch.allclose(parts[0], whole, atol=1e-3)  # each half is a real part, not the whole
    # fp64: the two halves reorder o_proj's sum over H * V = 64 terms of size ~1, an error of ~64 * 2^-53 << 1e-12
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)

    mlp = params["model"]["layers"][0]["mlp"]
    F = cfg.intermediate_size
    w = {name: mlp[name]["weight"] for name in ("gate_proj", "up_proj", "down_proj")}
    cut = [{"gate_proj": {"weight": w["gate_proj"][sl]}, "up_proj": {"weight": w["up_proj"][sl]},
            "down_proj": {"weight": w["down_proj"][:, sl]}}
           for sl in (slice(0, F // 2), slice(F // 2, F))]
    torch.testing.assert_close(swiglu_mlp(cut[0], x) + swiglu_mlp(cut[1], x), swiglu_mlp(mlp, x), rtol=1e-12,
                               atol=1e-12)


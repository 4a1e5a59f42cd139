"""GLM-5.3 (Transformers' glm5_next): its config read from and written as Transformers' (nested and flat, the
aliases Transformers accepts), the checks of a config Transformers would reject, and the SwiGLU clamp against
Transformers' MLP and experts."""

import json

import pytest
import torch

import glm5f
from glm5f.moe import expert_ffn
from glm5f.ops import swiglu_mlp

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   projection_intermediate_size=64)


def hf_config(cfg):
    from transformers import Glm5NextConfig

    return Glm5NextConfig(**cfg.to_hf(), vision_config=TINY_VISION)


@pytest.mark.parametrize("name", ["glm53", "glm53-scaled", "glm53-tiny"])
def test_config_round_trip_with_transformers(name):
    cfg = glm5f.preset(name)
    hf = hf_config(cfg)
    text = hf.text_config
    for field in ("layer_types", "indexer_types", "mlp_layer_types"):
        assert list(getattr(text, field)) == list(getattr(cfg, field)), field
    for field in ("hc_mult", "hc_eps", "hc_sinkhorn_iters", "swiglu_limit", "index_kpool",
                  "index_kpool_always_select_tail", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                  "linear_lower_bound", "qk_rope_head_dim", "index_topk", "hidden_size", "num_hidden_layers"):
        assert getattr(text, field) == getattr(cfg, field), field
    saved = json.loads(hf.to_json_string())
    assert glm5f.GLM5Config.from_hf(saved) == cfg  # nested: text_config beside vision_config
    flat = {**saved.pop("text_config"), **{k: v for k, v in saved.items() if k != "vision_config"}}
    assert glm5f.GLM5Config.from_hf({**flat, "model_type": "glm5_next"}) == cfg  # flat: text fields at the top


def test_fields_left_out_take_transformers_defaults_and_aliases():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    given = dict(num_hidden_layers=6, layer_types=["linear_attention"] * 5 + ["full_attention"],
                 linear_attn_config={"head_dim": 32, "num_heads": 8, "short_conv_kernel_size": 3,
                                     "gate_lower_bound": None, "safe_gate": False},
                 index_topk_pattern="FFFFFF")
    ours = glm5f.GLM5Config.from_hf({"model_type": "glm5_next", "text_config": given})
    theirs = Glm5NextTextConfig(**given)
    for field in ("hidden_size", "vocab_size", "layer_types", "linear_head_dim", "linear_num_heads",
                  "linear_conv_kernel_dim", "linear_lower_bound", "hc_mult", "index_kpool", "swiglu_limit",
                  "mlp_layer_types", "indexer_types", "pad_token_id", "n_routed_experts"):
        assert list(getattr(ours, field)) == list(getattr(theirs, field)) if field.endswith("types") else \
            getattr(ours, field) == getattr(theirs, field), field
    assert ours.layer_types[-1] == "indexed_attention" and ours.linear_lower_bound is None


@pytest.mark.parametrize("changes,message", [
    (dict(qk_rope_head_dim=8), "qk_rope_head_dim must be 0"),
    (dict(index_topk=9), "must be divisible by index_kpool"),
    (dict(layer_types=("linear_attention",) * 3), "layer_types has 3 entries for 4 layers"),
    (dict(layer_types=("linear_attention", "sliding_attention") * 2), "layer_types may hold"),
    (dict(hc_mult=0), "hc_mult must be positive"),
    (dict(indexer_types=("full", "full", "full", "shared")), "a shared DSA layer must directly follow a DSA"),
    (dict(indexer_types=("full", "shared", "full", "full")), "first layer's indexer must be 'full'"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers must be 0"),
    (dict(model_type="glm6"), "model_type must be one of"),
])
def test_invalid_glm53_configs(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        glm5f.preset("glm53-tiny", **changes)


def test_glm5_configs_have_no_glm53_parts():
    with pytest.raises(ValueError, match="swiglu_limit=10.0 is a GLM-5.3 field"):
        glm5f.preset("glm5-tiny", swiglu_limit=10.0)
    with pytest.raises(ValueError, match="index_kpool=4 is a GLM-5.3 field"):
        glm5f.preset("glm5-tiny", index_kpool=4)
    assert "hc_mult" not in glm5f.preset("glm5-tiny").to_hf()


def test_preset_depth_override_derives_the_schedule():
    cfg = glm5f.preset("glm53-tiny", num_hidden_layers=8)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",) + ("linear_attention",) * 3 + (
        "indexed_attention",)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_clamped_swiglu_matches_transformers_mlp_and_experts(dtype, tol):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextExperts, Glm5NextTextMLP

    cfg = glm5f.preset("glm53-tiny", swiglu_limit=0.7)
    text = hf_config(cfg).text_config
    torch.manual_seed(0)
    mlp = Glm5NextTextMLP(text).to(dtype)
    x = torch.randn(5, 7, cfg.hidden_size, dtype=dtype) * 3  # wide enough that the clamp bites on both sides
    p = {n: {"weight": getattr(mlp, n).weight.detach()} for n in ("gate_proj", "up_proj", "down_proj")}
    gate, up = x @ p["gate_proj"]["weight"].T, x @ p["up_proj"]["weight"].T
    assert (gate > 0.7).any() and (up < -0.7).any() and (up > 0.7).any() and (gate < -0.7).any()
    with torch.no_grad():
        assert (swiglu_mlp(p, x, cfg.swiglu_limit) - mlp(x)).abs().max() <= tol
        assert (swiglu_mlp(p, x) - mlp(x)).abs().max() > 1e-2  # unclamped differs
    experts = Glm5NextTextExperts(text).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.5)
        experts.down_proj.normal_(0, 0.5)
    E, F_ = cfg.n_routed_experts, cfg.moe_intermediate_size
    rows = x.reshape(-1, cfg.hidden_size)
    idx = torch.arange(rows.shape[0]) % E
    pe = {"gate_proj": {"weight": experts.gate_up_proj.detach()[:, :F_]},
          "up_proj": {"weight": experts.gate_up_proj.detach()[:, F_:]},
          "down_proj": {"weight": experts.down_proj.detach()}}
    order = torch.argsort(idx, stable=True)
    counts = torch.bincount(idx, minlength=E)
    with torch.no_grad():
        ours = torch.empty_like(rows)
        ours[order] = expert_ffn(pe, rows[order], counts, cfg.swiglu_limit)
        theirs = experts(rows, idx[:, None], torch.ones(rows.shape[0], 1, dtype=dtype))
    assert (ours - theirs).abs().max() <= tol

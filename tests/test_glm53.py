"""GLM-5.3 (Transformers' glm5_next): its config read from and written as Transformers' (nested and flat, the
aliases Transformers accepts), the checks of a config Transformers would reject, and the SwiGLU clamp against
Transformers' MLP and experts."""

import dataclasses
import json

import pytest
import torch

import glm5f
from glm5f.model.moe import expert_ffn
from glm5f.core.ops import swiglu_mlp

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


def test_config_fields_are_read_where_transformers_keeps_them():
    """Whether the head is tied lives at the top of a glm5_next config (Transformers ties by it; its text_config
    keeps its default), the text model's fields in text_config: a refused hidden_act names the value found there."""
    from transformers import Glm5NextConfig

    tied = dataclasses.replace(glm5f.preset("glm53-tiny"), tie_word_embeddings=True)
    text = {k: v for k, v in tied.to_hf()["text_config"].items() if k != "tie_word_embeddings"}
    saved = json.loads(Glm5NextConfig(text_config=text, vision_config=TINY_VISION,
                                      tie_word_embeddings=True).to_json_string())
    assert saved["tie_word_embeddings"] is True and saved["text_config"]["tie_word_embeddings"] is False
    assert glm5f.GLM5Config.from_hf(saved) == tied  # before: untied, so its checkpoint's missing lm_head mismatched
    saved["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match=r"config has hidden_act='gelu'; GLM-5 \(MLA, SwiGLU, no dropout\) needs "
                                         r"'silu'"):  # before: hidden_act=None
        glm5f.GLM5Config.from_hf(saved)
    saved["text_config"].update(hidden_act="silu", num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"num_key_value_heads must equal num_attention_heads \(4\), got 1$"):
        glm5f.GLM5Config.from_hf(saved)


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


# ---- the model against Transformers' Glm5NextForConditionalGeneration --------------------------------------------

def random_config(seed: int, hc_mult: int, kpool: int):
    """A tiny GLM-5.3 with KDA and DSA layers and dense and MoE MLPs in a random order (each kind at least once)."""
    g = torch.Generator().manual_seed(seed)
    n = 4 + seed % 2
    while True:
        kinds = ["linear_attention" if b else "indexed_attention" for b in torch.randint(0, 2, (n,), generator=g)]
        mlps = ["sparse" if b else "dense" for b in torch.randint(0, 2, (n,), generator=g)]
        if len(set(kinds)) == 2 and len(set(mlps)) == 2:
            break
    return glm5f.preset("glm53-tiny", num_hidden_layers=n, layer_types=tuple(kinds), mlp_layer_types=tuple(mlps),
                        indexer_types=("full",) * n, hc_mult=hc_mult, index_kpool=kpool, index_topk=2 * kpool,
                        index_n_heads=8, swiglu_limit=1.5, rms_norm_eps=1e-6)


def hf_glm53(cfg, seed: int = 0):
    """Transformers' Glm5NextForConditionalGeneration of `cfg` (eager attention, a one-block vision tower) with
    random weights everywhere, the parts Transformers initialises to constants included (pool gate and position
    terms, mHC base and scale, KDA decay, router bias)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    hcfg = Glm5NextConfig(**cfg.to_hf(), vision_config=TINY_VISION)
    hcfg._attn_implementation = "eager"
    hcfg.text_config._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(hcfg).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "language_model" not in name:
                continue
            if name.endswith(("_hc.base", "compress_ape", "A_log")):
                t.normal_(0, 0.5)
            elif name.endswith("_hc.scale"):
                t.uniform_(0.5, 1.5)
            elif name.endswith("compress_gate"):
                t.normal_(0, 0.3)
            elif name.endswith(("norm.weight", "o_norm.weight")):
                t.uniform_(0.5, 1.5)
            elif t.ndim >= 2:
                t.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return model


# every (hc_mult, kpool) pair, padded or not; the other half of the combinations run with -m slow
GLM53_CASES = [pytest.param(seed, hc, kpool, padded, marks=[pytest.mark.slow] if (seed % 3 == 0) == padded else [])
               for seed, (hc, kpool) in enumerate([(2, 2), (4, 4), (4, 2), (2, 4)]) for padded in (False, True)]


@pytest.mark.parametrize("seed,hc_mult,kpool,padded", GLM53_CASES)
def test_matches_transformers(seed, hc_mult, kpool, padded, tmp_path):
    from torch.func import functional_call

    from conftest import assert_grads_match, random_batch, stable_topk, with_grad
    from glm5f.model.head import causal_lm_loss

    cfg = random_config(seed, hc_mult, kpool)
    model = hf_glm53(cfg, seed)
    model.save_pretrained(tmp_path)
    cfg2, params = glm5f.load_hf(tmp_path)
    assert cfg2 == cfg
    B, S = 3, 29
    assert S > cfg.index_topk + kpool
    ids, mask, labels = random_batch(cfg, B, S, padded, seed, right=5, left=6)  # the pools start at row 1's first real token
    real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()
    with torch.no_grad(), stable_topk():
        ref = model(ids, attention_mask=mask).logits
    with torch.no_grad():
        ours = glm5f.forward(params, cfg, ids, attention_mask=mask)
    assert (ours - ref)[real].abs().max() <= 1e-5

    p = with_grad(params)
    leaves = {k: v for k, v in glm5f.flatten(p).items() if v.requires_grad}
    loss = causal_lm_loss(glm5f.forward(p, cfg, ids, attention_mask=mask), labels)
    with stable_topk():
        ref_loss = functional_call(model, glm5f.hf_state_dict(p, fused_experts=True, cfg=cfg), (ids,),
                                   {"attention_mask": mask, "labels": labels}).loss
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, list(leaves.values()), allow_unused=True)
    assert assert_grads_match(leaves, grads, ref_grads, zero_atol=1e-12) > 50


def test_save_hf_round_trip_is_exact_and_keeps_the_vision_tower(tmp_path):
    from safetensors.torch import load_file
    from transformers import Glm5NextForConditionalGeneration

    cfg = random_config(0, 4, 2)
    model = hf_glm53(cfg)
    model.save_pretrained(tmp_path / "src")
    cfg2, params = glm5f.load_hf(tmp_path / "src")
    glm5f.save_hf(tmp_path / "out", cfg2, params, source=tmp_path / "src")
    src = load_file(tmp_path / "src" / "model.safetensors")
    out = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        out.update(load_file(f))
    assert src.keys() == out.keys()
    assert all(torch.equal(src[k], out[k]) and src[k].dtype == out[k].dtype for k in src)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vision_config"] == \
        json.loads((tmp_path / "src" / "config.json").read_text())["vision_config"]
    back, info = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_full_glm53_parameter_count_matches_transformers_on_meta():
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    cfg = glm5f.preset("glm53")
    text = Glm5NextTextConfig(**cfg.to_hf()["text_config"])
    with torch.device("meta"):
        model = Glm5NextTextModel(text)
    theirs = sum(p.numel() for p in model.parameters()) + cfg.vocab_size * cfg.hidden_size  # + lm_head
    assert glm5f.param_count(cfg) == theirs

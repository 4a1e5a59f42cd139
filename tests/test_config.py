"""glm5f/core/config.py: GLM5Config's checks, presets and Transformers configs (the MTP preset and its count)."""

import pytest

import glm5f


MTP_CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer


def test_mtp_config_preset_and_param_count():
    assert glm5f.preset("glm5").num_nextn_predict_layers == 1
    assert glm5f.preset("glm5-tiny").num_nextn_predict_layers == 0
    assert glm5f.GLM5Config.from_hf(MTP_CFG.to_hf()) == MTP_CFG
    D, base = MTP_CFG.hidden_size, glm5f.preset("glm5-tiny")
    layer = sum(v.numel() for k, v in glm5f.flatten(glm5f.init_params(MTP_CFG)).items()
                if k.startswith("model.layers.3.") and not k.endswith("e_score_correction_bias"))
    assert glm5f.param_count(MTP_CFG, include_mtp=False) == glm5f.param_count(base)
    assert glm5f.param_count(MTP_CFG) == glm5f.param_count(base) + layer
    assert layer > 2 * D * D + 3 * D
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 0"):
        glm5f.preset("glm5-tiny", num_nextn_predict_layers=-1)


@pytest.mark.parametrize("changes,message", [
    (dict(n_routed_experts=6, n_group=4), "divisible by n_group"),
    (dict(topk_group=3), "topk_group .3. must be <= n_group"),
    (dict(num_experts_per_tok=9), "exceeds the experts in the chosen groups"),
    (dict(index_topk_pattern="SFF"), "first layer's indexer must be 'full'"),
    (dict(index_topk_pattern="FFSX"), "may hold only 'F' and 'S'"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types may hold"),
    (dict(num_hidden_layers=4, index_topk_pattern="FFS"), "'FFS' has 3 letters for 4 layers"),
    (dict(indexer_types=("full",) * 2), "indexer_types has 2 entries for 3 layers"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type must be"),
    (dict(qk_rope_head_dim=7), "must be even"),
    (dict(hidden_size=0), "hidden_size must be positive"),
    (dict(hidden_size=64.0), "expected int"),
])
def test_invalid_configs(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        glm5f.preset("glm5-tiny", **changes)


@pytest.mark.parametrize("changes,message", [
    (dict(num_key_value_heads=2), "num_key_value_heads must equal"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'; GLM-5 .* needs 'silu'"),
    (dict(mlp_bias=True), "mlp_bias=True; GLM-5 .* needs False"),
])
def test_invalid_transformers_configs(changes, message):
    """Transformers fields GLM-5 has one value of are checked on load, not silently ignored."""
    with pytest.raises(ValueError, match=message):
        glm5f.GLM5Config.from_hf({**glm5f.preset("glm5-tiny").to_hf(), **changes})


def test_unknown_preset_and_foreign_config(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'glm6'; choose one of"):
        glm5f.preset("glm6")
    with pytest.raises(ValueError, match="model_type 'glm_moe_dsa'.*found 'llama'"):
        glm5f.GLM5Config.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match="does not know: \\['not_a_field'\\]"):
        glm5f.GLM5Config.from_hf({**glm5f.preset("glm5-tiny").to_hf(), "not_a_field": 1})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        glm5f.GLM5Config.from_hf(tmp_path)

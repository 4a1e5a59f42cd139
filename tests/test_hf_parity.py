"""fp32 parity with Transformers' GlmMoeDsaForCausalLM: logits, loss and every parameter's gradient."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

import glm5f
from conftest import boundary_ties, rel_err, with_grad

MIXED = glm5f.preset(
    "glm5-scaled-moe", num_hidden_layers=5, index_topk_pattern=None, index_topk_freq=2, index_skip_topk_offset=1, index_topk=32,
    n_group=8, topk_group=3, attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 512},
    max_position_embeddings=4096)
# (name, config, batch, seq, padded)
CASES = [
    ("scaled-dense", glm5f.preset("glm5-scaled-dense"), 2, 128, False),
    ("scaled-moe", glm5f.preset("glm5-scaled-moe"), 2, 128, False),
    ("mixed-shared-groups-yarn", MIXED, 2, 96, False),
    ("scaled-moe-padded", glm5f.preset("glm5-scaled-moe"), 3, 112, True),
]


def batch(cfg, B, S, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = ids.clone()
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, S - 7:] = 0  # right padding
        mask[1, :10] = 0  # left padding
        labels[mask == 0] = glm5f.IGNORE_INDEX
        labels[1, 10] = glm5f.IGNORE_INDEX  # predicted from a padding position
    return ids, mask, labels


@pytest.mark.parametrize("name,cfg,B,S,padded", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(name, cfg, B, S, padded, hf_checkpoint):
    assert S > cfg.index_topk, "the sequence must be longer than index_topk so DSA is sparse"
    model, path = hf_checkpoint(cfg)
    cfg2, params = glm5f.load_hf(path)
    assert cfg2 == cfg
    ids, mask, labels = batch(cfg, B, S, padded)
    assert boundary_ties(params, cfg, ids, mask) == 0, "top-k ties would make the reference's choice arbitrary"

    real = torch.ones(B, S, dtype=torch.bool) if mask is None else mask.bool()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ours = glm5f.forward(params, cfg, ids, attention_mask=mask)
    assert (ours - ref)[real].abs().max() <= 1e-5

    p = with_grad(params)
    leaves = {k: v for k, v in glm5f.flatten(p).items() if v.requires_grad}
    loss = glm5f.causal_lm_loss(glm5f.forward(p, cfg, ids, attention_mask=mask), labels)
    ref_loss = functional_call(model, glm5f.hf_state_dict(p, fused_experts=True), (ids,),
                               {"attention_mask": mask, "labels": labels}).loss
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, list(leaves.values()), allow_unused=True)
    checked = 0
    for path, g, rg in zip(leaves, grads, ref_grads):
        if ".indexer." in path:  # the reference runs its indexer under no_grad; so do we
            assert g is None and rg is None, path
            continue
        assert g is not None and rg is not None, path
        assert rel_err(g, rg) <= 1e-4, f"{path}: relative gradient error {rel_err(g, rg):.2e}"
        checked += 1
    assert checked > 20


def test_round_trip_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = glm5f.preset("glm5-scaled-moe")
    params = glm5f.init_params(cfg, seed=3)
    with torch.no_grad():  # a non-zero router bias, so that it must travel too
        params["model"]["layers"][1]["mlp"]["gate"]["e_score_correction_bias"].normal_(0, 0.1)
    glm5f.save_hf(tmp_path / "ckpt", cfg, params)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True,
                                                       attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    assert boundary_ties(params, cfg, ids) == 0
    with torch.no_grad():
        ours = glm5f.forward(params, cfg, ids)
        assert (model.eval()(ids).logits - ours).abs().max() <= 1e-5
    # and back: Transformers' own save, loaded by load_hf, gives identical tensors
    model.save_pretrained(tmp_path / "again")
    cfg2, params2 = glm5f.load_hf(tmp_path / "again")
    assert cfg2 == cfg
    for k, v in glm5f.flatten(params).items():
        assert torch.equal(v, glm5f.flatten(params2)[k]), k


def test_checkpoint_dtypes_follow_the_reference(tmp_path):
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, dtype=torch.bfloat16)
    assert params["model"]["layers"][1]["mlp"]["gate"]["weight"].dtype == torch.float32
    assert params["model"]["layers"][0]["self_attn"]["indexer"]["weights_proj"]["weight"].dtype == torch.float32
    glm5f.save_hf(tmp_path / "bf16", cfg, params)
    _, loaded = glm5f.load_hf(tmp_path / "bf16")
    assert {k: v.dtype for k, v in glm5f.flatten(loaded).items()} == \
           {k: v.dtype for k, v in glm5f.flatten(params).items()}
    _, as_fp32 = glm5f.load_hf(tmp_path / "bf16", dtype=torch.float32)
    assert all(v.dtype == torch.float32 for v in glm5f.flatten(as_fp32).values())


def test_config_round_trip_with_transformers():
    from transformers import GlmMoeDsaConfig

    for cfg in [glm5f.preset(n) for n in glm5f.PRESETS] + [MIXED]:
        hf = GlmMoeDsaConfig(**cfg.to_hf())
        assert list(hf.indexer_types) == list(cfg.indexer_types)
        assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
        assert glm5f.GLM5Config.from_hf(hf.to_dict()) == cfg


@pytest.mark.parametrize("kw", [dict(index_topk_freq=3, index_skip_topk_offset=1),
                                dict(index_topk_freq=2, index_skip_topk_offset=3),
                                dict(index_topk_pattern="FSSFSF")])
def test_indexer_types_derived_like_transformers(kw):
    from transformers import GlmMoeDsaConfig

    theirs = GlmMoeDsaConfig(num_hidden_layers=6, **kw)
    assert list(glm5f.config.layer_types(6, **kw)["indexer_types"]) == list(theirs.indexer_types)
    assert glm5f.GLM5Config.from_hf({**theirs.to_dict(), **kw}).indexer_types == tuple(theirs.indexer_types)


def test_full_glm5_parameter_count_without_memory():
    cfg = glm5f.preset("glm5")
    assert glm5f.param_count(cfg, include_mtp=False) == 743_911_199_232
    assert glm5f.param_count(cfg) == 753_864_119_552  # with the MTP layer (model.layers.78)
    abstract = glm5f.abstract_params(cfg)
    leaves = glm5f.flatten(abstract)
    assert all(t.device.type == "meta" for t in leaves.values())
    trained = {k: t.numel() for k, t in leaves.items() if not k.endswith("e_score_correction_bias")}
    assert sum(trained.values()) == 753_864_119_552
    assert sum(n for k, n in trained.items() if k.startswith("model.layers.78.")) == 753_864_119_552 - 743_911_199_232


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_4d_masks_match_transformers(kind, hf_checkpoint):
    """A user 4D mask (here: causal within two documents per row) is used as given, boolean or additive."""
    cfg = glm5f.preset("glm5-scaled-moe")
    model, path = hf_checkpoint(cfg)
    _, params = glm5f.load_hf(path)
    B, S, cut = 2, 112, 40
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(3))
    doc = (torch.arange(S) >= cut).long()
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])
    allowed = allowed.expand(B, 1, S, S)
    mask = allowed if kind == "bool" else torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert boundary_ties(params, cfg, ids, mask) == 0
    if kind == "bool":  # Transformers' eager attention adds masks to scores: a boolean mask needs its sdpa path
        model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        ours = glm5f.forward(params, cfg, ids, attention_mask=mask)
    assert (ours - ref).abs().max() <= 1e-5
    # the same documents given as restarting positions (packing) select the same keys
    packed = glm5f.forward(params, cfg, ids, position_ids=(torch.arange(S) - cut * doc)[None])
    assert (packed - ours).abs().max() <= 1e-5


@pytest.mark.parametrize("fused", [False, True])
def test_load_hf_of_a_region_reads_that_part(fused, tmp_path):
    """load_hf(region=...) gives each leaf's part alone, equal to the same part of the whole load, from the
    per-expert layout (only the experts in the region are read) and from the fused gate_up_proj one (the region's
    rows of gate and of up); regions cut dims 0 and 1 anywhere, uneven and empty ends included."""
    import json

    from safetensors.torch import save_file

    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS", num_nextn_predict_layers=1)
    params = glm5f.init_params(cfg, seed=5)
    ckpt = tmp_path / "ckpt"
    glm5f.save_hf(ckpt, cfg, params)
    if fused:  # the same weights in the fused expert layout
        tensors = {k: v.contiguous().clone() for k, v in glm5f.hf_state_dict(params, fused_experts=True).items()}
        for f in ckpt.glob("*.safetensors"):
            f.unlink()
        save_file(tensors, ckpt / "model.safetensors")
        assert any(k.endswith("gate_up_proj") for k in tensors)
    _, whole = glm5f.load_hf(ckpt)
    whole = glm5f.flatten(whole)
    for lo, hi in ((0, 1), (1, 3), (2, 2), (3, 100)):
        def region(path, shape):
            return tuple(slice(min(lo, n), min(hi, n)) if d < 2 else slice(0, n) for d, n in enumerate(shape))
        _, part = glm5f.load_hf(ckpt, region=region)
        for k, v in glm5f.flatten(part).items():
            assert torch.equal(v, whole[k][region(k, tuple(whole[k].shape))]), (k, lo, hi)

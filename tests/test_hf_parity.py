"""glm5f.ckpt.hf and fp32 parity with Transformers' GlmMoeDsaForCausalLM: logits, loss and every parameter's
gradient; checkpoints both ways (regions, fused experts, shards, the MTP layer) and the errors of a checkpoint that
does not fit."""

import json
import math
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.func import functional_call

import glm5f
from configs import Config
from conftest import assert_grads_match, boundary_ties, hf_model, random_batch, with_grad
from glm5f.train.loss import Step, step_grads
from glm5f.train.optim import adamw_init, adamw_update, balance_router_bias
from glm5f.parallel.layout import Layout

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
MTP_CFG = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)  # the MTP layer is MoE with a full indexer


@pytest.mark.parametrize("name,cfg,B,S,padded", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(name, cfg, B, S, padded, hf_checkpoint):
    assert S > cfg.index_topk, "the sequence must be longer than index_topk so DSA is sparse"
    model, path = hf_checkpoint(cfg)
    cfg2, params = glm5f.load_hf(path)
    assert cfg2 == cfg
    ids, mask, labels = random_batch(cfg, B, S, padded)
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
    assert assert_grads_match(leaves, grads, ref_grads) > 20


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

    for cfg in [c for c in map(glm5f.preset, glm5f.PRESETS) if not c.is_glm53] + [MIXED]:  # GLM-5.3: test_glm53
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
    assert list(glm5f.core.config.layer_types(6, **kw)["indexer_types"]) == list(theirs.indexer_types)
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


def mtp_checkpoint(path, cfg, copies):
    """A Transformers save_pretrained checkpoint of `cfg` with the MTP layer's tensors added, as released
    checkpoints carry them (with DeepSeek-V3's embedding / head copies when `copies`)."""
    model = hf_model(cfg, seed=2)
    model.save_pretrained(path)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert files == ["model.safetensors"]
    tensors = load_file(os.path.join(path, files[0]))
    assert not any(k.startswith("model.layers.3.") for k in tensors)  # Transformers has no MTP layer
    mtp = {k: v.contiguous().clone() for k, v in glm5f.hf_state_dict(glm5f.init_params(cfg, seed=5)).items()
           if k.startswith("model.layers.3.")}
    mtp["model.layers.3.mlp.gate.e_score_correction_bias"].normal_(0, 0.1)
    if copies:
        g = torch.Generator().manual_seed(9)
        for k in ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"):
            mtp[k] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
    save_file({**tensors, **mtp}, os.path.join(path, files[0]), metadata={"format": "pt"})
    assert json.load(open(os.path.join(path, "config.json")))["num_nextn_predict_layers"] == 1
    return model, sorted(mtp)


@pytest.mark.parametrize("copies", [False, True], ids=["glm5-layout", "with-embed-head-copies"])
def test_checkpoint_with_mtp_loads_trains_saves_and_round_trips(tmp_path, copies):
    from transformers import AutoModelForCausalLM

    _, mtp_keys = mtp_checkpoint(tmp_path / "in", MTP_CFG, copies)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing ignored, nothing dropped
        cfg, params = glm5f.load_hf(tmp_path / "in")
    assert cfg == MTP_CFG
    glm5f.check_params(params, cfg)
    assert glm5f.core.params.mtp_copies(params, cfg) == (("embed_tokens", "shared_head.head") if copies else ())
    exported = set(glm5f.hf_state_dict(params))
    assert set(mtp_keys) <= exported and not [k for k in exported if k.startswith("model.layers.4.")]
    before = {k: v.clone() for k, v in glm5f.flatten(params).items()}
    stored = load_file(tmp_path / "in" / "model.safetensors")
    for k in mtp_keys:
        assert torch.equal(glm5f.hf_state_dict(params)[k], stored[k]), k

    run = Config()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(32).expand(4, 32)}
    layout = Layout(torch.device("cpu"))
    metrics, grads, counts = step_grads(params, batch, cfg, layout, Step.of(run.train, cfg))
    assert math.isfinite(metrics["mtp_loss"]) and metrics["mtp_loss"] > 0
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in counts  # the MTP layer joins router balancing
    assert float(counts["model.layers.3.mlp.gate.e_score_correction_bias"].sum()) == 4 * 32 * cfg.num_experts_per_tok
    params, _ = adamw_update(params, grads, adamw_init(params), 1e-3)
    params = balance_router_bias(params, counts, 1e-3)
    after = glm5f.flatten(params)
    for k in ("model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
              *(["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"] if copies else [])):
        assert not torch.equal(after[k], before[k]), f"{k} did not train"

    glm5f.save_hf(tmp_path / "out", cfg, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg2, again = glm5f.load_hf(tmp_path / "out")
    assert cfg2 == cfg
    flat2 = glm5f.flatten(again)
    assert flat2.keys() == after.keys()
    for k, v in after.items():
        assert v.dtype == flat2[k].dtype and torch.equal(v, flat2[k]), k

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    # inputs without top-k ties in the indexer (the reference breaks them arbitrarily)
    test_ids = next(t for t in (torch.randint(0, cfg.vocab_size, (2, 40), generator=g) for _ in range(50))
                    if boundary_ties(params, cfg, t) == 0)
    with torch.no_grad():
        assert (model(test_ids).logits - glm5f.forward(params, cfg, test_ids)).abs().max() <= 1e-5


def test_config_with_mtp_but_no_tensors_loads_without_them(hf_checkpoint):
    _, path = hf_checkpoint(MTP_CFG)  # Transformers' own save drops the MTP layer
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1 but the weights hold no model.layers.3"):
        cfg, params = glm5f.load_hf(path)
    assert cfg.num_nextn_predict_layers == 0 and len(params["model"]["layers"]) == 3


def test_config_transformers_would_reject_is_rejected_on_load(tmp_path, tiny):
    cfg, params = tiny
    glm5f.save_hf(tmp_path / "ok", cfg, params)
    conf = json.loads((tmp_path / "ok" / "config.json").read_text())
    conf["n_group"] = 3  # 8 experts do not split into 3 groups
    (tmp_path / "ok" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="divisible by n_group"):
        glm5f.load_hf(tmp_path / "ok")


def _tamper(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = fn(load_file(f))
    save_file(tensors, f)


def test_missing_unexpected_and_misshapen_keys_in_one_error(tmp_path, tiny):
    cfg, params = tiny
    glm5f.save_hf(tmp_path / "c", cfg, params)

    def damage(t):
        del t["model.norm.weight"]
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.extra.weight"] = torch.zeros(2)
        t["lm_head.weight"] = torch.zeros(7, 64)
        return t

    _tamper(tmp_path / "c", damage)
    with pytest.raises(ValueError) as err:
        glm5f.load_hf(tmp_path / "c")
    msg = str(err.value)
    assert "2 missing" in msg and "model.norm.weight" in msg and "experts.3.up_proj.weight" in msg
    assert "1 unexpected" in msg and "model.layers.0.extra.weight" in msg
    assert "lm_head.weight: expected [512, 64], found [7, 64]" in msg
    assert "Nothing was loaded" in msg


def test_mtp_layer_is_reported_not_silently_dropped(tmp_path, tiny):
    cfg, params = tiny
    glm5f.save_hf(tmp_path / "m", cfg, params)
    n = cfg.num_hidden_layers

    def add_mtp(t):
        t[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
        for e in range(cfg.n_routed_experts):
            t[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = torch.zeros(32, 64)
        return t

    _tamper(tmp_path / "m", add_mtp)
    with pytest.warns(UserWarning, match=rf"ignoring 9 multi-token-prediction tensors.*model.layers.{n}.eh_proj.weight"
                                         rf".*model.layers.{n}.mlp.experts.{{0..7}}.up_proj.weight"):
        _, loaded = glm5f.load_hf(tmp_path / "m")
    assert torch.equal(loaded["model"]["norm"]["weight"], params["model"]["norm"]["weight"])


def test_fused_expert_layout_loads(tmp_path, tiny):
    cfg, params = tiny
    os.makedirs(tmp_path / "f")
    (tmp_path / "f" / "config.json").write_text(json.dumps(cfg.to_hf()))
    fused = {k: v.contiguous().clone() for k, v in glm5f.hf_state_dict(params, fused_experts=True).items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    save_file(fused, tmp_path / "f" / "model.safetensors")
    _, loaded = glm5f.load_hf(tmp_path / "f")
    for k, v in glm5f.flatten(params).items():
        assert torch.equal(v, glm5f.flatten(loaded)[k]), k


def test_sharded_checkpoint_round_trip(tmp_path, tiny):
    cfg, params = tiny
    glm5f.save_hf(tmp_path / "s", cfg, params, max_shard_bytes=200_000)
    files = sorted(os.listdir(tmp_path / "s"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    _, loaded = glm5f.load_hf(tmp_path / "s")
    for k, v in glm5f.flatten(params).items():
        assert torch.equal(v, glm5f.flatten(loaded)[k]), k


def test_failed_save_leaves_no_directory(tmp_path, tiny, monkeypatch):
    """A save that dies midway (the disk fills on the second shard) leaves neither a half-written directory nor
    its temporary one, and a previous export in its place untouched."""
    cfg, params = tiny
    real, written, held = glm5f.ckpt.hf.io.write_safetensors, [], []

    def disk_full_on_second_shard(filename, entries, tensors):
        if written:
            held[:] = sorted(os.listdir(os.path.dirname(filename)))  # what the directory holds when it fails
            raise OSError(28, "No space left on device")
        real(filename, entries, tensors)
        written.append(filename)

    monkeypatch.setattr(glm5f.ckpt.hf.io, "write_safetensors", disk_full_on_second_shard)
    with pytest.raises(OSError, match="No space left on device"):
        glm5f.save_hf(tmp_path / "out", cfg, params, max_shard_bytes=200_000)
    assert held == ["config.json", os.path.basename(written[0])]
    assert os.listdir(tmp_path) == []

    monkeypatch.setattr(glm5f.ckpt.hf.io, "write_safetensors", real)
    glm5f.save_hf(tmp_path / "out", cfg, params)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(tmp_path / "out")}
    monkeypatch.setattr(glm5f.ckpt.hf.io, "write_safetensors", disk_full_on_second_shard)
    written.clear()
    held.clear()
    with pytest.raises(OSError, match="No space left on device"):
        glm5f.save_hf(tmp_path / "out", cfg, params, max_shard_bytes=200_000)
    assert held and os.listdir(tmp_path) == ["out"]
    assert {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(tmp_path / "out")} == before

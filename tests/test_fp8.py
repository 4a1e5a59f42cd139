"""Block-quantized FP8 checkpoints: load_hf dequantizes them exactly (whole, a rank's region, or rank-locally under
DP2, each rank reading only the blocks of its shards), the model's logits stay within FP8 error of the unquantized
model's, and malformed scales are errors naming the key."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import glm5f
from glm5f.parallel.distributed import DistLayout
from glm5f.run.launch import init_process, spawn
from glm5f.ckpt.hf import hf_state_dict

FP8_MAX = 448.0  # the largest float8_e4m3fn
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate"]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv [..., ceil(rows/br), ceil(cols/bc)]): each block divided by amax / 448."""
    (R, C), (br, bc) = w.shape[-2:], block
    nr, nc = math.ceil(R / br), math.ceil(C / bc)
    padded = torch.zeros(*w.shape[:-2], nr * br, nc * bc, dtype=torch.float32)
    padded[..., :R, :C] = w.float()
    blocks = padded.reshape(*w.shape[:-2], nr, br, nc, bc)
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[..., :R, :C].contiguous(), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    R, C = q.shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * full[..., :R, :C]


def converted(key: str, t: torch.Tensor) -> bool:
    return key.endswith(".weight") and t.ndim >= 2 and not any(f".{m}." in f".{key}" for m in NOT_CONVERTED)


def fp8_checkpoint(tmp_path, block, fused=False, seed=3):
    """(cfg, params, FP8 checkpoint dir, {key: dequantized reference}) of a tiny model."""
    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS")
    params = glm5f.init_params(cfg, seed=seed)
    plain = tmp_path / "plain"
    glm5f.save_hf(plain, cfg, params)
    tensors = ({k: v.contiguous().clone() for k, v in hf_state_dict(params, fused_experts=True).items()} if fused
               else load_file(plain / "model.safetensors"))
    out, reference = {}, {}
    for key, t in tensors.items():
        if converted(key, t):
            q, s = quantize(t, block)
            out[key], out[key + "_scale_inv"] = q, s
            reference[key] = dequantize(q, s, block)
        else:
            out[key] = t.to(torch.bfloat16) if t.ndim >= 2 and "mlp.gate." not in key else t
            reference[key] = out[key].float()
    ckpt = tmp_path / "fp8"
    ckpt.mkdir()
    save_file(out, ckpt / "model.safetensors")
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": NOT_CONVERTED}
    (ckpt / "config.json").write_text(json.dumps(config))
    return cfg, params, ckpt, reference


@pytest.mark.parametrize("block", [(128, 128), (16, 24)])
def test_fp8_checkpoint_loads_dequantized_and_predicts_like_the_original(tmp_path, block):
    cfg, params, ckpt, reference = fp8_checkpoint(tmp_path, block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, loaded = glm5f.load_hf(ckpt, dtype=torch.float32)
    said = [str(w.message) for w in caught if "FP8" in str(w.message)]
    assert len(said) == 1 and "dequantized on load" in said[0]
    got = hf_state_dict(loaded)
    assert sorted(got) == sorted(reference)
    n_fp8 = 0
    for key, want in reference.items():
        assert torch.equal(got[key].float(), want), key
        n_fp8 += key + "_scale_inv" in load_file(ckpt / "model.safetensors")
    assert n_fp8 > 20
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    original = glm5f.forward(params, cfg, ids)
    quantized = glm5f.forward(loaded, cfg, ids)
    err = float((quantized - original).norm() / original.norm())
    assert 1e-4 < err < 0.1, err  # e4m3 keeps 3 mantissa bits: a few percent, not nothing
    glm5f.save_hf(tmp_path / "out", cfg, loaded)  # writes plain fp32 weights, no scales
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(k.endswith("_scale_inv") for k in saved) and {t.dtype for t in saved.values()} == {torch.float32}


@pytest.mark.parametrize("fused", [False, True])
def test_region_load_is_the_same_slice_of_the_full_load(tmp_path, fused):
    *_, ckpt, _ = fp8_checkpoint(tmp_path, (16, 24), fused=fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, whole = glm5f.load_hf(ckpt, dtype=torch.float32)
        whole = glm5f.flatten(whole)
        for lo, hi in ((0, 1), (5, 37), (17, 17), (30, 1000)):
            def region(path, shape):
                return tuple(slice(min(lo, n), min(hi, n)) if d < 2 else slice(0, n) for d, n in enumerate(shape))
            _, part = glm5f.load_hf(ckpt, dtype=torch.float32, region=region)
            for k, v in glm5f.flatten(part).items():
                assert torch.equal(v, whole[k][region(k, tuple(whole[k].shape))]), (k, lo, hi)


def rank_local_load(ckpt: str, plain: str, ep: int, out: str) -> None:
    """One rank of a DP2 load (`Layout.local_params`) of the FP8 checkpoint `ckpt`: writes to out.<rank> whether
    its shards equal the same shards of the dequantized reference (`plain`, an fp32 checkpoint of the values the
    test computed), the elements it holds, and the FP8 elements it read from the files."""
    layout = DistLayout(2, 1, ep, init_process(torch.device("cpu")))
    real, read = glm5f.ckpt.hf.io.read_into, {"fp8": 0, "bytes": 0}

    def counted(f, shape, begin, part, dest):  # every byte load_hf takes from a safetensors file comes through here
        real(f, shape, begin, part, dest)
        read["bytes"] += dest.numel() * dest.element_size()
        read["fp8"] += dest.numel() if dest.dtype == torch.float8_e4m3fn else 0
    glm5f.ckpt.hf.io.read_into = counted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = glm5f.flatten(layout.local_params(lambda region: glm5f.load_hf(ckpt, dtype=torch.float32,
                                                                              region=region)[1]))
    glm5f.ckpt.hf.io.read_into = real
    ref = glm5f.flatten(layout.shard_params(glm5f.load_hf(plain)[1]))
    differ = [k for k in ref if not (torch.equal(mine[k].to_local(), ref[k].to_local())
                                     and mine[k].placements == ref[k].placements and mine[k].shape == ref[k].shape)]
    with open(f"{out}.{layout.rank}", "w") as f:
        json.dump({"differ": differ, "held": sum(t.to_local().numel() for t in mine.values()),
                   "read_fp8": read["fp8"], "read_bytes": read["bytes"]}, f)
    dist.barrier()


@pytest.mark.parametrize("ep", [1, 2])
def test_a_dp2_load_holds_and_reads_only_each_ranks_share(tmp_path, ep):
    """Under --parallel.dp_shard 2 (two processes) each rank's shards of an FP8 checkpoint (12x24 blocks, so shard
    boundaries cut through blocks) are the dequantized values, it holds half the model, and it reads from the
    files only the FP8 bytes of its shards: together the ranks read each FP8 byte once."""
    block = (12, 24)
    cfg, _, ckpt, reference = fp8_checkpoint(tmp_path, block)
    plain = tmp_path / "reference"
    plain.mkdir()
    save_file({k: v.contiguous() for k, v in reference.items()}, plain / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    fp8 = {k: v for k, v in load_file(ckpt / "model.safetensors").items() if v.dtype == torch.float8_e4m3fn}
    cut = [k for k, v in fp8.items() if (v.shape[0] // 2) % block[0]]
    assert len(cut) > 10  # shards that begin or end inside a block of scales
    spawn(rank_local_load, 2, str(ckpt), str(plain), ep, str(tmp_path / "out"))
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    total = glm5f.param_count(cfg, include_buffers=True)
    size = os.path.getsize(ckpt / "model.safetensors")
    for r, got in enumerate(ranks):
        assert got["differ"] == [], f"rank {r}: {got['differ'][:5]}"
        assert got["held"] <= total // 2 + 64, (r, got["held"], total)
        assert got["read_fp8"] <= sum(v.numel() for v in fp8.values()) // 2, (r, got["read_fp8"])
        assert got["read_bytes"] < 0.55 * size, (r, got["read_bytes"], size)
    assert sum(got["read_fp8"] for got in ranks) == sum(v.numel() for v in fp8.values())


def rewrite(ckpt, edit):
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")


KEY = "model.layers.0.self_attn.q_b_proj.weight"


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t.update({KEY + "_scale_inv": t[KEY + "_scale_inv"][:, :1].contiguous()}),
     f"{KEY}_scale_inv is F32 [6, 1]; expected a float tensor of shape [6, 2]"),
    (lambda t: t.update({KEY + "_scale_inv": t[KEY + "_scale_inv"][0].contiguous()}),
     f"{KEY}_scale_inv is F32 [2]; expected a float tensor of shape [6, 2]"),
    (lambda t: t.pop(KEY + "_scale_inv"), f"FP8 tensor {KEY} has no {KEY}_scale_inv"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1)}), "model.norm.weight_scale_inv scales "
                                                                          "model.norm.weight, which is F32"),
])
def test_malformed_scales_are_errors_naming_the_key(tmp_path, edit, expected):
    *_, ckpt, _ = fp8_checkpoint(tmp_path, (16, 24))
    rewrite(ckpt, edit)
    with pytest.raises(ValueError) as e:
        glm5f.load_hf(ckpt)
    assert expected in str(e.value)


def test_fp8_without_block_size_is_an_error(tmp_path):
    *_, ckpt, _ = fp8_checkpoint(tmp_path, (16, 24))
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config.weight_block_size"):
        glm5f.load_hf(ckpt)


def test_glm53_fp8_release_exports_dequantized_with_its_vision_tower(tmp_path):
    """A tiny FP8 GLM-5.3 release (text model, vision tower and an MTP layer quantized in 16x16 blocks): load_hf
    dequantizes the text model, save_hf with the release as source writes every tensor dequantized (the copied
    vision and MTP tensors equal fp8 x scale, no weight_scale_inv, no quantization_config), and Transformers
    loads the export with the text model's weights as glm5f holds them and the vision tower's dequantized."""
    from test_glm53 import hf_glm53, random_config
    from transformers import Glm5NextForConditionalGeneration

    block = (16, 16)
    cfg = random_config(0, 2, 2)
    hf_glm53(cfg, 0).save_pretrained(tmp_path / "plain")
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    mtp = f"model.language_model.layers.{cfg.num_hidden_layers}.eh_proj.weight"  # Transformers has no MTP layer
    tensors[mtp] = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out, reference = {}, {}
    for key, t in tensors.items():
        if converted(key, t) and t.ndim == 2 and "conv1d" not in key:
            q, s = quantize(t, block)
            out[key], out[key + "_scale_inv"] = q, s
            reference[key] = dequantize(q, s, block)
        else:
            out[key] = reference[key] = t
    assert any(k.startswith("model.visual.") and k + "_scale_inv" in out for k in out) and mtp + "_scale_inv" in out
    (tmp_path / "fp8").mkdir()
    save_file(out, tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": NOT_CONVERTED}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg2, params = glm5f.load_hf(tmp_path / "fp8")
    glm5f.save_hf(tmp_path / "out", cfg2, params, source=tmp_path / "fp8")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert written.keys() == reference.keys()
    assert all(torch.equal(written[k], reference[k].to(written[k].dtype)) for k in reference
               if k.startswith("model.visual.") or k == mtp)
    ours = glm5f.hf_state_dict(params, fused_experts=True, cfg=cfg2)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in saved and saved["vision_config"] == config["vision_config"]
    model, info = Glm5NextForConditionalGeneration.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ours.items())
    assert all(torch.equal(state[k], reference[k]) for k in reference if k.startswith("model.visual."))

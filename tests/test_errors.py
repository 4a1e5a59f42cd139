"""Bad input fails loudly with a message that names the problem, and never half-loads or half-writes."""

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm5f


@pytest.fixture(scope="module")
def tiny():
    cfg = glm5f.preset("glm5-tiny")
    return cfg, glm5f.init_params(cfg)


def test_token_ids_outside_vocab(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"\[0, vocab_size=512\).*\[3, 512\]"):
        glm5f.forward(params, cfg, torch.tensor([[3, 512]]))
    with pytest.raises(ValueError, match="found ids in"):
        glm5f.forward(params, cfg, torch.tensor([[-1, 4]]))


def test_wrong_input_shapes(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        glm5f.forward(params, cfg, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integer token ids"):
        glm5f.forward(params, cfg, torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"2D attention_mask must be \[batch, seq\] = \[1, 3\]"):
        glm5f.forward(params, cfg, torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="4D attention_mask"):
        glm5f.forward(params, cfg, torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 1, 3, 2))
    with pytest.raises(ValueError, match="position_ids must be"):
        glm5f.forward(params, cfg, torch.zeros(2, 3, dtype=torch.long), position_ids=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="labels must be"):
        glm5f.causal_lm_loss(torch.zeros(1, 3, 8), torch.zeros(1, 4, dtype=torch.long))


def test_params_of_another_config(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: expected \[1024, 64\], found \[512, 64\]"):
        glm5f.check_params(params, dataclasses.replace(cfg, vocab_size=1024))
    with pytest.raises(ValueError, match="missing"):
        glm5f.check_params(params, glm5f.preset("glm5-tiny", num_hidden_layers=4))


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
    real, written, held = glm5f.hf._write_safetensors, [], []

    def disk_full_on_second_shard(filename, entries, tensors):
        if written:
            held[:] = sorted(os.listdir(os.path.dirname(filename)))  # what the directory holds when it fails
            raise OSError(28, "No space left on device")
        real(filename, entries, tensors)
        written.append(filename)

    monkeypatch.setattr(glm5f.hf, "_write_safetensors", disk_full_on_second_shard)
    with pytest.raises(OSError, match="No space left on device"):
        glm5f.save_hf(tmp_path / "out", cfg, params, max_shard_bytes=200_000)
    assert held == ["config.json", os.path.basename(written[0])]
    assert os.listdir(tmp_path) == []

    monkeypatch.setattr(glm5f.hf, "_write_safetensors", real)
    glm5f.save_hf(tmp_path / "out", cfg, params)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(tmp_path / "out")}
    monkeypatch.setattr(glm5f.hf, "_write_safetensors", disk_full_on_second_shard)
    written.clear()
    held.clear()
    with pytest.raises(OSError, match="No space left on device"):
        glm5f.save_hf(tmp_path / "out", cfg, params, max_shard_bytes=200_000)
    assert held and os.listdir(tmp_path) == ["out"]
    assert {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(tmp_path / "out")} == before


# ---- the train CLI: bad input ends in one `error:` line, and the run directory stays as it was ----------------

TINY_RUN = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "2"]


def run_error(capsys, *args) -> str:
    """train.py's exit status must be 1; returns its stderr (the `error:` line)."""
    from train import main
    assert main(TINY_RUN + list(args)) == 1
    return capsys.readouterr().err


def test_labels_outside_vocab_are_an_error_line(tmp_path, capsys):
    data = tmp_path / "lab.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(1, 9)), "labels": [1, 2, 3, 9999, 5, 6, 7, 8]}) + "\n")
    err = run_error(capsys, "--data.type", "json_file", "--data.path", str(data), "--checkpoint.dir",
                    str(tmp_path / "r"))
    assert f"error: {data}: example 0 has label 9999 outside [0, vocab_size=512) (use -100 where no loss" in err
    torch.save([{"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.full((2, 8), 9999)}],
               tmp_path / "lab.pt")
    err = run_error(capsys, "--data.type", "preset_pt", "--data.path", str(tmp_path / "lab.pt"), "--checkpoint.dir",
                    str(tmp_path / "r"))
    assert f"error: {tmp_path / 'lab.pt'}: batch 0 has label 9999 outside [0, vocab_size=512)" in err
    assert not (tmp_path / "r").exists()


def test_broken_tokenizer_json_is_an_error_line(tmp_path, capsys):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {"bad"\n')
    err = run_error(capsys, "--model.tokenizer_path", str(tmp_path), "--checkpoint.dir", str(tmp_path / "r"))
    assert f"error: --model.tokenizer_path {tok}: not a readable tokenizer.json (" in err
    assert not (tmp_path / "r").exists()


def test_preset_pt_that_is_not_a_torch_file(tmp_path, capsys):
    import argparse
    (tmp_path / "notes.pt").write_text("hello")
    torch.save([{"input_ids": torch.ones(2, 8, dtype=torch.long), "x": argparse.Namespace()}], tmp_path / "obj.pt")
    for name, why in [("notes.pt", "not a file written by torch.save"),
                      ("obj.pt", "it holds a Python object (argparse.Namespace), not only tensors")]:
        err = run_error(capsys, "--data.type", "preset_pt", "--data.path", str(tmp_path / name), "--checkpoint.dir",
                        str(tmp_path / "r"))
        assert f"error: --data.path {tmp_path / name}: cannot read it as --data.type preset_pt batches: {why}" in err
        assert "weights_only" not in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_malformed_meta_and_config_json_name_the_file(tmp_path, capsys):
    from train import main
    run = tmp_path / "r"
    assert main(TINY_RUN + ["--data.type", "synthetic", "--checkpoint.dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    (ckpt / "manifest.json").unlink(missing_ok=True)  # as a checkpoint written before manifests
    (ckpt / "meta.json").write_text('{"step": 2,\n')
    err = run_error(capsys, "--data.type", "synthetic", "--train.steps", "3", "--checkpoint.dir", str(run),
                    "--checkpoint.resume", str(ckpt))
    assert f"error: {ckpt / 'meta.json'}: not valid JSON (Expecting property name" in err
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": \n')
    from train import main
    assert main(["--model.init_from", str(tmp_path / "hf"), "--checkpoint.dir", str(tmp_path / "r2")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'hf' / 'config.json'}: not valid JSON (Expecting value at line 2 column 1)" in err
    with pytest.raises(ValueError, match="config.json: holds a JSON list"):
        (tmp_path / "hf" / "config.json").write_text("[1]")
        glm5f.load_hf(tmp_path / "hf")

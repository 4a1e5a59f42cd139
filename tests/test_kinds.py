"""A new layer kind is one record (tests/toy_kind.py) entered in glm5f.core.layers' table, and the layer_types entry that
selects it: with nothing else changed it trains through train.py, resumes bit for bit, is planned and decodes."""

import json

import pytest
import torch

import glm5f
from conftest import cli
from glm5f.core import config
from glm5f.core import layers
from glm5f.run.metrics import read_metrics
from toy_kind import LAYER_TYPE, LAYER_TYPES, TOY
from train import main, train

ARGS = ["--model.preset", "glm53-toy", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--optim.warmup_steps", "1", "--optim.schedule_steps", "6", "--eval.every", "0"]


@pytest.fixture
def toy(monkeypatch):
    """The toy kind entered in the attention table, its layer_types entry, and a preset whose third layer is one."""
    monkeypatch.setitem(layers.ATTENTION, "toy", TOY)
    monkeypatch.setitem(config.ATTENTION_KINDS, LAYER_TYPE, "toy")
    monkeypatch.setitem(config.PRESETS, "glm53-toy", {**config.PRESETS["glm53-tiny"], "layer_types": LAYER_TYPES})
    return glm5f.preset("glm53-toy")


def test_a_new_attention_kind_trains_resumes_and_plans(toy, tmp_path, capsys):
    """Its layer holds the toy's leaves and its state is the toy's; train.py's loss falls over 6 steps, and a run
    resumed from its step-3 checkpoint repeats the straight run's losses and gradient norms bit for bit; the memory
    plan (table and json) counts its parameters."""
    assert layers.layer_spec(toy, 2) == layers.LayerSpec("toy", "none", "moe", "hyper")
    assert sorted(layers.layer_params(toy, 2)["self_attn"]) == ["toy_o", "toy_v"]
    assert layers.carries_state(toy, 2) and not layers.carries_state(toy, 1)
    args = [*ARGS, "--checkpoint.every", "3"]
    train(cli(*args, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "straight")))
    train(cli(*args, "--train.steps", "3", "--checkpoint.dir", str(tmp_path / "resumed")))
    train(cli(*args, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "resumed"), "--checkpoint.resume",
              "latest"))
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert len(straight) == 6 and straight[-1]["loss"] < straight[0]["loss"] - 0.05
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in straight]
    capsys.readouterr()
    assert main([*ARGS, "--plan", "table"]) == 0
    assert "memory plan of" in capsys.readouterr().out
    assert main([*ARGS, "--plan", "json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["params_bytes"] == 4 * glm5f.param_count(toy, include_buffers=True)


def test_a_new_attention_kind_decodes_as_its_forward(toy):
    """Greedy decoding through its cache (the toy's carried state) gives the tokens the full forward picks when
    run again over the whole sequence at each step."""
    params = glm5f.init_params(toy, seed=3)
    prompt = torch.randint(2, toy.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    out = glm5f.generate(params, toy, prompt, 5, eos_token_id=None)
    seq = prompt
    for _ in range(5):
        seq = torch.cat([seq, glm5f.forward(params, toy, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)

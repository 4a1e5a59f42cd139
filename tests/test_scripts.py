"""The user-facing scripts on tiny runs: convert (DCP -> Transformers), generate (streamed decoding)."""

import os

import pytest
import torch
import tyro

import glm5f
from configs import Config
from glm5f import checkpoint
from scripts import convert
from train import train

TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A two-step glm5-tiny run on the embedded text."""
    run = tmp_path_factory.mktemp("run")
    train(tyro.cli(Config, args=TINY + ["--checkpoint.dir", str(run)], use_underscores=True))
    return run


def test_convert_loads_in_transformers_with_the_same_logits(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert convert.main([str(run_dir), str(tmp_path / "hf")]) == 0
    assert "step_00000002" in capsys.readouterr().out
    cfg, params = checkpoint.load_params(checkpoint.latest(str(run_dir)))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(ids).logits
    ours = glm5f.forward(params, cfg, ids)
    assert (ours - theirs).abs().max() <= 1e-5


def test_convert_errors(run_dir, tmp_path, capsys):
    assert convert.main([str(tmp_path / "missing"), str(tmp_path / "hf")]) == 1
    assert "error:" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert convert.main([str(tmp_path / "empty"), str(tmp_path / "hf")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    assert convert.main([str(run_dir), str(tmp_path / "notes")]) == 1
    assert "not a previous glm5f export" in capsys.readouterr().err
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"

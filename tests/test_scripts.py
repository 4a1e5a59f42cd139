"""The user-facing scripts on tiny runs: convert (DCP -> Transformers), generate (streamed decoding)."""

import os

import pytest
import torch
import tyro

import glm5f
from configs import Config
from glm5f import checkpoint
from glm5f.data import ByteTokenizer
from glm5f.decode import sample
from scripts import convert, generate
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


def argmax_continuation(params, cfg, ids, n, eos):
    """Greedy tokens by the full forward over the growing sequence, up to eos."""
    ids, out = torch.tensor([ids]), []
    for _ in range(n):
        token = int(glm5f.forward(params, cfg, ids)[0, -1].argmax())
        if token == eos:
            break
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_generate_streams_the_greedy_continuation(run_dir, capsys, monkeypatch):
    printed = []
    real = generate.print_stream
    monkeypatch.setattr(generate, "print_stream", lambda tok, tokens: printed.append(real(tok, tokens)))
    assert generate.main([str(run_dir), "--prompt", "The ", "--max-tokens", "24"]) == 0
    cfg, params = checkpoint.load_params(checkpoint.latest(str(run_dir)))
    tok = ByteTokenizer()
    want = argmax_continuation(params, cfg, [tok.bos_id] + tok.encode("The "), 24, tok.eos_id)
    assert printed == [want]
    assert capsys.readouterr().out == "The " + tok.decode(want) + "\n"


def test_generate_sampling_is_seeded_and_errors_are_lines(run_dir, tmp_path, capsys):
    args = [str(run_dir), "--prompt", "a", "--max-tokens", "16", "--temperature", "1.0", "--top-p", "0.9"]
    assert generate.main(args + ["--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert generate.main(args + ["--seed", "3"]) == 0
    assert capsys.readouterr().out == first
    assert generate.main([str(tmp_path / "nothing"), "--prompt", "a"]) == 1
    assert capsys.readouterr().err.startswith("error: ")
    (tmp_path / "empty-run").mkdir()
    assert generate.main([str(tmp_path / "empty-run"), "--prompt", "a"]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_top_p_keeps_the_smallest_likely_set():
    logits_1xV = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    assert set(int(sample(logits_1xV, 1.0, 0.01, g)) for _ in range(50)) == {0}
    assert set(int(sample(logits_1xV, 1.0, 0.75, g)) for _ in range(200)) == {0, 1}
    assert int(sample(logits_1xV, 0.0)) == 0

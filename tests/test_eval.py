"""Held-out evaluation: the logged eval_loss is the loss of the saved params on the held-out batches, and the
held-out data is never trained on."""

import json

import pytest
import torch
import tyro

import glm5f
from configs import Config, with_data_type
from glm5f import checkpoint
from glm5f.data import embedded_documents, make_eval_source, make_source
from glm5f.metrics import read_metrics
from train import main, train

TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--eval.batches", "2"]


def cli(*args: str) -> Config:
    return tyro.cli(Config, args=list(args), use_underscores=True)


def independent_eval_loss(params, cfg, batches) -> float:
    total, count = 0.0, 0
    for b in batches:
        logits = glm5f.forward(params, cfg, b["input_ids"], position_ids=b["position_ids"])
        s, n = glm5f.cross_entropy_sum(logits, glm5f.shift_labels(b["labels"]))
        total, count = total + float(s), count + int(n)
    return total / count


def test_eval_loss_is_the_loss_of_the_params_on_the_held_out_batches(tmp_path, capsys):
    recs = train(cli(*TINY, "--train.steps", "3", "--eval.every", "2", "--checkpoint.dir", str(tmp_path)))
    assert [r["step"] for r in recs if "eval_loss" in r] == [2, 3]  # every 2 steps and at the end
    assert "eval_loss" in capsys.readouterr().out
    logged = read_metrics(tmp_path)[-1]
    cfg, params = checkpoint.load_params(checkpoint.latest(str(tmp_path)))
    src = make_eval_source("text", vocab_size=cfg.vocab_size, batch_size=2, seq_len=32)
    batches = [src.next_batch() for _ in range(2)]
    want = independent_eval_loss(params, cfg, batches)
    assert logged["eval_loss"] == pytest.approx(want, rel=1e-6)
    assert logged["eval_ppl"] == pytest.approx(torch.tensor(want).exp().item(), rel=1e-6)
    both = {k: torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels", "position_ids")}
    logits = glm5f.forward(params, cfg, both["input_ids"], position_ids=both["position_ids"])
    assert logged["eval_loss"] == pytest.approx(float(glm5f.causal_lm_loss(logits, both["labels"])), rel=1e-6)


def test_held_out_documents_are_never_in_a_training_batch():
    docs, train_docs, held = embedded_documents(), embedded_documents("train"), embedded_documents("eval")
    assert len(held) == len(docs) // 20 and sorted(train_docs + held) == sorted(docs)
    src = make_source("text", vocab_size=512, batch_size=16, seq_len=128)
    tokens, epoch_tokens = [], sum(len(ex.ids) for ex in src.examples)
    while len(tokens) < epoch_tokens + 16 * 128:  # a whole epoch, packed as training sees it
        tokens += src.next_batch()["input_ids"].flatten().tolist()
    stream = bytes(t for t in tokens if t < 256)
    for text in train_docs[:5]:
        assert text.encode() in stream  # the check can see a document
    for text in held:
        assert text.encode() not in stream and text.encode()[:200] not in stream


def test_eval_from_a_file_and_errors(tmp_path, capsys):
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": f"held out document number {i}"}) + "\n" for i in range(8)))
    recs = train(cli(*TINY, "--train.steps", "1", "--eval.path", str(data), "--checkpoint.dir", str(tmp_path / "a")))
    cfg, params = checkpoint.load_params(checkpoint.latest(str(tmp_path / "a")))
    src = make_source("json_file", vocab_size=cfg.vocab_size, batch_size=2, seq_len=32, path=str(data))
    assert recs[-1]["eval_loss"] == pytest.approx(
        independent_eval_loss(params, cfg, [src.next_batch() for _ in range(2)]), rel=1e-6)
    assert main(TINY + ["--eval.split", "test", "--checkpoint.dir", str(tmp_path / "b")]) == 1
    assert "--eval.split needs --data.type hf_datasets" in capsys.readouterr().err
    assert main(TINY + ["--eval.path", str(tmp_path / "none.jsonl"), "--checkpoint.dir", str(tmp_path / "c")]) == 1
    assert "none.jsonl" in capsys.readouterr().err


def test_default_run_evaluates():
    cfg = with_data_type(cli())  # no --data.type and no --data.path: the embedded text
    assert cfg.data.type == "text" and 0 < cfg.eval.every <= cfg.train.steps

"""An objective owns its lifecycle: the toy of tests/toy_objective.py (settings, its own data type, two updates per
batch), added to the table alone, trains through train.py (its first loss that of plain torch), resumes bit for bit
between a batch's two updates, plans, and its flags are refused under another objective."""

import pytest
import torch
import torch.nn.functional as F

import glm5f
from configs import parse, validate
from glm5f.ckpt import checkpoint
from glm5f.core import IGNORE_INDEX
from glm5f.core.params import flatten
from glm5f.objectives import OBJECTIVES
from glm5f.run.plan import plan, run_shape
from toy_objective import TOY, CountSource
from train import main, train

FLAGS = ["--model.preset", "glm5-tiny", "--train.objective", "toy", "--data.type", "toy_counts", "--data.batch_size",
         "2", "--data.seq_len", "32", "--eval.every", "0", "--train.dtype", "float64", "--optim.warmup_steps", "0",
         "--optim.lr", "0.01", "--toy.period", "2", "--checkpoint.every", "1", "--checkpoint.keep", "0"]


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "toy", TOY)  # the table line


def test_the_toy_trains_resumes_bitwise_between_updates_and_plans(toy, tmp_path, capsys):
    straight = train(parse([*FLAGS, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "straight")]))

    # step 1: the toy loss (--toy.period 2) of the source's first batch under the initial params, in plain torch
    model_cfg = glm5f.preset("glm5-tiny")
    batch = CountSource(2, 32, model_cfg.vocab_size).next_batch()
    logits_BxSxV = glm5f.forward(glm5f.init_params(model_cfg, 0, torch.float64), model_cfg, batch["input_ids"])
    targets_BxS = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
    ce_BxS = F.cross_entropy(logits_BxSxV.transpose(1, 2), targets_BxS, ignore_index=IGNORE_INDEX, reduction="none")
    w_BxS = (1.0 + torch.arange(32, dtype=torch.float64) % 2) * (targets_BxS != IGNORE_INDEX)
    assert straight[0]["loss"] == pytest.approx(((ce_BxS * w_BxS).sum() / w_BxS.sum()).item(), rel=1e-10)
    assert straight[-1]["loss"] < straight[0]["loss"]

    # two updates per batch: 6 steps drew 3 batches; a checkpoint between a batch's updates holds that batch
    ckpts = tmp_path / "straight" / "checkpoints"
    assert checkpoint.read_extra(str(ckpts / "step_00000006"))["data"] == {"drawn": 3}
    held = checkpoint.read_extra(str(ckpts / "step_00000003"))["batch"]
    second = CountSource(2, 32, model_cfg.vocab_size)
    second.next_batch()
    assert torch.equal(held["input_ids"], second.next_batch()["input_ids"])

    # stopped after step 3 (between the second batch's updates) and resumed: the uninterrupted run, bit for bit
    train(parse([*FLAGS, "--train.steps", "3", "--optim.schedule_steps", "6", "--checkpoint.dir",
                 str(tmp_path / "resumed")]))
    resumed = train(parse([*FLAGS, "--train.steps", "6", "--checkpoint.dir", str(tmp_path / "resumed"),
                           "--checkpoint.resume", "latest"]))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    ends = [flatten(checkpoint.load_params(checkpoint.latest(str(tmp_path / r)))[1]) for r in ("straight", "resumed")]
    assert all(torch.equal(t, ends[1][p]) for p, t in ends[0].items())

    # the plan counts the row's bytes, and --plan prints its row
    toy_plan = plan(model_cfg, run_shape(parse(FLAGS)))
    assert toy_plan["objective_bytes"] == 2 * 32 * 8
    assert main(["--plan", "table", *FLAGS]) == 0
    assert "objective toy (beyond the LM step)" in capsys.readouterr().out


def test_the_toy_flags_are_its_own(toy):
    lm = ["--model.preset", "glm5-tiny", "--data.type", "synthetic"]
    assert validate(parse([*lm, "--toy.updates", "3"])) == [
        "--toy.updates is for --train.objective toy, not lm (which would ignore it); drop it, or pass "
        "--train.objective toy"]
    assert validate(parse([*lm, "--data.type", "toy_counts"])) == [
        "--data.type toy_counts holds data for --train.objective toy, not lm; pass --train.objective toy, or data "
        "that lm trains on"]
    assert validate(parse([*FLAGS, "--toy.period", "0"])) == ["--toy.period and --toy.updates must be >= 1"]

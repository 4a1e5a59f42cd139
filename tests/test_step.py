"""glm5f.train.step: the train step as one function and main objectives as rows. A toy objective added through the table
alone is checked against plain torch (value, one AdamW update), trained through train.py, resumed bit for bit and
planned; a LoRA step trains only the adapters."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import glm5f
from configs import validate
from conftest import cli
from glm5f.ckpt import checkpoint
from glm5f.model import lora
from glm5f.data import IGNORE_INDEX
from glm5f.train.loss import Objective
from glm5f.model.head import head_token_losses
from glm5f.parallel.layout import Layout
from glm5f.core.params import flatten
from glm5f.run.plan import plan, run_shape
from glm5f.objectives import OBJECTIVES, objective
from glm5f.train.step import Trainer, train_step
from train import TrainingError, main, train

TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0"]


def position_weights(targets_BxS: torch.Tensor) -> torch.Tensor:
    """The toy objective's fixed weights [B, S]: 1, 2, 3, 1, 2, 3, ... along the sequence, 0 where no target."""
    S = targets_BxS.shape[1]
    w_S = 1.0 + torch.arange(S, dtype=torch.float64, device=targets_BxS.device) % 3
    return w_S.expand_as(targets_BxS) * (targets_BxS != IGNORE_INDEX)


def weighted_loss(params, batch, ctx):
    """The toy objective: each token's LM loss weighted by its position's weight, over the sum of the weights."""
    hidden_BxSxD, head = ctx.forward(params, batch)
    loss_N = head_token_losses(head, hidden_BxSxD, batch["targets"], ctx.cfg.rms_norm_eps)
    sums = {"loss": (loss_N.to(torch.float64) * batch["position_weights"].flatten()).sum()}
    return sums["loss"] / ctx.denoms["weight"], sums


TOY = Objective(weighted_loss, lambda batch: {"weight": batch["position_weights"].sum().clamp(min=1)},
                {"loss": "weight"},
                prepare=lambda batch, settings: {**batch, "position_weights": position_weights(batch["targets"])},
                plan_bytes=lambda model_cfg, run, state: state["params"])  # as if it held a reference copy


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, "toy", TOY)


def test_a_toy_objective_step_is_plain_torch_and_adamw(toy):
    """One train_step with the toy objective (fp64): its loss is the weighted cross-entropy of glm5f.forward's
    logits, and its update that of torch.optim.AdamW on the gradients of that loss clipped as
    torch.nn.utils.clip_grad_norm_ clips; the leaves it does not train stay as they were."""
    cfg = cli(*TINY, "--train.objective", "toy", "--train.dtype", "float64", "--optim.bias_update_rate", "0",
              "--optim.clip_norm", "0.5")
    model_cfg = cfg.model.build()
    params = glm5f.init_params(model_cfg, 0, torch.float64)
    before = {p: t.clone() for p, t in flatten(params).items()}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 32), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX
    trainer = Trainer.of(cfg, model_cfg, Layout(torch.device("cpu")), objective(cfg.train.objective))
    state = trainer.init(params)
    trained = trainer.step.trained(params)
    state, metrics = train_step(state, {"input_ids": ids, "labels": labels}, trainer)

    ref = {p: t.clone().requires_grad_(p in trained) for p, t in before.items()}
    logits_BxSxV = glm5f.forward(glm5f.unflatten(ref, params), model_cfg, ids)
    targets_BxS = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
    ce_BxS = F.cross_entropy(logits_BxSxV.transpose(1, 2), targets_BxS, ignore_index=IGNORE_INDEX, reduction="none")
    w_BxS = (1.0 + torch.arange(32) % 3).to(torch.float64) * (targets_BxS != IGNORE_INDEX)
    value = (ce_BxS * w_BxS).sum() / w_BxS.sum()
    assert metrics["loss"] == pytest.approx(value.item(), rel=1e-12)
    leaves = [ref[p] for p in trained]
    grads = torch.autograd.grad(value, leaves)
    for leaf, grad in zip(leaves, grads):
        leaf.grad = grad
    norm = torch.nn.utils.clip_grad_norm_(leaves, 0.5)
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-10)
    lr = cfg.optim.lr / cfg.optim.warmup_steps  # the first warm-up step's
    assert metrics["lr"] == pytest.approx(lr)
    opt = torch.optim.AdamW([{"params": [x for x in leaves if x.ndim >= 2], "weight_decay": 0.1},
                             {"params": [x for x in leaves if x.ndim < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    opt.step()
    after = flatten(state.params)
    for p, t in after.items():
        if p in trained:
            assert not torch.equal(t, before[p]), p
            torch.testing.assert_close(t, ref[p].detach(), rtol=0, atol=1e-12, msg=p)
        else:
            assert torch.equal(t, before[p]), f"{p} is not trained, yet it changed"
    assert state.step == 1 and int(state.opt_state["count"]) == 1


def test_a_toy_objective_trains_resumes_bitwise_and_plans(toy, tmp_path, capsys):
    """The toy objective through train.py: the loss falls; a run stopped at step 4 and resumed ends with the
    params of an uninterrupted run bit for bit; the run records its objective and a resume under another is
    refused; the plan counts what the row declares."""
    common = [*TINY, "--data.type", "text", "--optim.warmup_steps", "2", "--optim.lr", "0.01",
              "--optim.schedule_steps", "8", "--checkpoint.every", "2"]
    args = [*common, "--train.objective", "toy"]
    straight = train(cli(*args, "--train.steps", "8", "--checkpoint.dir", str(tmp_path / "straight")))
    assert straight[-1]["loss"] < straight[0]["loss"] - 0.3, [r["loss"] for r in straight]
    train(cli(*args, "--train.steps", "4", "--checkpoint.dir", str(tmp_path / "resumed")))
    resumed = train(cli(*args, "--train.steps", "8", "--checkpoint.dir", str(tmp_path / "resumed"),
                        "--checkpoint.resume", "latest"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[4:]]
    ends = [checkpoint.load_params(checkpoint.latest(str(tmp_path / run)))[1] for run in ("straight", "resumed")]
    for p, t in flatten(ends[0]).items():
        assert torch.equal(t, flatten(ends[1])[p]), p
    meta = checkpoint.read_meta(checkpoint.latest(str(tmp_path / "resumed")))
    assert meta["run"]["train"]["objective"] == "toy"
    assert "objective: toy" in (tmp_path / "resumed" / "config.yaml").read_text()
    with pytest.raises(TrainingError, match="saved by a run with --train.objective toy, not lm: resume with "
                                            "--train.objective toy"):
        train(cli(*common, "--train.steps", "9", "--checkpoint.dir", str(tmp_path / "resumed"), "--checkpoint.resume",
                  "latest"))

    model_cfg = glm5f.preset("glm5-tiny")
    lm, toy_plan = (plan(model_cfg, run_shape(cli(*TINY, "--train.objective", name))) for name in ("lm", "toy"))
    assert lm["objective_bytes"] == 0 and toy_plan["objective_bytes"] == lm["params_bytes"] > 0
    assert toy_plan["total_bytes"] - lm["total_bytes"] == lm["params_bytes"]
    assert main(["--plan", "table", *args]) == 0
    out = capsys.readouterr().out
    assert "objective toy (beyond the LM step)" in out, out


def test_the_objective_flag_takes_the_table_and_its_data_types(toy, monkeypatch, tmp_path, capsys):
    assert not validate(cli(*TINY, "--train.objective", "toy"))
    assert main([*TINY, "--train.objective", "ppo", "--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "--train.objective 'ppo' is unknown; choose one of lm, dpo, grpo, toy" in err and not (tmp_path / "run").exists()
    monkeypatch.setitem(OBJECTIVES, "toy", dataclasses.replace(TOY, data_types=("chat",)))
    assert validate(cli(*TINY, "--train.objective", "toy")) == [
        "--train.objective toy trains on --data.type chat, not synthetic; pass one of them"]


def test_a_lora_step_trains_only_the_adapters():
    """train_step with the adapters as the trained tree and the base as the frozen one: every adapter's B moves
    off zero and the optimizer state covers the adapters alone; the base, router biases included (the bias rule
    is on), stays bit for bit."""
    cfg = cli(*TINY, "--lora.rank", "4", "--lora.targets", r"self_attn\.(q_b_proj|o_proj)$|mlp\.experts\.up_proj$")
    model_cfg = cfg.model.build()
    assert cfg.optim.bias_update_rate > 0
    params = glm5f.init_params(model_cfg)
    adapters = lora.init_adapters(params, cfg.lora.spec())
    base = {p: t.clone() for p, t in flatten(params).items()}
    trainer = Trainer.of(cfg, model_cfg, Layout(torch.device("cpu")), objective(cfg.train.objective))
    state = trainer.init(adapters, params)
    assert set(state.opt_state["mu"]) == set(adapters)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, model_cfg.vocab_size, (2, 32), generator=g)
        state, metrics = train_step(state, {"input_ids": ids, "labels": ids}, trainer)
    assert state.step == 2 and state.frozen is params and set(state.trained) == set(adapters)
    assert all(state.trained[p].abs().sum() > 0 for p in adapters if p.endswith(".lora_B"))
    biases = [p for p in base if p.endswith("e_score_correction_bias")]
    assert biases
    for p, t in flatten(state.frozen).items():
        assert torch.equal(t, base[p]), f"the frozen {p} changed"
    assert state.saved().keys() == {"adapters", "optim"}


def test_full_training_balances_the_router_biases_it_trains():
    """Full training: the router-bias rule moves the biases --train.trainable selects, and only those."""
    cfg = cli(*TINY, "--train.trainable", r"layers\.1\.")
    model_cfg = cfg.model.build()
    params = glm5f.init_params(model_cfg)
    before = {p: t.clone() for p, t in flatten(params).items()}
    trainer = Trainer.of(cfg, model_cfg, Layout(torch.device("cpu")), objective(cfg.train.objective))
    ids = torch.randint(0, model_cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    state, _ = train_step(trainer.init(params), {"input_ids": ids, "labels": ids}, trainer)
    after = flatten(state.trained)
    assert not torch.equal(after["model.layers.1.mlp.gate.e_score_correction_bias"],
                           before["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert torch.equal(after["model.layers.2.mlp.gate.e_score_correction_bias"],
                       before["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert state.saved().keys() == {"params", "optim"}

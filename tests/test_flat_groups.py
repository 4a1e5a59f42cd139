"""--rl.filter_flat_groups (DAPO's dynamic sampling): flat groups are dropped and more prompts sampled until the batch
is full; the counts are logged, the step is a step over just the kept groups (fp64, against a rollouts run of them),
and the round cap fills the batch with flat groups and says so."""

import json
from types import SimpleNamespace

import pytest
import torch

import glm5f
from configs import validate
from conftest import cli
from glm5f.data.chat import ChatFormat
from glm5f.data.sources import model_tokenizer
from glm5f.posttrain import sampler
from glm5f.posttrain.grpo import RLConfig, groups_with_signal, is_flat
from glm5f.run.metrics import read_metrics
from train import train

FLAT = {0, 1, 3, 4, 6}  # the prompts whose reward is the same for every completion


def flat_or_sum(*, completion_ids, flat, **fields) -> float:
    """1 for a record marked flat, else a number of the completion's ids (distinct completions: distinct rewards)."""
    return 1.0 if flat else float(sum((i + 1) * t for i, t in enumerate(completion_ids)))


def write_prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"w{i}:", "flat": i in FLAT}) + "\n" for i in range(8)))
    return str(path)


def flags(tmp_path, run, *extra):
    return ["--model.preset", "glm5-tiny", "--train.objective", "grpo", "--train.dtype", "float64", "--data.batch_size",
            "2", "--data.seq_len", "16", "--rl.group_size", "3", "--rl.max_new_tokens", "5", "--train.steps", "1",
            "--eval.every", "0", "--optim.warmup_steps", "0", "--optim.lr", "1e-2", "--checkpoint.dir",
            str(tmp_path / run), *extra]


def test_flat_groups_are_dropped_and_the_step_is_a_step_over_the_kept_ones(tmp_path):
    path = write_prompts(tmp_path)
    # the groups the run samples, drawn here as it draws them: the same params, seeds and prompt order
    cfg = glm5f.preset("glm5-tiny")
    tok = model_tokenizer(None, cfg.vocab_size)
    s = RLConfig(group_size=3, max_new_tokens=5)
    src = sampler.PromptSource(sampler.read_prompts(path, tok, ChatFormat.load(None)), 2, 16, cfg, 0, tok.pad_id, s,
                               flat_or_sum, "r", tok, 0)
    params = glm5f.init_params(cfg, 0, torch.float64)
    rounds, every = 0, []
    while sum(not is_flat(g) for g in every) < 2:
        every += src.next_groups(params)
        rounds += 1
    kept = [g for g in every if not is_flat(g)][:2]
    flat = [g for g in every if is_flat(g)]
    assert rounds >= 2 and len(flat) >= 2  # the filter has work to do
    assert all(g.prompt["flat"] == is_flat(g) for g in every)  # the reward makes exactly the marked groups flat

    records = train(cli(*flags(tmp_path, "filtered", "--data.type", "prompts", "--data.path", path, "--rl.reward",
                                "test_flat_groups:flat_or_sum", "--rl.filter_flat_groups")))
    rec = read_metrics(tmp_path / "filtered")[0]
    assert (rec["groups_sampled"], rec["groups_flat_dropped"], rec["sample_rounds"], rec["groups_flat_kept"]) == (
        2 * rounds, len(flat), rounds, 0)
    assert rec["frac_reward_zero_std"] == 0.0  # no flat group trained on
    # the kept groups as a rollouts file: a run of them takes the same step
    rollouts = tmp_path / "kept.jsonl"
    rollouts.write_text("".join(json.dumps({"prompt_ids": g.prompt["prompt_ids"], "completions": [
        {"ids": c.example.ids[len(g.prompt["prompt_ids"]):], "reward": c.reward, "logprobs": c.logprobs}
        for c in g.completions]}) + "\n" for g in kept))
    want = train(cli(*flags(tmp_path, "kept", "--data.type", "rollouts", "--data.path", str(rollouts),
                            "--checkpoint.every", "1")))
    for k in ("loss", "grad_norm", "reward", "reward_std", "completion_length", "advantage_abs"):
        assert records[0][k] == pytest.approx(want[0][k], rel=1e-12, abs=1e-14), k
    unfiltered = train(cli(*flags(tmp_path, "unfiltered", "--data.type", "prompts", "--data.path", path,
                                  "--rl.reward", "test_flat_groups:flat_or_sum")))
    assert unfiltered[0]["frac_reward_zero_std"] > 0 and "groups_sampled" not in unfiltered[0]


def group(*rewards):
    return SimpleNamespace(completions=[SimpleNamespace(reward=r) for r in rewards])


def test_the_round_cap_fills_the_batch_with_the_last_flat_groups():
    rounds = iter([[group(1, 1), group(0, 1), group(2, 2)], [group(3, 3), group(4, 4), group(5, 5)]])
    out, counts = groups_with_signal(lambda: next(rounds), 3, 2)
    assert [[c.reward for c in g.completions] for g in out] == [[0, 1], [4, 4], [5, 5]]
    assert counts == {"groups_sampled": 6, "groups_flat_dropped": 3, "sample_rounds": 2, "groups_flat_kept": 2}
    rounds = iter([[group(1, 1), group(0, 1)], [group(0, 2), group(3, 1)]])  # full after 2: the surplus dropped
    out, counts = groups_with_signal(lambda: next(rounds), 2, 5)
    assert [[c.reward for c in g.completions] for g in out] == [[0, 1], [0, 2]]
    assert counts == {"groups_sampled": 4, "groups_flat_dropped": 1, "sample_rounds": 2, "groups_flat_kept": 0}


@pytest.mark.parametrize("extra, message", [
    (["--data.type", "rollouts", "--rl.filter_flat_groups"], "--rl.filter_flat_groups samples more prompts"),
    (["--data.type", "prompts", "--rl.reward", "m:f", "--rl.max_sample_rounds", "0"], "--rl.max_sample_rounds must"),
])
def test_flags_that_cannot_work_are_refused(extra, message):
    assert any(message in e for e in validate(cli("--train.objective", "grpo", "--data.path", "p.jsonl", *extra)))


@pytest.mark.slow
def test_the_filter_under_dp_shard_2_equals_one_process_fp64(tmp_path):
    """Every rank takes the same groups (the filter runs on the gathered groups): dp_shard 2's counts, rewards,
    losses and weights equal one process's."""
    from glm5f.ckpt.checkpoint import latest, load_params
    from glm5f.core.params import flatten
    from train import main

    path = write_prompts(tmp_path)

    def run(name, *extra):
        assert main(flags(tmp_path, name, "--data.type", "prompts", "--data.path", path, "--rl.reward",
                          "test_flat_groups:flat_or_sum", "--rl.filter_flat_groups", "--train.steps", "2",
                          "--checkpoint.every", "2", *extra)) == 0
        return read_metrics(tmp_path / name), flatten(load_params(latest(str(tmp_path / name)))[1])
    want, ref = run("one")
    got, params = run("dp2", "--parallel.dp_shard", "2")
    for a, b in zip(got, want, strict=True):
        for k in ("groups_sampled", "groups_flat_dropped", "sample_rounds", "reward", "loss"):
            assert abs(a[k] - b[k]) <= 1e-9, (k, a[k], b[k])
    assert max(float((params[k] - w).abs().max()) for k, w in ref.items()) <= 1e-9

"""Recipe files (`--config FILE.yaml`): every shipped recipe runs (at toy size, or its plan where it names GLM-5), a
run's config.yaml repeats the run bit for bit, and a file that does not fit the config is an error line."""

import json
import math
import os
import re

import pytest
import torch
import yaml

from configs import load_config
from glm5f.run.rundir import CONFIG_FILE
from glm5f.ckpt import checkpoint
from glm5f.run.metrics import read_metrics
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
TOY = ["--train.steps", "2", "--data.batch_size", "2", "--optim.warmup_steps", "1", "--eval.batches", "1",
       "--train.log_every", "1"]


def recipe(name: str) -> str:
    return os.path.join(RECIPES, name)


def written(run_dir) -> dict:
    return yaml.safe_load(open(os.path.join(run_dir, CONFIG_FILE)))


def test_every_shipped_recipe_is_covered_here():
    assert sorted(os.listdir(RECIPES)) == ["agent-tiny.yaml", "chat-sft.yaml", "dpo-lora.yaml", "glm5-full-sft.yaml",
                                           "glm5-lora-sft.yaml",
                                           "glm5-muon-sft.yaml", "grpo-tiny.yaml", "indexer-warmup.yaml", "muon-moe.yaml",
                                           "sparse-stage.yaml", "tiny.yaml"]
    for name in os.listdir(RECIPES):
        load_config(recipe(name))  # parses, every key known and of its type


@pytest.mark.parametrize("name, seq_len", [("tiny.yaml", "32"), ("chat-sft.yaml", "256"), ("muon-moe.yaml", "32")])
def test_a_recipe_runs_at_toy_size_with_flags_over_it(tmp_path, name, seq_len):
    run = tmp_path / "run"
    assert main(["--config", recipe(name), *TOY, "--data.seq_len", seq_len, "--checkpoint.dir", str(run)]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and "eval_loss" in read_metrics(run)[-1]
    file, got = yaml.safe_load(open(recipe(name))), written(run)
    assert got["train"]["steps"] == 2 and got["data"]["seq_len"] == int(seq_len)  # the flags won
    assert got["checkpoint"]["dir"] == str(run)
    for section, fields in file.items():  # the rest is the file's
        for key, value in fields.items():
            if f"--{section}.{key}" not in TOY + ["--data.seq_len", "--checkpoint.dir"]:
                assert got[section][key] == value, f"{section}.{key}"


def test_the_dpo_recipe_starts_at_ln_2_and_learns(tmp_path):
    """recipes/dpo-lora.yaml: the base is the reference, so step 1's loss is ln 2; at toy length the loss falls and
    the implicit reward margin turns positive."""
    run = tmp_path / "run"
    assert main(["--config", recipe("dpo-lora.yaml"), "--train.steps", "8", "--train.log_every", "1",
                 "--checkpoint.dir", str(run)]) == 0
    records = read_metrics(run)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and records[0]["margin"] == 0
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["margin"] > 0
    assert written(run)["train"]["objective"] == "dpo"


def test_the_grpo_recipe_samples_on_policy_and_its_reward_rises(tmp_path):
    """recipes/grpo-tiny.yaml, shortened: every step samples its groups (sample_time_s) from the embedded prompts
    and scores them with the shipped reward; the mean reward of the last steps is above the first steps'."""
    run = tmp_path / "run"
    assert main(["--config", recipe("grpo-tiny.yaml"), "--train.steps", "12", "--train.log_every", "1",
                 "--checkpoint.dir", str(run)]) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 13)) and all(r["sample_time_s"] > 0 for r in records)
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    assert written(run)["rl"]["reward"] == "glm5f.posttrain.rewards:lowercase_share"


@pytest.mark.slow
def test_the_agent_recipe_learns_to_end_its_turns(tmp_path):
    """recipes/agent-tiny.yaml, shortened: multi-turn episodes against its environment; by step 12 the episodes
    take more turns and earn more than at the start (docs/posttraining.md has the 40-step curve)."""
    run = tmp_path / "run"
    assert main(["--config", recipe("agent-tiny.yaml"), "--train.steps", "12", "--train.log_every", "1",
                 "--checkpoint.dir", str(run)]) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[:4], records[-4:]
    assert sum(r["reward"] for r in last) > sum(r["reward"] for r in first), [r["reward"] for r in records]
    assert sum(r["turns"] for r in last) > sum(r["turns"] for r in first), [r["turns"] for r in records]


def test_indexer_warmup_then_sparse_stage(tmp_path):
    warm, sparse = tmp_path / "warmup", tmp_path / "sparse"
    assert main(["--config", recipe("indexer-warmup.yaml"), *TOY, "--data.seq_len", "32",
                 "--checkpoint.dir", str(warm), "--checkpoint.export_hf", str(warm / "hf")]) == 0
    assert all("indexer_loss" in r for r in read_metrics(warm)) and (warm / "hf" / "config.json").is_file()
    assert main(["--config", recipe("sparse-stage.yaml"), *TOY, "--data.seq_len", "32",
                 "--model.init_from", str(warm / "hf"), "--checkpoint.dir", str(sparse)]) == 0
    assert [r["indexer_recall"] for r in read_metrics(sparse)] == pytest.approx([1, 1], abs=1e-6)  # over the top-k
    got = written(sparse)
    assert got["model"]["init_from"] == str(warm / "hf") and got["train"]["indexer_loss"] == "sparse"


def assert_plan_is_the_comment(path: str, capsys) -> None:
    """The recipe's `--plan table`, line by line, is the table in its comment (less the lines that depend on the
    machine that printed it: the measured runtime and the peaks and totals it enters)."""
    assert main(["--config", path, "--plan", "table"]) == 0
    table = capsys.readouterr().out.splitlines()
    comment = [line[4:].rstrip("\n") for line in open(path)
               if line.startswith("#   ") and re.search(r"GB|memory plan", line)]
    fixed = [line for line in comment if not re.search(r"runtime|peak|total|fits", line)]
    assert len(fixed) >= 9 and all(line in table for line in fixed), [line for line in fixed if line not in table]


def test_glm5_full_sft_recipe_plans_what_its_comment_says(capsys):
    """The GLM-5 recipe's plan (shapes only) is the plan of the same run given as flags, and the table in its
    comment is what `--plan table` prints (but for the measured runtime and the totals that include it)."""
    path = recipe("glm5-full-sft.yaml")
    assert main(["--config", path, "--plan", "json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    flags = ["--model.preset", "glm5", "--data.type", "chat", "--data.path", "data/sft.jsonl", "--data.seq_len",
             "4096", "--data.batch_size", "256", "--train.dtype", "bfloat16", "--train.activation_checkpointing",
             "--train.indexer_loss", "sparse", "--parallel.dp_shard", "128", "--parallel.ep", "16",
             "--parallel.device_memory_gb", "141", "--plan", "json"]
    assert main(flags) == 0
    from_flags = json.loads(capsys.readouterr().out)
    for key in ("world", "ep", "params_bytes", "grads_bytes", "optimizer_bytes", "gathered_bytes",
                "activations_bytes", "device_bytes"):
        assert from_file[key] == from_flags[key], key
    assert from_file["fits"] and from_file["world"] == 128
    assert_plan_is_the_comment(path, capsys)


def test_glm5_muon_sft_recipe_plans_what_its_comment_says(capsys):
    """The Muon recipe is the full-SFT run with --optim.name muon: the same plan but for the optimizer's state,
    one fp32 momentum a parameter of Muon's leaves (about half AdamW's two moments), and its table is the comment's."""
    plans = []
    for name in ("glm5-full-sft.yaml", "glm5-muon-sft.yaml"):
        assert main(["--config", recipe(name), "--plan", "json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    adamw, muon = plans
    assert (muon["optimizer"], adamw["optimizer"]) == ("muon", "adamw")
    for key in ("world", "ep", "params_bytes", "grads_bytes", "gathered_bytes", "activations_bytes"):
        assert muon[key] == adamw[key], key
    assert adamw["optimizer_bytes"] == 2 * adamw["grads_bytes"]
    assert 0.5 < muon["optimizer_bytes"] / adamw["optimizer_bytes"] < 0.51  # the embedding, head, router: AdamW
    assert muon["fits"] and muon["total_bytes"] < adamw["total_bytes"]
    assert_plan_is_the_comment(recipe("glm5-muon-sft.yaml"), capsys)


def test_glm5_lora_sft_recipe_plans_what_its_comment_says_and_runs_at_toy_size(tmp_path, capsys):
    """The GLM-5 LoRA recipe: its plan table is the one in its comment (half the ranks of full SFT), and the same
    file trains glm5-tiny's adapters in one process (the model, mesh, data path and sizes overridden)."""
    path = recipe("glm5-lora-sft.yaml")
    assert main(["--config", path, "--plan", "json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["fits"] and p["world"] == 64 and p["optimizer_bytes"] < 1e-3 * p["params_bytes"]
    assert_plan_is_the_comment(path, capsys)
    run = tmp_path / "run"
    assert main(["--config", path, *TOY, "--model.preset", "glm5-tiny", "--data.path", "None", "--data.seq_len", "256",
                 "--parallel.dp_shard", "1", "--parallel.ep", "1", "--checkpoint.export_peft", "None",
                 "--checkpoint.dir", str(run)]) == 0
    got = written(run)
    assert got["lora"] == yaml.safe_load(open(path))["lora"] and [r["step"] for r in read_metrics(run)] == [1, 2]
    spec, adapters = checkpoint.load_adapters(str(run))
    assert (spec.rank, spec.alpha) == (8, 16.0) and all("self_attn" in p for p in adapters)


def test_a_runs_config_yaml_repeats_it_bit_for_bit(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("# a recipe of my own\noptim: {lr: 1e-3, warmup_steps: 1}\ntrain: {seed: 5, steps: 50}\n"
                    "data: {type: synthetic, seed: 2, batch_size: 2, seq_len: 32}\nmodel: {preset: glm5-tiny}\n"
                    "eval: {every: 2, batches: 1}\n")
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["--config", str(mine), "--train.steps", "3", "--checkpoint.dir", str(a)]) == 0
    got = written(a)
    assert (got["optim"]["lr"], got["train"]["seed"], got["train"]["steps"], got["data"]["seed"]) == (1e-3, 5, 3, 2)
    assert main(["--config", str(a / CONFIG_FILE), "--checkpoint.dir", str(b)]) == 0
    timing = ("tokens_per_s", "step_time_s")
    ra, rb = ([{k: v for k, v in r.items() if k not in timing} for r in read_metrics(d)] for d in (a, b))
    assert len(ra) == 3 and ra == rb and "eval_loss" in ra[1]
    _, pa = checkpoint.load_params(checkpoint.latest(str(a)))
    _, pb = checkpoint.load_params(checkpoint.latest(str(b)))
    assert all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(pa),
                                                 torch.utils._pytree.tree_leaves(pb)))
    assert (b / CONFIG_FILE).read_text() == (a / CONFIG_FILE).read_text().replace(str(a), str(b))
    # the default differs from this run in each of those fields: a config.yaml without them would not repeat it
    assert main(["--train.steps", "3", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
                 "--eval.every", "0", "--checkpoint.dir", str(tmp_path / "c")]) == 0
    assert read_metrics(tmp_path / "c")[0]["loss"] != ra[0]["loss"]


@pytest.mark.parametrize("text, message", [
    ("train: {steps: 2, stpes: 3}\n", "unknown key 'train.stpes'; did you mean 'train.steps'? the valid keys of "
                                      "train are steps, objective, grad_accum, query_parts, dtype,"),
    ("steps: 2\n", "unknown key 'steps'; did you mean 'train.steps'? the valid keys of the file are model, data, "
                   "optim, train, parallel, checkpoint, eval, lora, metrics, plan, dpo, rl"),
    ("train: {steps: many}\n", "train.steps must be an integer, found 'many' (str)"),
    ("train: {steps: 2.5}\n", "train.steps must be an integer, found 2.5 (float)"),
    ("optim: {lr: fast}\n", "optim.lr must be a number, found 'fast' (str)"),
    ("train: {activation_checkpointing: 1}\n", "train.activation_checkpointing must be true or false, found 1 (int)"),
    ("data: {type: 3}\n", "data.type must be a string or null, found 3 (int)"),
    ("model: {preset: null}\n", "model.preset must be a string, found null"),
    ("data: 3\n", "data must be a mapping of type, path, split,"),
    ("- train\n", "the file must be a mapping of model, data, optim, train, parallel, checkpoint, eval, lora, "
                  "metrics, plan, dpo, rl, found ['train'] (list)"),
    ("train: {steps: [\n", "not valid YAML (while parsing a flow"),
])
def test_a_recipe_that_does_not_fit_the_config_is_an_error_line(tmp_path, capsys, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["--config", str(bad), "--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {bad}: {message}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_missing_recipe_is_an_error_line(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 1
    assert capsys.readouterr().err == (f"error: --config {tmp_path / 'nope.yaml'}: cannot read it (No such file or "
                                       f"directory); pass a recipe file such as recipes/tiny.yaml\n")


def test_a_recipe_key_given_twice_is_an_error_naming_both_lines(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 5\n  seed: 1\n  steps: 7\n")
    assert main(["--config", str(recipe)]) == 1
    assert "the key 'steps' is given twice, on line 2 and line 4" in capsys.readouterr().err

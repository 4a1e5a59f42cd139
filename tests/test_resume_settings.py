"""glm5f/run/resume.py's settings check: a post-training resume with other --dpo / --rl settings or another data file
is refused in one line naming each flag; --checkpoint.allow_changed lets them through, said and kept in config.yaml."""

import dataclasses
import json
import os
import re
import shutil

import pytest
import torch
import yaml

import glm5f
from configs import Config, parse, validate
from conftest import cli
from glm5f.ckpt import checkpoint
from glm5f.run.metrics import read_metrics
from glm5f.run.resume import FREE, OWN, RULES, resume_rule
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = glm5f.preset("glm5-tiny").vocab_size


def ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def pairs(path, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return write(path, [{"prompt_ids": ids(g, 4 + i), "chosen_ids": ids(g, 3 + i), "rejected_ids": ids(g, 5)}
                        for i in range(4)])


def groups(path, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return write(path, [{"prompt_ids": ids(g, 3 + i), "completions": [{"ids": ids(g, 2 + j), "reward": float(j)}
                                                                      for j in range(3)]} for i in range(4)])


def dpo(data: str, run, *extra: str) -> list[str]:
    return ["--model.preset", "glm5-tiny", "--train.objective", "dpo", "--data.type", "preference", "--data.path", data,
            "--data.batch_size", "2", "--data.seq_len", "24", "--train.dtype", "float64", "--optim.warmup_steps", "0",
            "--eval.every", "0", "--checkpoint.dir", str(run), *extra]


def grpo(data: str, run, *extra: str) -> list[str]:
    return ["--model.preset", "glm5-tiny", "--train.objective", "grpo", "--data.type", "rollouts", "--data.path", data,
            "--data.batch_size", "2", "--data.seq_len", "16", "--optim.warmup_steps", "0", "--eval.every", "0",
            "--checkpoint.dir", str(run), *extra]


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err
    return err[-1]


def config_yaml(run) -> dict:
    with open(os.path.join(run, "config.yaml")) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """A 2-step DPO run (--dpo.beta 0.1) checkpointed at its end, kept as it is: each test resumes a copy."""
    tmp = tmp_path_factory.mktemp("dpo")
    data = pairs(tmp / "pairs.jsonl")
    assert main(dpo(data, tmp / "run", "--train.steps", "2")) == 0
    return tmp, data


def copy_of(dpo_run, tmp_path, name="run"):
    tmp, data = dpo_run
    shutil.copytree(tmp / "run", tmp_path / name)
    return tmp_path / name, data


def test_a_dpo_resume_with_another_beta_is_refused_naming_it(dpo_run, tmp_path, capsys):
    run, data = copy_of(dpo_run, tmp_path)
    before = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(dpo(data, run, "--train.steps", "3", "--checkpoint.resume", "latest", "--dpo.beta", "0.2",
                    "--dpo.sft_weight", "0.5")) == 1
    line = error_line(capsys)
    assert "--dpo.beta 0.1 -> 0.2" in line and "--dpo.sft_weight 0.0 -> 0.5" in line, line
    assert "--checkpoint.allow_changed dpo.beta,dpo.sft_weight" in line, line
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and (run / "config.yaml").read_text() == before


def test_an_allowed_change_is_said_applied_and_kept_in_config_yaml(dpo_run, tmp_path, capsys):
    """The resumed step's margin is beta times the log-ratio difference: with the same weights and batch, the run
    allowed --dpo.beta 0.2 logs twice the margin of the one resumed with 0.1."""
    same, data = copy_of(dpo_run, tmp_path, "same")
    changed, _ = copy_of(dpo_run, tmp_path, "changed")
    assert main(dpo(data, same, "--train.steps", "3", "--checkpoint.resume", "latest")) == 0
    capsys.readouterr()
    flags = dpo(data, changed, "--train.steps", "3", "--checkpoint.resume", "latest", "--dpo.beta", "0.2",
                "--checkpoint.allow_changed", "dpo.beta")
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert re.search(r"resuming at step 2 with changed settings: --dpo\.beta 0\.1 -> 0\.2; steps 1-2 ran with the "
                     r"old values, steps from 3 run with the new", out), out
    a, b = read_metrics(same)[-1], read_metrics(changed)[-1]
    assert a["step"] == b["step"] == 3 and a["logps_chosen"] == b["logps_chosen"]
    assert abs(b["margin"] - 2 * a["margin"]) <= 1e-12 * abs(a["margin"]) and abs(a["margin"]) > 1e-6
    history = [{"from_step": 3, "flag": "--dpo.beta", "old": 0.1, "new": 0.2}]
    cfg = config_yaml(changed)
    assert cfg["dpo"]["beta"] == 0.2 and cfg["changes"] == history and cfg["checkpoint"]["allow_changed"] == ""
    assert "changes" not in config_yaml(same)
    assert checkpoint.read_meta(str(changed / "checkpoints" / "step_00000003"))["changes"] == history
    # the history goes on with the next resume; naming a flag that no longer differs is a warning, not an error
    assert main(flags[:flags.index("--train.steps") + 1] + ["4"] + flags[flags.index("--train.steps") + 2:]) == 0
    assert "names dpo.beta, which the checkpoint's run already had: nothing to allow" in capsys.readouterr().err
    assert config_yaml(changed)["changes"] == history
    assert parse(["--config", str(changed / "config.yaml")]).dpo.beta == 0.2  # config.yaml still reads back


def test_a_grpo_resume_with_other_rl_settings_is_refused_in_one_line(tmp_path, capsys):
    data = groups(tmp_path / "rollouts.jsonl")
    assert main(grpo(data, tmp_path / "run", "--train.steps", "1")) == 0
    capsys.readouterr()
    assert main(grpo(data, tmp_path / "run", "--train.steps", "2", "--checkpoint.resume", "latest",
                     "--rl.epsilon_high", "0.3", "--rl.kl_beta", "0.05", "--rl.scale_rewards", "batch")) == 1
    line = error_line(capsys)
    for flag in ("--rl.scale_rewards group -> batch", "--rl.epsilon_high 0.28 -> 0.3", "--rl.kl_beta 0.0 -> 0.05"):
        assert flag in line, line
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_a_swapped_post_training_data_file_is_refused_unless_allowed(tmp_path, capsys):
    data = groups(tmp_path / "rollouts.jsonl")
    run = grpo(data, tmp_path / "run", "--train.steps", "1")
    assert main(run) == 0
    other = groups(tmp_path / "other.jsonl", seed=1)
    resume = ["--train.steps", "2", "--checkpoint.resume", "latest"]
    capsys.readouterr()
    assert main(grpo(other, tmp_path / "run", *resume)) == 1
    line = error_line(capsys)
    assert f"--data.path {data} -> {other} (other.jsonl is new; rollouts.jsonl is gone)" in line, line
    assert "--checkpoint.allow_changed data.path" in line
    os.replace(other, data)  # the same path, other records
    assert main(grpo(data, tmp_path / "run", *resume)) == 1
    line = error_line(capsys)
    assert line.startswith(f"error: the data at {data} changed since the checkpoint was saved (rollouts.jsonl ")
    assert "--checkpoint.allow_changed data.path" in line
    assert main(grpo(data, tmp_path / "run", *resume, "--checkpoint.allow_changed", "data.path")) == 0
    assert f"resuming at step 1 with changed settings: --data.path {data} -> {data} (rollouts.jsonl " in \
        capsys.readouterr().out
    (change,) = config_yaml(tmp_path / "run")["changes"]
    assert change["flag"] == "--data.path" and change["from_step"] == 2 and "rollouts.jsonl" in change["files"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_a_preference_file_moved_elsewhere_with_the_same_content_is_no_change(dpo_run, tmp_path, capsys):
    run, data = copy_of(dpo_run, tmp_path)
    os.makedirs(tmp_path / "moved")
    moved = shutil.copy(data, str(tmp_path / "moved" / "pairs.jsonl"))
    assert main(dpo(moved, run, "--train.steps", "3", "--checkpoint.resume", "latest")) == 0
    assert "changed settings" not in capsys.readouterr().out


def test_free_settings_change_without_the_flag(dpo_run, tmp_path, capsys):
    """Cadence, output, step count and the batch's split change freely: beside a changed --dpo.beta, the refusal
    names only that; without it the resume goes on, saying nothing of them."""
    run, data = copy_of(dpo_run, tmp_path)
    free = ["--train.steps", "4", "--checkpoint.resume", "latest", "--checkpoint.every", "1", "--checkpoint.keep", "0",
            "--train.log_every", "1", "--metrics.log_completions", "0", "--train.grad_accum", "2",
            "--data.share_prefixes", "True"]
    capsys.readouterr()
    assert main(dpo(data, run, *free, "--dpo.beta", "0.2")) == 1
    line = error_line(capsys)
    assert ": --dpo.beta 0.1 -> 0.2. Resume" in line and "--checkpoint.allow_changed dpo.beta to go on" in line, line
    assert main(dpo(data, run, *free)) == 0
    assert "changed settings" not in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    cfg = config_yaml(run)
    assert "changes" not in cfg and cfg["train"]["steps"] == 4 and cfg["checkpoint"]["every"] == 1
    assert sorted(os.listdir(run / "checkpoints"))[:3] == ["latest", "step_00000002", "step_00000003"]


@pytest.mark.parametrize("names, message", [
    ("dpo.betta", "names dpo.betta, which is not a flag (did you mean dpo.beta?)"),
    ("train.steps", "names train.steps, which may change on resume without it; drop it"),
    ("rl.temperature", "names rl.temperature, which may change on resume without it"),
    ("model.hidden_size", "names model.hidden_size, which no resume may change"),
    ("--train.objective", "names train.objective, which no resume may change"),
])
def test_allow_changed_names_only_flags_it_governs(names, message):
    flags = ["--train.objective", "dpo", "--data.type", "preference", "--data.path", "x.jsonl"]
    errs = [e for e in validate(cli(*flags, "--checkpoint.allow_changed", f"dpo.beta,{names}")) if "allow_changed" in e]
    assert len(errs) == 1 and errs[0].startswith(f"--checkpoint.allow_changed {message}"), errs
    assert not any("allow_changed" in e for e in validate(cli(*flags, "--checkpoint.allow_changed", "dpo.beta")))


def test_the_docs_list_every_section_s_resume_rule():
    """docs/training.md's resume table (README points to it) has a row for each config section, naming each field
    whose rule is not its section's."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        text = f.read()
    start = text.index("| section |", text.index("## Resume rules"))
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    firsts = {name: row for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else getattr(Config(), f.name)):
            row = firsts.get(f.name)
            assert row is not None, (f.name, list(firsts))
            default, fields = RULES.get(f.name, (None, {}))
            assert all(f"`{n}`" in row for n, rule in fields.items() if rule != default), (f.name, row)
    assert resume_rule(cli("--train.objective", "dpo"), "rl", "beta") == FREE
    assert resume_rule(cli("--train.objective", "dpo"), "model", "init_from") == OWN

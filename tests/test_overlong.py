"""--data.skip_overlong: a record longer than --data.seq_len refuses the run without it; with it the record is
counted and skipped (said at the start with its file), the run trains on exactly the others; all skipped: an error."""

import json

import pytest

import glm5f
from conftest import cli
from glm5f.data.rollouts import RolloutSource, read_groups
from glm5f.data.tokens import make_tokenizer
from glm5f.posttrain import sampler
from glm5f.posttrain.grpo import RLConfig
from glm5f.run.metrics import read_metrics
from train import main, train

TOK = make_tokenizer(None)


def groups(n_long: int = 1) -> list[dict]:
    """Four groups of two completions (distinct rewards); the second's (and with n_long 4, every one's) second
    completion does not fit 16 tokens."""
    recs = [{"prompt_ids": [1, 2 + i], "completions": [{"ids": [3, 4 + i], "reward": float(i)},
                                                       {"ids": [5] * (3 + i), "reward": 0.5 * i - 1}]}
            for i in range(4)]
    for i in [1] if n_long == 1 else range(4):
        recs[i]["completions"][1]["ids"] = [6] * 20
    return recs


def write(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_an_overlong_group_is_refused_without_the_flag_and_skipped_with_it(tmp_path):
    path = write(tmp_path / "r.jsonl", groups())
    read = read_groups(path, None)
    with pytest.raises(ValueError, match=rf"{path}:2: completion 1: 20 tokens after a prompt of 2 do not fit "
                                         rf"--data.seq_len 16; raise it, or pass --data.skip_overlong"):
        RolloutSource(read, 1, 16, 64, 0, 0, path)
    src = RolloutSource(read, 1, 16, 64, 0, 0, path, skip_overlong=True)
    assert (src.skipped.count, src.skipped.total, src.skipped.first) == (1, 4, f"{path}:2")
    assert src.skipped.line() == (f"--data.skip_overlong: skipped 1 of 4 groups of {path} that do not fit "
                                  f"--data.seq_len 16 (the first at {path}:2)")
    seen = [src.next_batch()["input_ids"][0, 1].item() for _ in range(6)]  # each group's prompt's second id
    assert sorted(seen[:3]) == [2, 4, 5] and sorted(seen[3:]) == [2, 4, 5]  # an epoch: every other group once
    assert RolloutSource(read, 1, 22, 64, 0, 0, path).skipped is None


def test_every_group_overlong_is_an_error(tmp_path):
    path = write(tmp_path / "r.jsonl", groups(n_long=4))
    with pytest.raises(ValueError, match=rf"{path}: every one of its 4 groups is longer than --data.seq_len 16, so "
                                         rf"--data.skip_overlong leaves nothing to train on"):
        RolloutSource(read_groups(path, None), 1, 16, 64, 0, 0, path, skip_overlong=True)


def test_a_rollouts_run_skips_the_group_and_trains_on_the_others(tmp_path, capsys):
    """The run with the flag says the count and the file, and its steps are those of a run on the file without the
    overlong group (the same losses, rewards and gradient norms)."""
    recs = groups()
    path, others = write(tmp_path / "r.jsonl", recs), write(tmp_path / "o.jsonl", recs[:1] + recs[2:])

    def flags(data, run, *extra):
        return ["--model.preset", "glm5-tiny", "--train.objective", "grpo", "--data.type", "rollouts", "--data.path",
                data, "--data.batch_size", "1", "--data.seq_len", "16", "--train.steps", "3", "--train.dtype",
                "float64", "--eval.every", "0", "--optim.warmup_steps", "0", "--checkpoint.dir", str(tmp_path / run),
                *extra]
    assert main(flags(path, "refused")) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {path}:2: completion 1: 20 tokens after a prompt of 2 do not fit --data.seq_len 16; raise it, or "
        f"pass --data.skip_overlong to skip such groups")
    skipped = train(cli(*flags(path, "skipped", "--data.skip_overlong")))
    assert (f"warning: --data.skip_overlong: skipped 1 of 4 groups of {path} that do not fit --data.seq_len 16 "
            f"(the first at {path}:2)") in capsys.readouterr().err
    want = train(cli(*flags(others, "others")))
    keys = ["loss", "reward", "grad_norm"]
    assert [[r[k] for k in keys] for r in skipped] == [[r[k] for k in keys] for r in want]
    assert len(read_metrics(tmp_path / "skipped")) == 3


def test_a_prompt_without_room_is_skipped_with_the_flag(tmp_path):
    """A prompt leaving no room for --rl.max_new_tokens: refused by default, skipped and counted with the flag; the
    prompts drawn are exactly the others."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["ab", "a much longer prompt", "cd", "ef"]))
    ps = sampler.read_prompts(str(path), TOK, None)
    cfg, s = glm5f.preset("glm5-tiny"), RLConfig(group_size=2, max_new_tokens=4)

    def source(skip):
        return sampler.PromptSource(ps, 3, 12, cfg, 0, TOK.pad_id, s, None, "r", TOK, 0, skip_overlong=skip)
    with pytest.raises(ValueError, match=rf"{path}:2: a prompt of 21 tokens leaves no room for --rl.max_new_tokens 4 "
                                         rf"within --data.seq_len 12; raise --data.seq_len to 25 or shorten the "
                                         rf"prompt, or pass --data.skip_overlong to skip such prompts"):
        source(False)
    src = source(True)
    assert (src.skipped.count, src.skipped.total, src.skipped.first, src.skipped.path) == (1, 4, f"{path}:2",
                                                                                           str(path))
    assert sorted(p.text for p in src.next_prompts()) == ["ab", "cd", "ef"]


@pytest.mark.parametrize("kind", ["chat", "preference", "text"])
def test_the_flag_on_a_data_type_that_refuses_no_long_record_is_refused(kind):
    from configs import validate

    extra = ["--train.objective", "dpo", "--data.path", "p.jsonl"] if kind == "preference" else []
    errs = validate(cli("--data.type", kind, "--data.skip_overlong", *extra))
    assert any(e.startswith(f"--data.skip_overlong skips rollouts groups and prompts that do not fit --data.seq_len; "
                            f"--data.type {kind} refuses no long record") for e in errs), errs

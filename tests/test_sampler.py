"""glm5f/posttrain/sampler.py: the on-policy sampler's log-probabilities equal a full forward's in fp64, greedy sampling is
decode.generate's, stop tokens end (and belong to) a completion, the reward function's arguments and its errors, and
a --data.type prompts run that resumes bitwise."""

import json
import math
import os
import re

import pytest
import torch

import glm5f
from configs import validate
from conftest import cli
from glm5f.posttrain import sampler
from glm5f.posttrain.grpo import RLConfig
from glm5f.data import chat
from glm5f.model import decode
from glm5f.data.rollouts import read_groups
from glm5f.run.metrics import read_metrics
from glm5f.data.tokens import make_tokenizer
from train import main, train

TOK = make_tokenizer(None)
SEEN = []  # the keyword arguments `recording` was called with


def recording(**kwargs) -> float:
    SEEN.append(kwargs)
    return float(len(kwargs["completion_ids"]))


def raising(**kwargs):
    raise KeyError("no answer field")


def nan_reward(**kwargs):
    return math.nan


def text_reward(**kwargs):
    return "1.0"


def prompts(lengths=(3, 7, 5)) -> list[sampler.Prompt]:
    """Text prompts of the given lengths (bos first), stopping at eos."""
    return [sampler.Prompt([TOK.bos_id] + TOK.encode("abcdefghij"[:n - 1]), "", (TOK.eos_id,), {}, f"p:{i}")
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_logprobs_equal_a_full_forward_in_fp64(preset):
    """Every completion token's recorded log-probability (decoded batched, left-padded, at temperature 0.7 and
    top_p 0.9) is token_logprobs' of the unpadded prompt + completion: the raw log_softmax at temperature 1."""
    cfg = glm5f.preset(preset)
    params = glm5f.init_params(cfg, 0, torch.float64)
    s = RLConfig(group_size=2, temperature=0.7, top_p=0.9, max_new_tokens=6)
    groups = sampler.sample_groups(params, cfg, prompts(), s, recording, TOK, TOK.pad_id,
                                   torch.Generator().manual_seed(0))
    checked = 0
    for g in groups:
        for c in g.completions:
            ids = torch.tensor([c.example.ids])
            want = glm5f.token_logprobs(params, cfg, ids)[0, -1 - len(c.logprobs):-1]
            assert len(c.logprobs) == len(ids[0]) - len(g.prompt["prompt_ids"]) >= 1
            assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-10)
            checked += len(c.logprobs)
    assert checked > 12


def test_greedy_sampling_is_generate_and_stop_tokens_end_a_completion():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    ps = prompts()
    want = [decode.generate(params, cfg, torch.tensor([p.ids]), 8, eos_token_id=None)[0, len(p.ids):].tolist()
            for p in ps]
    s = RLConfig(group_size=2, temperature=0.0, max_new_tokens=8)
    groups = sampler.sample_groups(params, cfg, ps, s, recording, TOK, TOK.pad_id)
    for g, w in zip(groups, want):  # up to and with the first eos
        w = w[:w.index(TOK.eos_id) + 1] if TOK.eos_id in w else w
        assert [c.example.ids[len(g.prompt["prompt_ids"]):] for c in g.completions] == [w, w]
    before = groups
    # the first prompt stops at its third greedy token: it ends the completion, which holds it and scores it
    stop = want[0][2]
    first = want[0].index(stop) + 1
    ps[0] = sampler.Prompt(ps[0].ids, "", (stop,), {}, "p:0")
    SEEN.clear()
    groups = sampler.sample_groups(params, cfg, ps, s, recording, TOK, TOK.pad_id)
    c = groups[0].completions[0]
    assert c.example.ids[len(ps[0].ids):] == want[0][:first] and len(c.logprobs) == first
    assert c.example.labels[-first:] == want[0][:first]  # every completion token is scored, the stop one too
    assert SEEN[0]["completion_ids"] == want[0][:first]
    assert SEEN[0]["completion"] == TOK.decode(want[0][:first - 1])  # the text less its stop token
    assert groups[1:] == before[1:]  # the other prompts stop at eos as before


def test_the_reward_function_gets_the_record_and_the_completion(tmp_path):
    fmt = chat.ChatFormat.load(None)
    path = tmp_path / "p.jsonl"
    recs = [{"prompt": "hi", "answer": 3}, {"prompt_ids": [256, 104, 105], "tags": ["x"]},
            {"messages": [{"role": "user", "content": "hi"}], "level": "easy"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ps = sampler.read_prompts(str(path), TOK, fmt)
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float32)
    SEEN.clear()
    groups = sampler.sample_groups(params, cfg, ps, RLConfig(group_size=2, max_new_tokens=4), recording, TOK,
                                   TOK.pad_id, torch.Generator().manual_seed(0))
    assert len(SEEN) == 6
    texts = ["hi", TOK.decode([256, 104, 105]), fmt.render(recs[2]["messages"], add_generation_prompt=True)[0]]
    extra = [{"answer": 3}, {"tags": ["x"]}, {"level": "easy", "messages": recs[2]["messages"]}]  # a chat's messages
    for k, (seen, g) in enumerate(zip(SEEN, [g for g in groups for _ in range(2)])):
        c = g.completions[k % 2]
        ids = c.example.ids[len(ps[k // 2].ids):]
        stops = ps[k // 2].stops
        assert seen == {"prompt": texts[k // 2], "prompt_ids": ps[k // 2].ids, "completion_ids": ids,
                        "completion": TOK.decode(ids[:-1] if ids[-1] in stops else ids), **extra[k // 2]}
        assert c.reward == len(ids)
    assert ps[0].ids == [TOK.bos_id, *TOK.encode("hi")] and ps[2].stops == tuple(fmt.stop_ids)


def write_prompts(tmp_path, n=6) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"word {i}:", "n": i}) + "\n" for i in range(n)))
    return str(path)


def run_flags(tmp_path, run, reward="glm5f.posttrain.rewards:lowercase_share", *extra):
    return ["--train.objective", "grpo", "--data.type", "prompts", "--data.path", write_prompts(tmp_path),
            "--rl.reward", reward, "--data.batch_size", "2", "--rl.group_size", "4", "--rl.max_new_tokens", "6",
            "--data.seq_len", "24", "--eval.every", "0", "--optim.lr", "1e-2", "--optim.warmup_steps", "0",
            "--checkpoint.dir", str(tmp_path / run), *extra]


@pytest.mark.parametrize("reward, message", [
    ("no_such_module:f", "--rl.reward no_such_module:f: cannot import it (ModuleNotFoundError"),
    ("glm5f.posttrain.rewards:missing", "--rl.reward glm5f.posttrain.rewards:missing: cannot import it (AttributeError"),
    ("test_sampler:raising", "prompts.jsonl:{line}: --rl.reward test_sampler:raising raised KeyError: "
                             "'no answer field'"),
    ("test_sampler:nan_reward", "prompts.jsonl:{line}: --rl.reward test_sampler:nan_reward returned nan; it must "
                                "return a finite number"),
    ("test_sampler:text_reward", "prompts.jsonl:{line}: --rl.reward test_sampler:text_reward returned '1.0'; it "
                                 "must return a finite number"),
])
def test_bad_reward_functions_stop_the_run_in_one_line(tmp_path, capsys, reward, message):
    assert main(run_flags(tmp_path, "run", reward, "--train.steps", "1")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1]
    assert line.startswith("error: ") and "Traceback" not in "".join(err)
    assert re.search(re.escape(message).replace(re.escape("{line}"), r"[1-6]"), line), line
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_a_prompt_without_room_for_its_completion_is_refused(tmp_path, capsys):
    assert main(run_flags(tmp_path, "run", "glm5f.posttrain.rewards:lowercase_share", "--train.steps", "1",
                          "--rl.max_new_tokens", "20")) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'prompts.jsonl'}:1: a prompt of 8 tokens leaves no room for --rl.max_new_tokens 20 "
        f"within --data.seq_len 24; raise --data.seq_len to 28 or shorten the prompt, or pass --data.skip_overlong to "
        f"skip such prompts")


@pytest.mark.parametrize("flags, message", [
    (["--data.path", "p.jsonl"], "--data.type prompts needs --rl.reward"),
    (["--data.path", "p.jsonl", "--rl.reward", "m:f", "--rl.group_size", "1"], "--rl.group_size must be >= 2"),
    (["--data.path", "p.jsonl", "--rl.reward", "m:f", "--parallel.cp", "2"], "does not run under --parallel.cp"),
])
def test_flags_that_cannot_work_are_refused(flags, message):
    assert any(message in e for e in validate(cli("--train.objective", "grpo", "--data.type", "prompts", *flags)))


def test_a_prompts_run_resumes_bitwise(tmp_path):
    """4 steps straight equal 2 steps then a resumed 2 (in another process's RNG state): the same samples,
    rewards, losses and final weights, the sampler's generator restored from the checkpoint."""
    def flags(run, steps):
        return run_flags(tmp_path, run, "glm5f.posttrain.rewards:lowercase_share", "--train.steps", str(steps),
                         "--checkpoint.every", "1", "--optim.schedule_steps", "4")
    straight = train(cli(*flags("straight", 4)))
    train(cli(*flags("resumed", 2)))
    torch.manual_seed(123)
    train(cli(*flags("resumed", 4), "--checkpoint.resume", "latest"))
    resumed = read_metrics(tmp_path / "resumed")
    keys = ["loss", "reward", "reward_std", "completion_length", "grad_norm"]
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]
    assert all(r["sample_time_s"] > 0 for r in straight)
    a = glm5f.ckpt.checkpoint.load_params(str(tmp_path / "straight" / "checkpoints" / "step_00000004"))[1]
    b = glm5f.ckpt.checkpoint.load_params(str(tmp_path / "resumed" / "checkpoints" / "step_00000004"))[1]
    fa, fb = glm5f.core.params.flatten(a), glm5f.core.params.flatten(b)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_scripts_rollouts_writes_what_data_type_rollouts_reads(tmp_path):
    from scripts import rollouts
    out, model = tmp_path / "r.jsonl", tmp_path / "hf"
    cfg = glm5f.preset("glm5-tiny")
    glm5f.save_hf(model, cfg, glm5f.init_params(cfg, 0, torch.float32))
    assert rollouts.main([str(model), "--prompts", write_prompts(tmp_path), "--reward", "test_sampler:recording", "--out",
                          str(out), "--group-size", "3", "--max-new-tokens", "5", "--seed", "0"]) == 0
    groups = read_groups(str(out), TOK)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 6 and all(len(g.completions) == 3 for g in groups)
    for rec, g in zip(recs, groups):
        assert rec["n"] == int(rec["prompt"].split()[1][:-1])  # the record's fields kept
        for c, got in zip(rec["completions"], g.completions):
            assert c["reward"] == len(c["ids"]) == len(c["logprobs"]) and got.logprobs == c["logprobs"]


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_recorded_choices_replayed_by_the_trainer_give_its_log_probabilities(preset):
    """The sampler's records (routing and indexer, prompts longer than the indexer's top-k) replayed in a forward
    over prompt + completion give the sampler's log-probabilities (fp64, 1e-10), and the records are the
    forward's own choices: replaying them changes nothing."""
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset(preset)
    params = glm5f.init_params(cfg, 0, torch.float64)
    s = RLConfig(group_size=2, temperature=1.0, max_new_tokens=6, replay="routing,indexer")
    long = [sampler.Prompt([TOK.bos_id] + TOK.encode("the quick brown fox jumps over"[:n]), "", (TOK.eos_id,), {},
                           f"p:{n}") for n in (20, 26)]
    groups = sampler.sample_groups(params, cfg, long, s, recording, TOK, TOK.pad_id, torch.Generator().manual_seed(1))
    shapes = replay_shapes(cfg)
    for g in groups:
        for c in g.completions:
            ids = torch.tensor([c.example.ids])
            n = ids.shape[1]
            rec = {f: torch.cat([c.replay[f], c.replay[f].new_full((1, *shapes[f]), -1)])[None] for f in shapes}
            assert rec["routing"].shape == (1, n, *shapes["routing"]) and (rec["routing"][0, :-1] >= 0).all()
            assert (rec["indexer"][0, :-1] >= 0).any()  # the indexer selected at the longer positions
            replayed = glm5f.token_logprobs(params, cfg, ids, **rec)[0, -1 - len(c.logprobs):-1]
            own = glm5f.token_logprobs(params, cfg, ids)[0, -1 - len(c.logprobs):-1]
            assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), replayed, rtol=0, atol=1e-10)
            assert torch.equal(replayed, own)


def test_an_on_policy_run_with_replay_has_no_rollout_gap_in_fp64(tmp_path):
    """--data.type prompts with --rl.replay routing,indexer in fp64: the trainer's first-pass log-probabilities
    equal the sampler's (rollout_logprob_gap_max below 1e-9) at every step."""
    records = train(cli(*run_flags(tmp_path, "run", "glm5f.posttrain.rewards:lowercase_share", "--model.preset", "glm5-tiny",
                                   "--train.dtype", "float64", "--rl.replay", "routing,indexer", "--train.steps", "3",
                                   "--data.seq_len", "40", "--rl.max_new_tokens", "12")))
    assert len(records) == 3
    assert all(r["rollout_logprob_gap_max"] < 1e-9 for r in records), [r["rollout_logprob_gap_max"] for r in records]


def test_scripts_rollouts_stopped_by_ctrl_c_says_one_line_and_writes_nothing(tmp_path):
    """SIGINT (at its default in the child, as in a terminal) while it samples: exit 130, one line after the
    progress lines, no traceback, no --out file nor its .tmp."""
    import signal
    import subprocess
    import sys

    cfg = glm5f.preset("glm5-tiny")
    glm5f.save_hf(tmp_path / "hf", cfg, glm5f.init_params(cfg, 0, torch.float32))
    out = tmp_path / "r.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "scripts", "rollouts.py"), str(tmp_path / "hf"),
                             "--prompts", write_prompts(tmp_path, n=400), "--out", str(out), "--group-size", "2",
                             "--max-new-tokens", "8", "--batch-prompts", "1", "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                               signal.SIG_DFL))
    lines = [proc.stderr.readline()]
    while lines[-1] and not lines[-1].startswith("1/400 prompts"):
        lines.append(proc.stderr.readline())
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read().splitlines()
    assert proc.wait(timeout=60) == 130, lines + rest
    rest = [line for line in rest if not re.fullmatch(r"\d+/400 prompts", line)]
    assert len(rest) == 1 and rest[0].startswith("stopped on Ctrl-C (SIGINT) after ") and \
        rest[0].endswith(f"{out} was not written (it is written whole or not at all); run the command again"), rest
    assert sorted(os.listdir(tmp_path)) == ["hf", "prompts.jsonl"]

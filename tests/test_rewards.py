"""glm5f/posttrain/rewards.py: reward functions in glm5f's, TRL's and verl's forms give what a direct call gives,
ambiguous ones are refused in one line, weights sum, workers give what one worker gives, a run logs each function."""

import json
import time

import pytest

from configs import validate
from conftest import cli
from glm5f.data.chat import ChatFormat
from glm5f.data.tokens import make_tokenizer
from glm5f.posttrain import sampler
from glm5f.posttrain.rewards import RewardFn, Rewards, form_of
from train import main, train

TOK = make_tokenizer(None)
FMT = ChatFormat.load(None)
RECORDS = [
    {"prompt": "2+2=", "answer": "4", "data_source": "arith", "reward_model": {"ground_truth": "4", "style": "rule"},
     "extra_info": {"split": "train"}},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4?"}], "answer": "7",
     "ground_truth": "7"},
    {"prompt_ids": [TOK.bos_id, 104, 105], "answer": "x", "reward_model": {"ground_truth": "hi"}},
]
TEXTS = [["4", "five", "44"], ["7", "seven", ""], ["hi", "h", "hello"]]


def glm5f_form(*, prompt, completion, prompt_ids, completion_ids, answer, **fields) -> float:
    return (completion == answer) + 0.01 * len(prompt) + 0.1 * len(completion_ids) + 0.001 * sum(prompt_ids) + \
        0.5 * len(fields.get("messages", []))


def trl_form(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    out = []
    for p, c, ids, a in zip(prompts, completions, completion_ids, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(float(text == a) + 0.2 * len(ids) + (0.3 * len(p) if isinstance(p, list) else 0.01 * len(p)))
    return out


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = float(solution_str == ground_truth) + 0.25 * (data_source == "arith") + 0.125 * bool(extra_info)
    return {"score": score, "acc": score > 0} if data_source else score


def kwargs_only(**kwargs) -> float:
    return float(len(kwargs["completion"]))


def ambiguous(completion, completions, **kwargs):
    return 0.0


def takes_nothing(x, y):
    return 0.0


def groups(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    ps = sampler.read_prompts(str(path), TOK, FMT)
    return [(p, texts, [TOK.encode(t) + [TOK.eos_id] for t in texts]) for p, texts in zip(ps, TEXTS)]


def fn(f, weight=1.0, name=None):
    return RewardFn(f, form_of(f, "--rl.reward x"), weight, name or f.__name__, f"--rl.reward m:{f.__name__}")


def test_the_form_is_told_by_the_parameter_names_and_an_ambiguous_one_is_refused():
    assert [form_of(f, "x") for f in (glm5f_form, trl_form, compute_score, kwargs_only)] == [
        "glm5f", "trl", "verl", "glm5f"]
    with pytest.raises(ValueError, match=r"^--rl.reward m:ambiguous: its parameters name completion and completions, "
                                         r"the arguments of glm5f and trl reward functions; name one of"):
        form_of(ambiguous, "--rl.reward m:ambiguous")
    with pytest.raises(ValueError, match=r"^--rl.reward m:t: it takes none of a reward function's arguments "
                                         r"\(parameters \['x', 'y'\]\)"):
        form_of(takes_nothing, "--rl.reward m:t")


def test_each_form_gives_what_a_direct_call_gives(tmp_path):
    gs = groups(tmp_path)
    p_text, p_chat, p_ids = (p for p, _, _ in gs)
    assert p_chat.messages == RECORDS[1]["messages"] and p_text.messages is None and p_ids.messages is None
    # glm5f: per completion, keywords; a chat record's messages too
    _, parts = Rewards([fn(glm5f_form)]).score(gs)
    want = [[glm5f_form(prompt=p.text, completion=t, prompt_ids=p.ids, completion_ids=ids, **p.fields,
                        **({"messages": RECORDS[1]["messages"]} if p is p_chat else {}))
             for t, ids in zip(texts, idss)] for p, texts, idss in gs]
    assert parts["glm5f_form"] == want and want[1][0] > want[0][0] + 1  # the chat record's messages reached it
    # TRL: per group, lists; a chat record's prompts are its messages, its completions assistant messages
    _, parts = Rewards([fn(trl_form)]).score(gs)
    want = [trl_form(prompts=[RECORDS[1]["messages"] if p is p_chat else p.text] * 3,
                     completions=[[{"role": "assistant", "content": t}] if p is p_chat else t for t in texts],
                     completion_ids=idss, **{k: [v] * 3 for k, v in p.fields.items()}) for p, texts, idss in gs]
    assert parts["trl_form"] == want
    # verl: compute_score(data_source, solution_str, ground_truth, extra_info); a dict's "score"
    _, parts = Rewards([fn(compute_score)]).score(gs)
    truths = ["4", "7", "hi"]
    want = [[float(t == truth) + 0.25 * (i == 0) + 0.125 * (i == 0) for t in texts]
            for i, ((_, texts, _), truth) in enumerate(zip(gs, truths))]
    assert parts["compute_score"] == want and want[0][0] == 1.375 and want[2][0] == 1.0


def test_weights_sum_and_workers_give_what_one_worker_gives(tmp_path):
    gs = groups(tmp_path)
    fns = [fn(glm5f_form, 1.0), fn(trl_form, 0.5), fn(compute_score, -2.0)]
    totals, parts = Rewards(fns).score(gs)
    for g, (_, texts, _) in enumerate(gs):
        for j in range(3):
            assert totals[g][j] == pytest.approx(parts["glm5f_form"][g][j] + 0.5 * parts["trl_form"][g][j]
                                                 - 2.0 * parts["compute_score"][g][j], rel=1e-15)

    def slow(*, completion, **kwargs):  # the later calls finish first
        time.sleep(0.002 * (len(completion) % 3))
        return glm5f_form(completion=completion, **kwargs)
    fns4 = [fn(glm5f_form, 1.0), fn(trl_form, 0.5), fn(compute_score, -2.0), fn(slow, 1.0)]
    assert Rewards(fns4, workers=4).score(gs) == Rewards(fns4, workers=1).score(gs)


def test_a_failing_call_names_its_record_whatever_the_workers(tmp_path):
    gs = groups(tmp_path)

    def fails_on_chat(*, completion, messages=None, **kwargs):
        if messages is not None and completion == "seven":
            raise KeyError("no grader")
        return 1.0
    for workers in (1, 3):
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'p.jsonl'}:2: --rl.reward m:fails_on_chat raised "
                                             rf"KeyError: 'no grader'$"):
            Rewards([fn(fails_on_chat)], workers).score(gs)

    def wrong_length(completions, **kwargs):
        return [1.0]
    with pytest.raises(ValueError, match=r"p.jsonl:1: --rl.reward m:wrong_length returned 1 rewards for the "
                                         r"group's 3 completions"):
        Rewards([fn(wrong_length)]).score(gs)

    def no_truth(data_source, solution_str, ground_truth):
        return 0.0
    bare = sampler.Prompt([1], "x", (2,), {}, "q.jsonl:5")
    with pytest.raises(ValueError, match=r"q.jsonl:5: --rl.reward m:no_truth \(verl's compute_score\) reads "
                                         r"ground_truth, and the record has neither"):
        Rewards([fn(no_truth)]).score([(bare, ["a"], [[3]])])


def reward_a(*, completion_ids, **fields) -> float:
    return float(len(completion_ids))


def reward_b(completions, **kwargs) -> list[float]:
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def test_a_run_with_two_weighted_functions_logs_each_and_trains_on_their_sum(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"word {i}:"}) + "\n" for i in range(4)))
    flags = ["--train.objective", "grpo", "--data.type", "prompts", "--data.path", str(path), "--data.batch_size", "2",
             "--rl.group_size", "3", "--rl.max_new_tokens", "6", "--data.seq_len", "24", "--eval.every", "0",
             "--train.steps", "2", "--rl.reward", "test_rewards:reward_a,test_rewards:reward_b",
             "--rl.reward_weights", "1,0.5", "--checkpoint.dir"]
    one = train(cli(*flags, str(tmp_path / "one")))
    four = train(cli(*flags, str(tmp_path / "four"), "--rl.reward_workers", "4"))
    for r in one:
        assert r["reward"] == pytest.approx(r["rewards/reward_a/mean"] + 0.5 * r["rewards/reward_b/mean"], rel=1e-12)
        assert r["rewards/reward_a/mean"] > 0
    keys = ["reward", "rewards/reward_a/mean", "rewards/reward_b/mean", "loss", "grad_norm"]
    assert [[r[k] for k in keys] for r in four] == [[r[k] for k in keys] for r in one]
    assert main([*flags[:-3], "--rl.reward_weights", "1", "--checkpoint.dir", str(tmp_path / "bad")]) == 1
    assert "--rl.reward_weights takes one finite number per --rl.reward function (comma-separated: 2 for" in \
        capsys.readouterr().err
    assert main([*flags[:-5], "--rl.reward", "test_rewards:ambiguous", "--checkpoint.dir", str(tmp_path / "amb")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --rl.reward test_rewards:ambiguous: its parameters name completion and "
                              "completions") and "Traceback" not in "".join(err)


@pytest.mark.parametrize("extra, message", [
    (["--rl.reward", "a:f,b:g", "--rl.reward_weights", "1,x"], "--rl.reward_weights takes one finite number"),
    (["--rl.reward", "a:f", "--rl.reward_workers", "0"], "--rl.reward_workers must be >= 1"),
    (["--rl.reward", "a:f,b:g", "--rl.tools", "m:t"], "agent episodes (--rl.tools, --rl.environment) take one"),
])
def test_reward_flags_that_cannot_work_are_refused(extra, message):
    errs = validate(cli("--train.objective", "grpo", "--data.type", "prompts", "--data.path", "p.jsonl", *extra))
    assert any(message in e for e in errs), errs

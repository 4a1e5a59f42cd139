"""Trajectories in rollouts files (glm5f/data/rollouts.py, glm5f/data/engines.py): GRPO's step-1 loss from token-form
trajectories with several trained spans, written in glm5f's fields and in each engine's (--data.format), equals the
formula over Transformers' fp64 log-probabilities of only the trained tokens (with routing replay too); chat
trajectories train what SFT trains; bad records are one line naming file:line, and nothing is trained on them."""

import json
import math
import os

import pytest
import torch

import glm5f
from conftest import cli, saved_policy, stable_topk, transformers_in_fp64
from glm5f.data.chat import ChatFormat, chat_messages
from glm5f.data.rollouts import ReadOptions, RolloutSource, read_groups, rollout_batch
from glm5f.data.tokens import IGNORE_INDEX
from glm5f.posttrain.rl_losses import STD_EPS
from train import train

CAP = 2.0
SPANS = (2, 2, 2, 1, 1)  # completion spans: generated, tool output, generated, tool output, generated


def trajectories(vocab: int, groups: int = 2, size: int = 3, seed: int = 0) -> list[list[dict]]:
    """Groups of samples {"prompt", "ids", "mask", "reward"}: each completion alternates generated spans (mask 1)
    and tool-output spans (mask 0), so several spans are trained; rewards differ within a group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = torch.randint(0, vocab, (3 + i,), generator=g).tolist()
        samples = []
        for j in range(size):
            spans = [n + (j + k) % 2 for k, n in enumerate(SPANS)]
            ids = torch.randint(0, vocab, (sum(spans),), generator=g).tolist()
            mask = [1 - k % 2 for k, n in enumerate(spans) for _ in range(n)]
            samples.append({"prompt": prompt, "ids": ids, "mask": mask, "reward": float(j * (i + 1) % 3 + j / 7)})
        out.append(samples)
    return out


def token_logp(model, ids: list[int], routing=None, slots=None) -> torch.Tensor:
    """log p of each token [len(ids) - 1] given what precedes it, from the Transformers model in fp64 (its router
    made to pick `routing` [len(ids) - 1, M, K] when given)."""
    if routing is not None:
        rows = torch.tensor(routing + [[[-1] * len(routing[0][0])] * len(routing[0])])
        for layer, m in slots.items():
            model.model.layers[layer].mlp.gate.replay = rows[:, m]
    try:
        with torch.no_grad(), transformers_in_fp64(), stable_topk():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for layer in slots or {}:
            model.model.layers[layer].mlp.gate.replay = None
    return torch.log_softmax(logits[:-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def formula(groups, logp) -> float:
    """The --rl.loss dapo step-1 loss (rho = 1, old = logp): -sum over trained tokens of A_i w_t over their count,
    w_t = min(exp(logp_t - rollout_t), CAP); `logp(sample)`: [len(completion)] log-probabilities."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for samples in groups:
        r = torch.tensor([s["reward"] for s in samples], dtype=torch.float64)
        adv = (r - r.mean()) / (r.std() + STD_EPS)
        for s, a in zip(samples, adv):
            lp = logp(s)
            for t, m in enumerate(s["mask"]):
                if m:
                    w = min(math.exp(float(lp[t]) - s["logprobs"][t]), CAP)
                    total, count = total - a * w, count + 1
    return float(total / count)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A Transformers GLM-5 policy saved to disk and trajectories whose engine log-probabilities (on the trained
    tokens) are the policy's own, moved by up to +-1 (some importance weights reach the cap)."""
    tmp = tmp_path_factory.mktemp("traj")
    cfg = glm5f.preset("glm5-tiny")
    policy = saved_policy(tmp / "policy", cfg)
    groups = trajectories(cfg.vocab_size)
    g = torch.Generator().manual_seed(1)
    for samples in groups:
        for s in samples:
            lp = own_logp(policy, s)
            s["logprobs"] = (lp + torch.empty_like(lp).uniform_(-1, 1, generator=g)).clamp(max=0).tolist()
    return tmp, policy, groups


def own_logp(policy, s, routing=None, slots=None) -> torch.Tensor:
    return token_logp(policy, s["prompt"] + s["ids"], routing, slots)[len(s["prompt"]) - 1:]


def trained_only(s) -> list[float]:
    return [x for x, m in zip(s["logprobs"], s["mask"]) if m]


def over_response(s, fill=0.0) -> list:
    return [x if m else fill for x, m in zip(s["logprobs"], s["mask"])]


# Each engine's sample in its own fields (glm5f/data/engines.py); None: the format writes a group per line.
WRITERS = {
    "glm5f": lambda gi, j, s: None,
    "slime": lambda gi, j, s: {"group_index": gi, "index": j, "tokens": s["prompt"] + s["ids"],
                               "response_length": len(s["ids"]), "loss_mask": s["mask"],
                               "rollout_log_probs": over_response(s), "reward": s["reward"], "status": "completed"},
    "verl": lambda gi, j, s: {"uid": f"u{gi}", "prompt_ids": s["prompt"], "response_ids": s["ids"],
                              "response_mask": s["mask"], "response_logprobs": over_response(s),
                              "reward_score": s["reward"], "num_turns": 4},
    "skyrl": lambda gi, j, s: {"trajectory_ids": {"instance_id": f"i{gi}", "repetition_id": j},
                               "prompt_token_ids": s["prompt"], "response_ids": s["ids"], "loss_masks": s["mask"],
                               "rollout_logprobs": over_response(s), "stop_reasons": "stop",
                               "rewards": [0.0] * (len(s["ids"]) - 1) + [s["reward"]]},
    "prime_rl": lambda gi, j, s: {"example_id": gi, "token_ids": s["prompt"] + s["ids"],
                                  "mask": [False] * len(s["prompt"]) + [bool(m) for m in s["mask"]],
                                  "logprobs": [0.0] * len(s["prompt"]) + over_response(s), "reward": s["reward"],
                                  "temperatures": [1.0] * (len(s["prompt"]) + len(s["ids"]))},
    "nemo_rl": lambda gi, j, s: {"idx": gi, "total_reward": s["reward"], "message_log": [
        {"role": "user", "token_ids": s["prompt"]}, *message_spans(s)]},
    "trl": lambda gi, j, s: {"prompt_ids": s["prompt"], "completion_ids": s["ids"], "tool_mask": s["mask"],
                             "logprobs": over_response(s, None), "reward": s["reward"]},
}


def message_spans(s) -> list[dict]:
    """The completion as NeMo-RL's message log: an assistant message per generated span, a tool one per the rest."""
    out, start = [], 0
    for end in range(1, len(s["ids"]) + 1):
        if end == len(s["ids"]) or s["mask"][end] != s["mask"][start]:
            role = "assistant" if s["mask"][start] else "tool"
            m = {"role": role, "token_ids": s["ids"][start:end]}
            if role == "assistant":
                m["generation_logprobs"] = s["logprobs"][start:end]
            out.append(m)
            start = end
    return out


def write_format(path, name: str, groups, extra=lambda gi, j, s: {}) -> str:
    if name == "glm5f":
        lines = [{"prompt_ids": samples[0]["prompt"], "completions": [
            {"ids": s["ids"], "loss_mask": s["mask"], "logprobs": trained_only(s), "reward": s["reward"],
             **extra(gi, j, s)} for j, s in enumerate(samples)]} for gi, samples in enumerate(groups)]
    elif name == "trl":  # a group per line
        lines = [[{**WRITERS[name](gi, j, s), **extra(gi, j, s)} for j, s in enumerate(samples)]
                 for gi, samples in enumerate(groups)]
    else:  # a sample per line, the groups interleaved
        lines = [{**WRITERS[name](gi, j, s), **extra(gi, j, s)} for j in range(len(groups[0]))
                 for gi, s in enumerate(samples[j] for samples in groups)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def grpo_flags(tmp, data: str, run: str, *extra: str) -> list[str]:
    return ["--model.init_from", str(tmp / "policy"), "--train.objective", "grpo", "--data.type", "rollouts",
            "--data.path", data, "--data.batch_size", "2", "--data.seq_len", "24", "--train.dtype", "float64",
            "--eval.every", "0", "--optim.warmup_steps", "0", "--train.steps", "1", "--checkpoint.dir",
            str(tmp / run), *extra]


@pytest.mark.parametrize("name", list(WRITERS))
def test_step_one_loss_from_each_format_equals_the_formula_over_trained_tokens(setup, name):
    tmp, policy, groups = setup
    data = write_format(tmp / f"{name}.jsonl", name, groups)
    key = ["--data.group_key", "example_id"] if name == "prime_rl" else []  # prime-rl's samples name no group
    records = train(cli(*grpo_flags(tmp, data, f"run_{name}", "--data.format", name, *key)))
    expected = formula(groups, lambda s: own_logp(policy, s))
    assert abs(records[0]["loss"] - expected) <= 1e-8, (records[0]["loss"], expected)
    assert abs(expected) > 1e-3 and 0 < records[0]["tis_capped_fraction"] < 1
    trained = sum(sum(s["mask"]) for samples in groups for s in samples)
    every = sum(len(s["ids"]) for samples in groups for s in samples)
    assert records[0]["completion_length"] * len(groups) * len(groups[0]) == trained < every


@pytest.mark.parametrize("name,mask,logprobs", [("slime", "loss_mask", "rollout_log_probs"),
                                                ("verl", "response_mask", "response_logprobs"),
                                                ("skyrl", "loss_masks", "rollout_logprobs"),
                                                ("trl", "tool_mask", "logprobs")])
def test_whole_sequence_spans_and_routing_rows_read_as_response_ones(tmp_path, name, mask, logprobs):
    """A mask and log-probabilities given over the whole sequence (prompt entries first), and routing with a row per
    position (T) instead of T - 1, give the same batch as the response-only spans."""
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset("glm5-tiny")
    M, K = replay_shapes(cfg)["routing"]
    groups = trajectories(cfg.vocab_size, size=2)
    for samples in groups:
        for s in samples:
            s["logprobs"] = [-0.1 * (t + 1) for t in range(len(s["ids"]))]
            s["routing"] = [[[(t + m + k) % cfg.n_routed_experts for k in range(K)] for m in range(M)]
                            for t in range(len(s["prompt"]) + len(s["ids"]))]
    field = {"slime": "rollout_routed_experts", "verl": "routed_experts", "skyrl": "rollout_expert_indices"}.get(name)
    batches = []
    for whole in (False, True):
        def extra(gi, j, s):
            out = {field: s["routing"] if whole else s["routing"][:-1]} if field else {}
            if whole:
                out[mask] = [0] * len(s["prompt"]) + s["mask"]
                out[logprobs] = [0.0] * len(s["prompt"]) + over_response(s)
            return out
        path = write_format(tmp_path / f"{name}_{whole}.jsonl", name, groups, extra)
        batches.append(rollout_batch(read_groups(path, None, None, cfg, ReadOptions(name)), 24, 0))
    assert batches[0].keys() == batches[1].keys() and ("routing" in batches[0]) == bool(field)
    for k in batches[0]:
        assert torch.equal(batches[0][k].nan_to_num(7.0), batches[1][k].nan_to_num(7.0)), k
    labels = batches[0]["labels"][0].tolist()
    assert sum(t != IGNORE_INDEX for t in labels) == sum(groups[0][0]["mask"])


def test_routing_replay_on_trajectories_equals_transformers_with_the_recorded_experts(setup, hf_router_replay):
    """verl's whole-sequence routing rows (T, the last dropped) and --rl.replay routing: the loss is the formula
    over Transformers' fp64 log-probabilities with its router made to pick the recorded experts."""
    from glm5f.core.replay import replay_shapes, replay_slots

    tmp, policy, groups = setup
    cfg = glm5f.preset("glm5-tiny")
    M, K = replay_shapes(cfg)["routing"]
    slots = replay_slots(cfg)["routing"]
    g = torch.Generator().manual_seed(5)
    groups = json.loads(json.dumps(groups))
    for samples in groups:
        for s in samples:
            n = len(s["prompt"]) + len(s["ids"])
            s["routing"] = [[torch.randperm(cfg.n_routed_experts, generator=g)[:K].tolist() for _ in range(M)]
                            for _ in range(n)]
    data = write_format(tmp / "verl_routed.jsonl", "verl", groups, lambda gi, j, s: {"routed_experts": s["routing"]})
    records = train(cli(*grpo_flags(tmp, data, "run_replay", "--data.format", "verl", "--rl.replay", "routing")))
    expected = formula(groups, lambda s: own_logp(policy, s, s["routing"][:-1], slots))
    assert abs(records[0]["loss"] - expected) <= 1e-8, (records[0]["loss"], expected)
    assert abs(expected - formula(groups, lambda s: own_logp(policy, s))) > 1e-6  # the routing matters


def test_chat_trajectories_train_what_sft_trains_and_never_the_tool_output(tmp_path):
    fmt = ChatFormat.load(None)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    prompt = [{"role": "user", "content": "add 2 and 3"}]
    turns = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add",
                                                                               "arguments": {"a": 2, "b": 3}}}]},
             {"role": "observation", "content": "5"}, {"role": "assistant", "content": "it is 5"}]
    rec = {"messages": prompt, "tools": tools, "completions": [{"messages": turns, "reward": 1},
                                                               {"text": "no", "reward": 0}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    c = read_groups(str(path), fmt.tok, fmt)[0].completions[0]
    messages, _ = chat_messages({"messages": prompt + [{**m, "role": "tool"} if m["role"] == "observation" else m
                                                       for m in turns]})
    sft = fmt.example(messages, tools, "assistant")
    before = fmt.ids(prompt, tools, add_generation_prompt=True)
    assert c.example.ids == sft.ids and c.prompt_len == len(before)
    assert c.example.labels == [IGNORE_INDEX] * len(before) + sft.labels[len(before):]
    ids, labels = c.example.ids, c.example.labels
    open_, close = fmt.tok.token_id("<tool_response>"), fmt.tok.token_id("</tool_response>")
    inside = range(ids.index(open_), ids.index(close) + 1)
    assert all(labels[t] == IGNORE_INDEX for t in inside)
    observation = fmt.tok.token_id("<|observation|>")
    assert labels[ids.index(observation)] == observation  # the marker ending the assistant's turn is trained
    assert sum(t != IGNORE_INDEX for t in labels) > 10


def read_error(tmp_path, records, options=ReadOptions(), seq_len=64, vocab=128) -> str:
    """The one-line error reading `records` (a list of JSON lines) as a rollouts file."""
    fmt = ChatFormat.load(None)
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError) as e:
        RolloutSource(read_groups(str(path), fmt.tok, fmt, glm5f.preset("glm5-tiny"), options), 1, seq_len, vocab,
                      0, 0)
    assert "\n" not in str(e.value)
    return str(e.value).replace(str(path), "FILE")


GOOD = {"ids": [5], "reward": 0}
VERL = {"uid": "a", "prompt_ids": [1, 2], "response_ids": [3, 4], "response_mask": [1, 1], "reward_score": 1.0}


@pytest.mark.parametrize("records,options,message", [
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3, 4], "loss_mask": [1], "reward": 1}]}], None,
     "FILE:1: completion 1: 'loss_mask' has 1 entries for 2 token ids"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3, 4], "loss_mask": [0, 0], "reward": 1}]}], None,
     "FILE:1: completion 1: no token is trained"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3], "loss_mask": [1], "logprobs": [-1, -1], "reward": 1}]}],
     None, "FILE:1: completion 1: 2 logprobs for 1 completion tokens"),
    ([VERL, {**VERL, "response_mask": [1]}], "verl", "FILE:2: 'response_mask' has 1 entries for 2 response tokens"),
    ([VERL, {**VERL, "response_logprobs": [-1.0] * 3}], "verl", "FILE:2: 'response_logprobs' has 3 entries"),
    ([VERL, VERL], "slime", "FILE:1: not a slime sample: it lacks 'tokens', 'response_length'"),
    ([VERL, VERL], None, "FILE:1: a glm5f record needs 'completions'; this one has the fields of a verl sample"),
    ([VERL, {**VERL, "uid": "b"}, {**VERL, "uid": "b"}], "verl", "FILE:1: group key uid=\"a\" has 1 sample(s)"),
    ([VERL, {**VERL, "advantages": [1.0, 1.0]}], "verl", "FILE:2: 'advantages': glm5f does not train"),
    ([{"token_ids": [1, 2], "mask": [0, 1], "reward": 1, "temperatures": [0.7, 0.7]}] * 2, "prime_rl",
     "FILE:1: 'temperatures' holds 0.7: its log-probabilities are at that temperature"),
    ([{"token_ids": [1, 2], "mask": [0, 1], "reward": 1}] * 2, "prime_rl", "FILE:1: a prime_rl sample per line, but no "
     "group key: pass --data.group_key"),
    ([{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "completions": [GOOD, GOOD]}], None,
     "FILE:1: the record gives its prompt twice ('prompt' and 'messages')"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"text": "a", "ids": [3], "reward": 1}]}], None,
     "FILE:1: completion 1 needs one of 'text' (a string), 'ids' (token ids) or 'messages' (turns); found both"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3], "labels": [3], "reward": 1}]}], None,
     "FILE:1: completion 1: field(s) 'labels' glm5f does not read"),
    ([{"prompt_ids": [1], "finish_reason": "stop", "completions": [GOOD, GOOD]}], None,
     "FILE:1: field(s) 'finish_reason' on the record"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3], "finish_reason": "abort", "reward": 1}]}], None,
     "FILE:1: completion 1: 'finish_reason' \"abort\" is none of"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3], "reward": 1}]}], ("routing",),
     "FILE:1: completion 0: no 'routing' record, but --rl.replay routing replays it"),
    ([VERL, VERL], ("indexer",), "FILE:1: no 'indexer' (verl: writes none) record, but --rl.replay indexer"),
    ([{"prompt_ids": [1], "completions": [GOOD, {"ids": [3, 500], "reward": 1}]}], None,
     "FILE:1: completion 1 has token id 500 (position 2) outside [0, vocab_size=128)"),
    ([{"prompt_ids": [1, 700], "completions": [GOOD, GOOD]}], None,
     "FILE:1: the prompt has token id 700 (position 1)"),
    ([{"prompt_ids": list(range(64)), "completions": [GOOD, GOOD]}], None,
     "FILE:1: the prompt has 64 tokens, leaving no room for a completion in --data.seq_len 64"),
])
def test_bad_records_are_one_line_at_file_and_line(tmp_path, records, options, message):
    if isinstance(options, tuple):
        opts = ReadOptions("verl" if records[0] is VERL else "glm5f", replay=options)
    else:
        opts = ReadOptions(options or "glm5f")
    assert message in read_error(tmp_path, records, opts)


ADD = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("turn,message", [
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "mul", "arguments": {}}}]},
     "FILE:1: completion 0: message 1: a tool call names 'mul', which is not among the record's tools (add)"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]},
     "FILE:1: completion 0: message 1: 'tool_calls': a tool call needs a function name"),
    ({"role": "assistant", "content": "<tool_call>add<arg_key>a</arg_key>"},
     "FILE:1: completion 0: turn 0 (assistant) has the tool-call markup '<tool_call>' in its text; give its calls as "
     "'tool_calls'"),
])
def test_bad_tool_calls_in_messages_trajectories_are_one_line(tmp_path, turn, message):
    """A call to a tool the record does not list, a call without a name, tool-call markup written into the text."""
    completion = {"messages": [turn, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}],
                  "reward": 1}
    rec = {"messages": [{"role": "user", "content": "add"}], "tools": ADD,
           "completions": [completion, {"text": "no", "reward": 0}]}
    assert message in read_error(tmp_path, [rec], vocab=512)


def test_a_top_k_record_naming_an_expert_twice_is_refused(tmp_path):
    from glm5f.core.replay import replay_shapes

    M, K = replay_shapes(glm5f.preset("glm5-tiny"))["routing"]
    routing = [[list(range(K))] * M, [[1] * K] + [list(range(K))] * (M - 1)]  # position 1, layer slot 0: twice
    rec = {"prompt_ids": [1, 2], "completions": [GOOD, {"ids": [3], "reward": 1, "routing": routing}]}
    message = read_error(tmp_path, [rec])
    assert message.startswith("FILE:1: completion 1: 'routing' repeats an expert id at position 1, layer slot 0")


def test_a_bad_record_trains_nothing(setup, tmp_path):
    tmp, _, groups = setup
    data = write_format(tmp_path / "bad.jsonl", "verl", groups, lambda gi, j, s: {"response_mask": [1]} if gi else {})
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'response_mask' has 1 entries"):
        train(cli(*grpo_flags(tmp, data, "run_bad", "--data.format", "verl")))
    assert not os.path.exists(os.path.join(tmp, "run_bad", "checkpoints"))


def test_text_logprobs_without_the_appended_eos_and_cut_completions(tmp_path):
    """Log-probabilities for exactly a text completion's tokens: the eos glm5f appends has none (NaN: its
    importance weight is 1). "finish_reason": "length" appends nothing; --rl.mask_truncated leaves it untrained."""
    fmt = ChatFormat.load(None)
    tok = fmt.tok
    rec = {"prompt": "hi", "completions": [{"text": "ab", "reward": 1, "logprobs": [-0.5, -0.25]},
                                           {"text": "cd", "reward": 0, "finish_reason": "length"},
                                           {"text": "ef", "reward": 2, "truncated": True}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    done, cut, flagged = read_groups(str(path), tok, fmt)[0].completions
    p = [tok.bos_id] + tok.encode("hi")
    assert done.example.ids == p + tok.encode("ab") + [tok.eos_id] and cut.example.ids == p + tok.encode("cd")
    assert cut.truncated and flagged.truncated and not done.truncated
    assert cut.example.labels[len(p):] == tok.encode("cd")
    b = rollout_batch([read_groups(str(path), tok, fmt)[0]], 12, 0)
    n = len(p) + 2
    assert b["rollout_logprobs"][0, len(p):n].tolist() == [-0.5, -0.25] and math.isnan(b["rollout_logprobs"][0, n])
    assert b["labels"][0, n] == tok.eos_id  # trained, with weight 1
    masked = read_groups(str(path), tok, fmt, options=ReadOptions(mask_truncated=True))[0].completions
    assert all(t == IGNORE_INDEX for c in masked[1:] for t in c.example.labels)
    assert masked[0].example.labels == done.example.labels
    assert [c.reward for c in masked] == [1.0, 0.0, 2.0]  # the cut ones' rewards still count in the group


def test_rollout_is_refuses_a_text_completion_whose_eos_has_no_logprob(tmp_path):
    """--rl.policy_loss rollout_is reads the engine's log-probability of every trained token: the eos appended to
    a text completion whose logprobs cover only its text has none, and the file is refused at file:line."""
    from glm5f.posttrain import rl_losses

    fmt = ChatFormat.load(None)
    rec = {"prompt": "hi", "completions": [{"text": "ab", "reward": 1, "logprobs": [-0.5, -0.25]},
                                           {"text": "cd", "reward": 0, "logprobs": [-0.5, -0.25, -0.1]}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    src = RolloutSource(read_groups(str(path), fmt.tok, fmt), 1, 16, 512, 0, 0)
    flags = ["--train.objective", "grpo", "--data.type", "rollouts", "--data.path", str(path)]
    rl_losses.check_source(src, cli(*flags).rl)  # the clip loss: weight 1 on that eos
    with pytest.raises(ValueError, match=rf"^{path}:1: completion 0 has no log-probability for some trained token"):
        rl_losses.check_source(src, cli(*flags, "--rl.policy_loss", "rollout_is").rl)


@pytest.mark.parametrize("flags,message", [
    (["--data.type", "json_file", "--data.path", "x.jsonl", "--data.format", "verl"],
     "--data.format and --data.group_key describe a rollouts file, not --data.type json_file"),
    (["--train.objective", "grpo", "--data.type", "rollouts", "--data.path", "x.jsonl", "--data.group_key", "uid"],
     "--data.group_key groups another engine's samples"),
])
def test_format_flags_that_cannot_work_are_refused(flags, message):
    from configs import validate

    assert any(message in e for e in validate(cli(*flags)))


def test_glm53_trajectories_step_one_loss_equals_the_formula(tmp_path):
    """GLM-5.3 (KDA and DSA layers, mHC streams; a Transformers checkpoint): the step-1 loss from token-form
    trajectories equals the formula over the fp64 log-probabilities of each sequence alone from glm5f's full forward
    (1e-10) and from Transformers' Glm5NextForConditionalGeneration (1e-6: its KDA and norms compute in fp32, 8e-7
    in the logits)."""
    from glm5f.ckpt.hf import load_hf
    from glm5f.core.params import map_with_path
    from test_glm53 import hf_glm53, random_config

    cfg = random_config(1, 2, 2)
    with transformers_in_fp64():
        model = hf_glm53(cfg, 1)
    model.save_pretrained(tmp_path / "policy")
    model = model.double()
    for m in model.modules():  # eager experts: the grouped matmul has no fp64
        if hasattr(m, "config"):
            m.config._experts_implementation = "eager"
    _, params = load_hf(tmp_path / "policy")
    params = map_with_path(lambda path, t: t.double(), params)
    groups = trajectories(cfg.vocab_size, groups=1, size=3, seed=3)

    def ours(s):
        ids = torch.tensor([s["prompt"] + s["ids"]])
        return glm5f.token_logprobs(params, cfg, ids)[0, len(s["prompt"]) - 1:-1]

    def theirs(s):
        with torch.no_grad(), transformers_in_fp64(), stable_topk():
            logits = model(torch.tensor([s["prompt"] + s["ids"]])).logits[0].double()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s["prompt"] + s["ids"])[1:, None])[:, 0]
        return lp[len(s["prompt"]) - 1:]

    g = torch.Generator().manual_seed(1)
    for samples in groups:
        for s in samples:
            lp = ours(s)
            s["logprobs"] = (lp + torch.empty_like(lp).uniform_(-1, 1, generator=g)).clamp(max=0).tolist()
    data = write_format(tmp_path / "glm5f.jsonl", "glm5f", groups)
    records = train(cli(*grpo_flags(tmp_path, data, "run", "--data.batch_size", "1")))
    assert abs(records[0]["loss"] - formula(groups, ours)) <= 1e-10, (records[0]["loss"], formula(groups, ours))
    assert abs(records[0]["loss"] - formula(groups, theirs)) <= 1e-6
    assert 0 < records[0]["tis_capped_fraction"] < 1


def test_chat_trajectories_with_tool_calls_step_one_loss_equals_the_formula(setup):
    """`messages` trajectories with tool calls and tool output (the chat template's tokens): the step-1 loss equals
    the formula over Transformers' fp64 log-probabilities of only the assistant's tokens (no engine log-probabilities:
    every importance weight 1)."""
    tmp, policy, _ = setup
    fmt = ChatFormat.load(None)
    prompt = [{"role": "user", "content": "add 2 and 3"}]

    def turns(k):
        return [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add",
                                                                                  "arguments": {"a": 2, "b": k}}}]},
                {"role": "tool", "content": str(2 + k)}, {"role": "assistant", "content": f"it is {2 + k}" * k}]

    recs = [{"messages": prompt, "completions": [{"messages": turns(k + i), "reward": float(k * (i + 1) % 3)}
                                                 for k in range(3)]} for i in range(2)]
    path = tmp / "chat_tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    groups = []
    for grp in read_groups(str(path), fmt.tok, fmt):
        samples = []
        for c in grp.completions:
            n = c.prompt_len
            s = {"prompt": c.example.ids[:n], "ids": c.example.ids[n:], "reward": c.reward,
                 "mask": [int(t != IGNORE_INDEX) for t in c.example.labels[n:]]}
            s["logprobs"] = own_logp(policy, s).tolist()
            samples.append(s)
        groups.append(samples)
    assert all(0 < sum(s["mask"]) < len(s["ids"]) for samples in groups for s in samples)
    records = train(cli(*grpo_flags(tmp, str(path), "run_chat_tools", "--data.seq_len", "160")))
    expected = formula(groups, lambda s: own_logp(policy, s))
    assert abs(records[0]["loss"] - expected) <= 1e-8 and abs(expected) > 1e-3, (records[0]["loss"], expected)

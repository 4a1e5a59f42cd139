"""glm5f/posttrain/agent.py: tool schemas from signatures, tool calls parsed in the template's form, tools that raise,
hang or return non-text and malformed calls answered with error observations, environments bounded by max_turns, and
the trajectory's sampler log-probabilities equal to a full fp64 forward's over the whole episode."""

import json
import math
import threading
from typing import Literal, Optional

import pytest
import torch

import glm5f
from glm5f.data.chat import ChatFormat
from glm5f.data.tokens import IGNORE_INDEX
from glm5f.model import decode
from glm5f.posttrain import agent, sampler
from glm5f.posttrain.grpo import RLConfig

FMT = ChatFormat.load(None)
RELEASE = threading.Event()  # set at the end of a test so an abandoned `hang` thread finishes


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first.
        b (int): the second,
            one by default.
    """
    return a + b


def boom(x: str) -> str:
    """Always fails."""
    raise ValueError(f"no luck with {x}")


def hang(x: str) -> str:
    """Never answers in time."""
    RELEASE.wait(60)
    return "late"


def blob(x: str):
    """Returns something with no text form."""
    return object()


def listy(n: int) -> dict:
    """Returns JSON."""
    return {"k": list(range(n))}


TOOLS = {f.__name__: f for f in (add, boom, hang, blob, listy)}
SCHEMAS = {n: agent.tool_schema(f) for n, f in TOOLS.items()}


def call(name: str, **args) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                                          for k, v in args.items()) + "</tool_call>"


def turn(text: str, stop: str = "<|observation|>") -> list[int]:
    return FMT.tok.encode("<think></think>" + text + stop)


def force(monkeypatch, plans: dict) -> None:
    """Constrain decoding in `sampler.decode_rows`: a row whose generator has a plan (a list of turns, each a list of
    token ids) gets that turn's tokens in place of the sampled ones, one per step (its last repeated after); the
    logits, and so the recorded log-probabilities, stay the real decoder's. Rows without a plan sample freely."""
    real_stream, real_sample = sampler.stream, decode.sample

    def stream(params, cfg, input_ids, max_new_tokens, *, generator=None, **kw):
        turns = [plans[id(g)].pop(0) if plans.get(id(g)) else None for g in generator]
        step = [0]

        def sample(logits_BxV, temperature, top_p, gen):
            out = real_sample(logits_BxV, temperature, top_p, gen)
            if not isinstance(gen, list):  # real_sample's own call per row: the rows are forced by the outer one
                return out
            for b, t in enumerate(turns):
                if t is not None:
                    out[b] = t[min(step[0], len(t) - 1)]
            step[0] += 1
            return out
        monkeypatch.setattr(decode, "sample", sample)
        try:
            yield from real_stream(params, cfg, input_ids, max_new_tokens, generator=generator, **kw)
        finally:
            monkeypatch.setattr(decode, "sample", real_sample)
    monkeypatch.setattr(sampler, "stream", stream)


def tasks(n: int, tools=SCHEMAS, stops=None) -> list[agent.Task]:
    out = [agent.task_of({"prompt": f"task {i}", "answer": i}, f"t:{i}", FMT, list(tools.values()) or None)
           for i in range(n)]
    return out if stops is None else [agent.Task(t.ids, t.text, stops, t.fields, t.where, t.messages, t.record)
                                      for t in out]


def check_logprobs(params, cfg, ep: agent.Episode) -> int:
    """The episode's recorded log-probabilities against token_logprobs over its whole ids (fp64, 1e-10)."""
    ids = torch.tensor([ep.ids])
    want = glm5f.token_logprobs(params, cfg, ids)[0, :-1]  # position p predicts token p + 1
    mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)
    got = torch.tensor(ep.logprobs, dtype=torch.float64)
    assert len(ep.logprobs) == int(mask.sum()) and ep.loss_mask[0] == 0
    assert torch.allclose(got, want[mask], rtol=0, atol=1e-10), (got - want[mask]).abs().max()
    return len(ep.logprobs)


def test_tool_schema_from_signature_and_docstring():
    assert agent.tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "integer", "description": "the first."},
            "b": {"type": "integer", "description": "the second, one by default."}}}}}

    def pick(kind: Literal["x", "y"], tags: list[str], limit: Optional[float] = None) -> str:
        """Pick."""
    props = agent.tool_schema(pick)["function"]["parameters"]["properties"]
    assert props == {"kind": {"enum": ["x", "y"]}, "tags": {"type": "array", "items": {"type": "string"}},
                     "limit": {"type": "number"}}

    def loose(a, **more):
        """No types."""
    with pytest.raises(ValueError, match="parameter 'a' has no type annotation"):
        agent.tool_schema(loose)


def test_tool_calls_parsed_in_the_templates_form():
    """A turn rendered by the template from tool calls parses back to them; each malformed form is an error text."""
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
             {"type": "function", "function": {"name": "boom", "arguments": {"x": "a <b> c"}}}]
    m = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "sure", "reasoning_content": "r",
                                             "tool_calls": calls}]
    text = FMT.render(m)[0]
    message, parsed = agent.parse_turn(text[text.index("<think>"):], SCHEMAS)
    assert message == {"role": "assistant", "reasoning_content": "r", "content": "sure", "tool_calls": calls}
    assert parsed == [c["function"] for c in calls]
    assert agent.parse_call('add{"a": 4}', SCHEMAS) == {"name": "add", "arguments": {"a": 4}}
    bad = {"<tool_call>add<arg_key>a</arg_key>1</tool_call>": "malformed tool call to add: expected <arg_key>",
           "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>": "expected a function name",
           "<tool_call>add<arg_key>a</arg_key><arg_value>one</arg_value></tool_call>":
               "argument 'a' of add must be JSON of type integer",
           "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value>": "<tool_call> without its </tool_call>",
           "text</tool_call>": "</tool_call> outside a <tool_call>",
           "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
           "</tool_call>": "argument 'a' given twice"}
    for text, says in bad.items():
        message, parsed = agent.parse_turn(text, SCHEMAS)
        assert len(parsed) == 1 and parsed[0].startswith("error: ") and says in parsed[0], (text, parsed)
        assert "tool_calls" not in message


def test_tool_failures_become_observations_and_logprobs_equal_a_full_forward(monkeypatch):
    """Episode 0 calls tools that raise, hang past the timeout, return no text, return JSON, and one that does not
    exist, then answers; episode 1 writes malformed calls; episode 2 samples freely. Each failure is an error
    observation and the episode goes on; the ids are the template's rendering of the episode's messages; the
    trained tokens are exactly the policy's, with the full forward's log-probabilities (fp64, 1e-10)."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    plans = {id(gens[0]): [turn(call("boom", x="q") + call("hang", x="q")),
                           turn(call("blob", x="q") + call("add", a=2, b=3) + call("listy", n=2) + call("nosuch", a=1)),
                           turn("the answer is 5", "<|user|>")],
             id(gens[1]): [turn(call("add", a="one")), turn("<tool_call>add<arg_key>a</arg_key>1</tool_call>"),
                           turn(call("add", a=1) + "<tool_call>listy")]}
    forced = {i: sum(len(t) for t in plans[id(gens[i])]) for i in (0, 1)}
    force(monkeypatch, plans)
    s = RLConfig(group_size=1, temperature=0.8, top_p=0.95, max_new_tokens=110)
    a = agent.AgentSettings(tools="x", tool_timeout_s=0.3, max_turns=3)
    try:
        eps = agent.run_episodes(params, cfg, tasks(3), s, a, FMT, TOOLS, None, lambda **kw: float(len(kw["ids"])),
                                 2048, gens)
    finally:
        RELEASE.set()
    e0, e1, e2 = eps
    obs0 = [m["content"] for m in e0.messages if m["role"] == "tool"]
    assert obs0[:2] == ["error: boom raised ValueError: no luck with q", "error: hang timed out after 0.3 s"]
    assert obs0[2].startswith("error: blob returned a object, which has no text or JSON form (")
    assert obs0[3:] == ["5", json.dumps({"k": [0, 1]}),
                        "error: no tool named 'nosuch'; the tools are add, blob, boom, hang, listy"]
    assert (e0.turns, e0.ended, e0.errors) == (3, "answer", [obs0[i] for i in (0, 1, 2, 5)])
    assert e0.ids == FMT.ids(e0.messages, list(SCHEMAS.values())) + [FMT.tok.token_id("<|user|>")]
    assert e0.reward == len(e0.ids)
    obs1 = [m["content"] for m in e1.messages if m["role"] == "tool"]
    assert len(obs1) == 2 and "must be JSON of type integer" in obs1[0] and "expected <arg_key>" in obs1[1]
    assert (e1.turns, e1.ended) == (3, "max_turns")  # its third turn's calls are never run
    for i, ep in enumerate(eps):
        n = check_logprobs(params, cfg, ep)
        assert i == 2 or n == forced[i]
        turns = [j for j in range(1, len(ep.ids)) if ep.loss_mask[j] and not ep.loss_mask[j - 1]]
        assert len(turns) == ep.turns  # every turn is a run of trained tokens, context between them
    assert e2.ended in ("answer", "length", "max_turns", "context")


class Endless:
    """An environment that never says done: a user message and a reward of 0.5 each step."""

    def __init__(self, record):
        self.record, self.steps = record, 0

    def step(self, messages):
        assert messages[-1]["role"] == "assistant"
        self.steps += 1
        return [{"role": "user", "content": f"again {self.steps}"}], False, 0.5


class Broken(Endless):
    def step(self, messages):
        if self.steps == 1:
            raise RuntimeError("lost its state")
        return super().step(messages)


def test_an_environment_that_never_ends_stops_at_max_turns():
    """Free sampling (every token a stop token, so each turn is one sampled token and ends): an endless
    environment's episode has max_turns turns, each observation untrained between them, the environment's rewards
    summed; a step that raises ends its episode there. Log-probabilities as a full forward's (fp64, 1e-10)."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    s = RLConfig(group_size=1, temperature=1.0, max_new_tokens=4)
    stops = tuple(range(cfg.vocab_size))
    a = agent.AgentSettings(environment="x", max_turns=4)
    eps = agent.run_episodes(params, cfg, tasks(3, {}, stops), s, a, FMT, {}, Endless, None, 512,
                             [torch.Generator().manual_seed(i) for i in range(3)])
    for ep in eps:
        assert (ep.turns, ep.ended, ep.reward, sum(ep.loss_mask)) == (4, "max_turns", 2.0, 4)
        assert [m["content"] for m in ep.messages if m["role"] == "user"][1:] == ["again 1", "again 2", "again 3"]
        check_logprobs(params, cfg, ep)
    ep, = agent.run_episodes(params, cfg, tasks(1, {}, stops), s, a, FMT, {}, Broken, None, 512,
                             [torch.Generator().manual_seed(0)])
    assert (ep.turns, ep.ended, ep.reward) == (2, "environment", 0.5)
    assert ep.errors == ["environment step raised RuntimeError: lost its state"]


def test_episode_ends_when_the_context_is_full(monkeypatch):
    """An observation that leaves no room for one more token is not appended: the episode ends (context)."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    g = torch.Generator().manual_seed(0)
    t = tasks(1)
    first = turn(call("listy", n=30))
    force(monkeypatch, {id(g): [first, first]})
    s = RLConfig(group_size=1, temperature=1.0, max_new_tokens=64)
    ep, = agent.run_episodes(params, cfg, t, s, agent.AgentSettings(tools="x"), FMT, TOOLS, None,
                             lambda **kw: 1.0, len(t[0].ids) + len(first) + 40, [g])
    assert (ep.turns, ep.ended, ep.ids) == (1, "context", t[0].ids + first)


def test_replayed_records_give_the_episodes_logprobs():
    """The routing and indexer records stitched over the turns, replayed in a full forward over the episode, give
    the sampler's log-probabilities (fp64, 1e-10) and are the forward's own choices."""
    from glm5f.core.replay import replay_shapes

    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    s = RLConfig(group_size=1, temperature=1.0, max_new_tokens=3, replay="routing,indexer")
    stops = tuple(range(cfg.vocab_size))
    eps = agent.run_episodes(params, cfg, tasks(2, {}, stops), s, agent.AgentSettings(environment="x", max_turns=3),
                             FMT, {}, Endless, None, 512, [torch.Generator().manual_seed(i) for i in range(2)])
    shapes = replay_shapes(cfg)
    for ep in eps:
        ids = torch.tensor([ep.ids])
        rec = {f: torch.cat([ep.replay[f], ep.replay[f].new_full((1, *shapes[f]), -1)])[None] for f in shapes}
        assert rec["routing"].shape == (1, len(ep.ids), *shapes["routing"]) and (rec["routing"][0, :-1] >= 0).all()
        mask = torch.tensor(ep.loss_mask[1:], dtype=torch.bool)
        replayed = glm5f.token_logprobs(params, cfg, ids, **rec)[0, :-1][mask]
        assert torch.allclose(torch.tensor(ep.logprobs, dtype=torch.float64), replayed, rtol=0, atol=1e-10)
        assert torch.equal(replayed, glm5f.token_logprobs(params, cfg, ids)[0, :-1][mask])


def score(*, messages, ids, loss_mask, answer, **fields) -> float:
    """1 when a tool answered, 0 otherwise."""
    return float(any(m["role"] == "tool" and not m["content"].startswith("error") for m in messages))


def test_agent_source_batch_is_the_rollout_batch_with_untrained_observations(tmp_path, monkeypatch):
    """AgentSource's batch: the rollout batch's keys and shapes, labels IGNORE_INDEX off the loss mask, rollout
    log-probabilities on exactly the trained tokens; the same seed samples the same batch."""
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float64)
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"add {i}", "answer": i}) for i in range(3)) + "\n")
    s = RLConfig(group_size=2, temperature=1.0, max_new_tokens=8)
    a = agent.AgentSettings(tools="test_agent:add,test_agent:listy", max_turns=2)

    def source():
        return agent.AgentSource(str(path), 2, 1024, cfg, 0, s, a, FMT, "test_agent:score", 7)
    batch = source().next_batch(params)
    assert batch.keys() == {"input_ids", "labels", "position_ids", "rollout_logprobs", "reward", "group", "valid",
                            "tokens_computed", "tokens_unshared"}
    real = batch["position_ids"] == torch.arange(1024)  # padding's positions restart at 0
    assert torch.equal(batch["valid"].bool(), real) and torch.equal(batch["tokens_unshared"], real.sum(1))
    assert batch["input_ids"].shape == (4, 1024) and batch["group"].tolist() == [0, 0, 1, 1]
    trained = batch["labels"] != IGNORE_INDEX
    assert torch.equal(trained, ~torch.isnan(batch["rollout_logprobs"]))
    assert torch.equal(batch["labels"][trained], batch["input_ids"][trained]) and trained.sum() > 0
    again = source().next_batch(params)
    assert all(torch.equal(batch[k].nan_to_num(), again[k].nan_to_num()) for k in batch)
    with pytest.raises(ValueError, match="--rl.tools needs --rl.reward"):
        agent.AgentSource(str(path), 2, 1024, cfg, 0, s, a, FMT, None, 7)
    with pytest.raises(ValueError, match="--rl.tools test_agent:nothing: cannot import it"):
        agent.AgentSource(str(path), 2, 1024, cfg, 0, s, agent.AgentSettings(tools="test_agent:nothing"), FMT,
                          "test_agent:score", 7)
    assert math.isfinite(float(batch["reward"].sum()))


class Odd(Endless):
    """Never done; each step rewards an assistant turn of an odd number of characters."""

    def step(self, messages):
        obs, done, _ = super().step(messages)
        return obs, done, float(len(messages[-1]["content"]) % 2)


def test_an_agent_run_trains_on_its_episodes_with_no_rollout_gap_in_fp64(tmp_path, monkeypatch):
    """train.py with --rl.environment (bytes 128-255 end a turn, so episodes of several turns): the trainer's
    first-pass log-probabilities of the trained tokens, with --rl.replay routing,indexer, equal the sampler's
    (rollout_logprob_gap_max below 1e-9) at every step, and the episodes' rewards vary."""
    from conftest import cli
    from train import train

    load = ChatFormat.load

    def high_bytes_stop(*args, **kwargs):
        fmt = load(*args, **kwargs)
        fmt.stop_ids = sorted(set(fmt.stop_ids) | set(range(128, 256)))
        return fmt
    monkeypatch.setattr(ChatFormat, "load", staticmethod(high_bytes_stop))
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"go {i}"}) + "\n" for i in range(4)))
    records = train(cli("--train.objective", "grpo", "--data.type", "prompts", "--data.path", str(path),
                        "--rl.environment", "test_agent:Odd", "--rl.max_turns", "3", "--data.batch_size", "2",
                        "--rl.group_size", "4", "--rl.max_new_tokens", "8", "--data.seq_len", "96",
                        "--eval.every", "0", "--optim.lr", "1e-2", "--optim.warmup_steps", "0",
                        "--model.preset", "glm5-tiny", "--train.dtype", "float64", "--rl.replay", "routing,indexer",
                        "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "run")))
    assert len(records) == 2 and any(r["reward_std"] > 0 for r in records), records
    assert all(r["rollout_logprob_gap_max"] < 1e-9 for r in records), [r["rollout_logprob_gap_max"] for r in records]
    for r in records:  # the episodes' metrics: turns within 1..max_turns, each episode ending one way
        assert 1 <= r["turns"] <= 3 and abs(sum(r[f"ended_{w}"] for w in sampler.ENDINGS) - 1) < 1e-12, r


def test_episode_metrics_count_turns_endings_and_failures():
    """Mean turns, the share of episodes per ending and failed calls per episode, over every group's episodes;
    nothing for single-turn groups; the toy environment rewards each turn's share of lowercase letters."""
    from glm5f.data.rollouts import Group
    from glm5f.posttrain.rewards import LowercaseTurns

    groups = [Group((), "a:1", {}, ((3, "max_turns", 0), (1, "length", 2))), Group((), "a:2", {}, ((2, "answer", 1),))]
    m = sampler.episode_metrics(groups)
    assert m["turns"] == 2.0 and m["tool_errors"] == 1.0
    assert {w: m[f"ended_{w}"] for w in sampler.ENDINGS} == {
        "answer": 1 / 3, "done": 0.0, "max_turns": 1 / 3, "context": 0.0, "length": 1 / 3, "environment": 0.0}
    assert sampler.episode_metrics([Group((), "b:1", {})]) == {}
    env = LowercaseTurns({"prompt": "x"})
    assert env.step([{"role": "assistant", "content": "abC1"}]) == ([{"role": "user", "content": "more"}], False, 0.5)
    assert env.step([{"role": "assistant", "content": ""}])[2] == 0.0

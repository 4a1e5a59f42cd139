"""On-policy agents: multi-turn episodes decoded by the policy, each turn's tool calls (in the chat template's format)
run with a time bound or an environment stepped, the observations appended as untrained context.

Task record: {"messages": [...] | "prompt": str (one user message), ...any other fields: passed to the reward function
and, whole, to the environment's factory}. Shape suffixes: B rows (one episode each), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import numbers
import re
import threading
import types
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from glm5f.core.config import GLM5Config
from glm5f.data.chat import ROLES, ChatFormat, chat_messages
from glm5f.data.files import file_records
from glm5f.data.readers import chat_prompt
from glm5f.data.rollouts import CALL_MARKUP, Completion, Group, record_columns
from glm5f.data.sources import shuffle_draw
from glm5f.data.tokens import IGNORE_INDEX, Example
from glm5f.posttrain.sampler import Prompt, PromptSource, decode_rows, load_reward

RESERVED = ("ids", "loss_mask")  # reward keyword arguments a record's own fields may not take
MARKUP = CALL_MARKUP[1:]  # only inside a call
ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array",
              dict: "object", type(None): "null"}


@dataclass
class AgentSettings:
    """The --rl flags of on-policy agents (mounted beside the sampler's)."""

    tools: str = ""
    """Agents: the policy's tools, module:function,... (plain Python functions; each one's JSON schema, from its
    signature and docstring, is given to the chat template); the tool calls of each assistant turn run them."""
    environment: Optional[str] = None
    """Agents: module:factory instead of --rl.tools; factory(record) gives an object whose step(messages) returns
    (observation messages, done) or (observation messages, done, reward), stepped after every assistant turn."""
    tool_timeout_s: float = 10.0
    """Agents: seconds a tool call (or an environment step) may take; past it the model is told it timed out (an
    environment's episode ends) and the call is abandoned."""
    max_turns: int = 4
    """Agents: most assistant turns per episode (each up to --rl.max_new_tokens tokens; --data.seq_len bounds the
    whole episode)."""

    @property
    def tool_specs(self) -> tuple[str, ...]:
        """The --rl.tools entries, in order."""
        return tuple(t.strip() for t in self.tools.split(",") if t.strip())

    @property
    def enabled(self) -> bool:
        return bool(self.tool_specs) or self.environment is not None

    def check(self, reward) -> None:
        """A ValueError for flags that cannot run together (`reward`: the --rl.reward function or None)."""
        if self.tool_specs and self.environment is not None:
            raise ValueError("--rl.tools and --rl.environment both given: give the tools, or an environment that "
                             "handles the calls itself")
        if not self.enabled:
            raise ValueError("an agent needs --rl.tools module:function,... or --rl.environment module:factory")
        if self.environment is None and reward is None:
            raise ValueError("--rl.tools needs --rl.reward module:function to score the episodes (or use "
                             "--rl.environment, whose steps may return the reward)")
        if not self.max_turns >= 1:
            raise ValueError(f"--rl.max_turns must be at least 1, got {self.max_turns}")
        if not (self.tool_timeout_s > 0 and math.isfinite(self.tool_timeout_s)):
            raise ValueError(f"--rl.tool_timeout_s must be a positive number of seconds, got {self.tool_timeout_s}")


# ---- tools: schemas, parsing, bounded calls ---------------------------------------------------------------------

def json_schema_type(annotation, where: str) -> dict:
    """The JSON schema of a Python type annotation: str, int, float, bool, list[...], tuple, dict, Literal[...],
    Optional[X] / X | None (X's); a ValueError naming `where` for any other."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return json_schema_type(kept[0], where)
        return {"anyOf": [json_schema_type(a, where) for a in kept]}
    if origin is Literal:
        return {"enum": list(args)}
    base = origin or annotation
    if base not in JSON_TYPES:
        raise ValueError(f"{where}: type {annotation!r} has no JSON form; annotate it with str, int, float, bool, "
                         f"list, dict, a Literal or an Optional of one")
    out = {"type": JSON_TYPES[base]}
    if base is list and args:
        out["items"] = json_schema_type(args[0], where)
    return out


def doc_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {argument: its description}) of a docstring: its text before an "Args:" section, and that
    section's `name: text` or `name (type): text` entries (indented lines continue one)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    head, args, name, inside, indent = [], {}, None, False, 0
    for line in lines:
        if re.fullmatch(r"(Args|Arguments|Parameters):\s*", line.strip()):
            inside = True
            continue
        if inside and re.fullmatch(r"[A-Z][A-Za-z ]*:\s*", line.strip()) and not line.startswith(" "):
            inside = False  # the next section (Returns:, Raises:)
            continue
        if not inside:
            head.append(line)
            continue
        m = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if m and (name is None or len(line) - len(line.lstrip()) <= indent):
            name, indent = m.group(1), len(line) - len(line.lstrip())
            args[name] = m.group(2).strip()
        elif name is not None and line.strip():
            args[name] = (args[name] + " " + line.strip()).strip()
    return " ".join(" ".join(head).split()), args


def tool_schema(fn) -> dict:
    """The tool schema of a Python function, as chat templates take tools: {"type": "function", "function":
    {"name", "description", "parameters": {"type": "object", "properties", "required"}}}: each parameter's type
    from its annotation (`json_schema_type`), its description from the docstring's Args section; required: the
    parameters without a default. A ValueError for *args, **kwargs or a parameter with no annotation."""
    name = fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation naming what the module cannot resolve: any error
        raise ValueError(f"tool {name}: cannot read its annotations ({type(e).__name__}: {e})") from None
    description, arg_docs = doc_parts(fn.__doc__)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name}: *{p.name} has no schema; give each argument as a named parameter")
        if p.name not in hints:
            raise ValueError(f"tool {name}: parameter {p.name!r} has no type annotation; annotate it (str, int, ...) "
                             f"so the model is told what to pass")
        properties[p.name] = json_schema_type(hints[p.name], f"tool {name}, parameter {p.name!r}")
        if p.name in arg_docs:
            properties[p.name]["description"] = arg_docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def load_tools(specs: tuple[str, ...]) -> dict:
    """{name: function} of the --rl.tools entries (`sampler.load_reward` imports each); a ValueError for two tools
    of one name."""
    tools = {}
    for spec in specs:
        fn = load_reward(spec, "--rl.tools")
        if fn.__name__ in tools:
            raise ValueError(f"--rl.tools: two tools are named {fn.__name__!r}; the model calls a tool by its name")
        tools[fn.__name__] = fn
    return tools


def typed_arguments(name: str, raw: dict[str, str], schema: dict | None) -> dict | str:
    """A call's arguments typed by its tool's schema: a parameter of type string as written, any other parsed as
    JSON (an argument the schema does not name stays text); the error observation text for one that is not JSON."""
    props = schema["function"]["parameters"]["properties"] if schema else {}
    out = {}
    for key, value in raw.items():
        kind = props.get(key, {}).get("type", "string")
        if kind == "string":
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            return f"error: argument {key!r} of {name} must be JSON of type {kind}, found {value[:60]!r}"
    return out


def parse_call(body: str, schemas: dict) -> dict | str:
    """One <tool_call> block's text (the template's form: name, then <arg_key>k</arg_key><arg_value>v</arg_value>
    per argument, or name then a JSON object) as {"name", "arguments"}; the error observation text when malformed."""
    head, sep, rest = body.partition("<arg_key>")
    name, arguments = head.strip(), None
    if not sep and "{" in name:  # name{"k": v}: the arguments as one JSON object
        name, js = name[:name.index("{")].strip(), name[name.index("{"):]
        try:
            arguments = json.loads(js)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return f"error: malformed tool call: the arguments of {name!r} are not a JSON object: {js[:60]!r}"
    if not name or re.search(r"[\s<>{}]", name):
        return (f"error: malformed tool call: expected a function name right after <tool_call>, found "
                f"{body[:60]!r}")
    if arguments is None:
        raw, rest, at = {}, sep + rest, 0
        while rest[at:].strip():
            m = ARG.match(rest, at)
            if m is None:
                return (f"error: malformed tool call to {name}: expected <arg_key>name</arg_key><arg_value>value"
                        f"</arg_value>, found {rest[at:at + 60]!r}")
            if m.group(1).strip() in raw:
                return f"error: malformed tool call to {name}: argument {m.group(1).strip()!r} given twice"
            raw[m.group(1).strip()] = m.group(2)
            at = m.end()
        arguments = typed_arguments(name, raw, schemas.get(name))
        if isinstance(arguments, str):
            return arguments
    return {"name": name, "arguments": arguments}


def parse_turn(text: str, schemas: dict) -> tuple[dict, list]:
    """(the assistant message of a decoded turn's text (its stop token left out): "content", "reasoning_content"
    from a leading <think>...</think>, "tool_calls" of its well-formed calls; its calls in order, each
    {"name", "arguments"} or the error observation text of a malformed one)."""
    message = {"role": "assistant"}
    if text.startswith("<think>") and "</think>" in text:
        message["reasoning_content"], text = text[len("<think>"):].split("</think>", 1)
    pieces = text.split("<tool_call>")
    content, calls = pieces[0], []
    for piece in pieces[1:]:
        body, closed, after = piece.partition("</tool_call>")
        content += after
        calls.append(parse_call(body, schemas) if closed else
                     f"error: malformed tool call: <tool_call> without its </tool_call> ({body[:60]!r})")
    stray = [m for m in MARKUP if m in content]
    if stray:
        calls.append(f"error: malformed tool call: {stray[0]} outside a <tool_call>...</tool_call> block")
    message["content"] = content
    good = [c for c in calls if isinstance(c, dict)]
    if good:
        message["tool_calls"] = [{"type": "function", "function": c} for c in good]
    return message, calls


def bounded(fn, timeout_s: float, *args, **kwargs) -> tuple[str, object]:
    """fn(*args, **kwargs) in a daemon thread, waited for up to timeout_s: ("ok", its value), ("raised", the
    exception) or ("timeout", None), the thread then abandoned (it runs on unobserved; its result is dropped)."""
    box = {}

    def work():
        try:
            box["value"] = fn(*args, **kwargs)
        except Exception as e:  # the user's code: any exception is reported to the caller
            box["error"] = e

    thread = threading.Thread(target=work, daemon=True, name=f"agent call {getattr(fn, '__name__', fn)}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", None
    if "value" in box:
        return "ok", box["value"]
    return "raised", box.get("error", RuntimeError("the call ended without a result"))


def as_text(value) -> str:
    """A tool's result as observation text: a string as it is, anything else as JSON (TypeError or ValueError
    when it has none: an object, NaN)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def run_call(call: dict | str, tools: dict, timeout_s: float) -> dict:
    """The tool message answering one parsed call: the tool's result as text, or the error text of a malformed
    call, an unknown tool, a tool that raised, timed out or returned something with no text form."""
    if isinstance(call, str):
        return {"role": "tool", "content": call}
    name = call["name"]
    fn = tools.get(name)
    if fn is None:
        text = f"error: no tool named {name!r}; the tools are {', '.join(sorted(tools))}"
    else:
        how, value = bounded(fn, timeout_s, **call["arguments"])
        if how == "timeout":
            text = f"error: {name} timed out after {timeout_s:g} s"
        elif how == "raised":
            text = f"error: {name} raised {type(value).__name__}: {value}"
        else:
            try:
                text = as_text(value)
            except (TypeError, ValueError) as e:
                text = f"error: {name} returned a {type(value).__name__}, which has no text or JSON form ({e})"
    return {"role": "tool", "name": name, "content": text}


def environment_step(env, messages: list[dict], timeout_s: float) -> tuple[list[dict], bool, float | None] | str:
    """(observation messages, done, reward or None) of env.step(messages), checked; the failure's text when it
    raised, timed out or returned something else."""
    how, out = bounded(env.step, timeout_s, [dict(m) for m in messages])
    if how == "timeout":
        return f"environment step timed out after {timeout_s:g} s (--rl.tool_timeout_s)"
    if how == "raised":
        return f"environment step raised {type(out).__name__}: {out}"
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        return f"environment step returned {out!r:.60}; expected (observation messages, done[, reward])"
    obs, done, reward = out[0], out[1], out[2] if len(out) == 3 else None
    if not (isinstance(obs, list) and all(isinstance(m, dict) and m.get("role") in ROLES[:2] + ROLES[3:]
                                          and isinstance(m.get("content"), str) for m in obs)):
        return (f"environment step returned observations {obs!r:.60}; expected a list of {{'role': 'tool' | "
                f"'user' | 'system', 'content': str}} messages")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(float(reward))):
        return f"environment step returned reward {reward!r:.40}; expected a finite number or None"
    return obs, bool(done), None if reward is None else float(reward)


# ---- episodes ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task(Prompt):
    messages: tuple = ()  # the record's conversation, up to the assistant's first turn
    record: dict = field(default_factory=dict)  # the whole record, as the environment's factory takes it


@dataclass
class Episode:
    """One trajectory: `ids` the prompt, the policy's turns and the observations between them; `loss_mask` 1 on
    the tokens the policy generated (each turn's stop token too); `logprobs` the sampler's log-probability of each
    of those, in order; `replay` per --rl.replay field [len(ids) - 1, slots, k]; `ended` why it stopped: answer
    (a turn without tool calls), done (the environment said so), max_turns, context (--data.seq_len full),
    length (a turn ran out of --rl.max_new_tokens), environment (its step failed: `errors` says how)."""

    ids: list[int]
    loss_mask: list[int]
    messages: list[dict]
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    ended: str = ""
    errors: list[str] = field(default_factory=list)
    replay: dict = field(default_factory=dict)
    env_reward: float = 0.0

    def completion(self, prompt_len: int) -> Completion:
        """The episode as GRPO's rollout row: labels on the trained tokens only (IGNORE_INDEX elsewhere), and a
        log-probability per token after the prompt (NaN on the untrained ones)."""
        labels = [t if m else IGNORE_INDEX for t, m in zip(self.ids, self.loss_mask)]
        it = iter(self.logprobs)
        logprobs = [next(it) if m else math.nan for m in self.loss_mask[prompt_len:]]
        return Completion(Example(self.ids, labels), self.reward, logprobs, dict(self.replay))


def observation_ids(fmt: ChatFormat, messages: list[dict], tools, observations: list[dict],
                    turn: list[int]) -> list[int]:
    """The tokens the template puts after an assistant turn (its tokens `turn`, ending in the stop id the policy
    emitted) for `observations`, up to the next assistant turn's generation prompt: the rendering of messages +
    observations less that of messages; its first token dropped when it is the stop id already emitted (GLM-5:
    <|observation|>), else what the template closes the turn with after that stop id (ChatML's newline) first."""
    before = fmt.ids(messages, tools)
    after = fmt.ids(messages + observations, tools, add_generation_prompt=True)
    if after[:len(before)] != before:
        raise ValueError(f"{fmt.template.name}: a conversation renders differently once observations follow it; "
                         f"an agent needs a template that only appends turns")
    new = after[len(before):]
    if new and new[0] == turn[-1]:
        return new[1:]
    if turn[-1] in before:
        closing = before[len(before) - before[::-1].index(turn[-1]):]
        if not fmt.tok.decode(closing).strip():
            return closing + new
    return new


def respond(ep: Episode, calls: list, turn: list[int], stopped: bool, env, tools: dict, a: AgentSettings
            ) -> list[dict] | None:
    """The observation messages after an episode's latest turn, or None when the episode ends there (`ep.ended`
    set): the environment is stepped after every turn; tools run only when the episode goes on."""
    if env is not None:
        out = environment_step(env, ep.messages, a.tool_timeout_s)
        if isinstance(out, str):
            ep.errors.append(out)
            ep.ended = "environment"
            return None
        obs, done, reward = out
        ep.env_reward += reward or 0.0
        ep.ended = "done" if done else ""
    elif not calls:
        ep.ended = "answer"
    if not ep.ended and not stopped:
        ep.ended = "length"
    if not ep.ended and ep.turns >= a.max_turns:
        ep.ended = "max_turns"
    if ep.ended:
        return None
    if env is None:
        obs = [run_call(c, tools, a.tool_timeout_s) for c in calls]
        ep.errors += [m["content"] for m in obs if m["content"].startswith("error: ")]
    return obs


@torch.no_grad()
def run_episodes(params: dict, cfg: GLM5Config, tasks: list[Task], s, a: AgentSettings,
                 fmt: ChatFormat, tools: dict, factory, reward, seq_len: int,
                 generators: list[torch.Generator] | None = None, reward_name: str = "--rl.reward") -> list[Episode]:
    """One episode per task, all decoded together turn by turn (`sampler.decode_rows` on the episodes still going,
    each with its own generator: `generators` one per task, None for greedy), each turn up to s.max_new_tokens and
    the room left in seq_len, then `respond`; its observation tokens (`observation_ids`) appended untrained unless
    they leave no room for one more token (ended: context). The reward: `reward`(messages=, ids=, loss_mask=,
    **the record's other fields) when given, else the sum of the environment's step rewards (0 if none)."""
    device = params["model"]["embed_tokens"]["weight"].device
    schemas = {name: tool_schema(fn) for name, fn in tools.items()} if tools else {}
    listed = list(schemas.values()) or None
    eps = [Episode(list(t.ids), [0] * len(t.ids), [dict(m) for m in t.messages]) for t in tasks]
    envs = [None] * len(tasks)
    for i, t in enumerate(tasks if factory is not None else ()):
        try:
            envs[i] = factory(t.record)
        except Exception as e:  # the user's code
            raise ValueError(f"{t.where}: --rl.environment's factory raised {type(e).__name__}: {e}") from None
    live = [i for i, ep in enumerate(eps) if len(ep.ids) < seq_len]
    for i in set(range(len(eps))) - set(live):
        eps[i].ended = "context"
    while live:
        room = [seq_len - len(eps[i].ids) for i in live]
        rows = [Prompt(eps[i].ids, "", tasks[i].stops, {}, tasks[i].where) for i in live]
        step = dataclasses.replace(s, max_new_tokens=min(s.max_new_tokens, max(room)))
        gens = None if generators is None else [generators[i] for i in live]
        new, logps, records = decode_rows(params, cfg, rows, step, fmt.tok.pad_id, gens, device)
        going = []
        for r, i in enumerate(live):
            ep, turn = eps[i], new[r][:room[r]]
            ep.ids, ep.loss_mask, ep.logprobs = ep.ids + turn, ep.loss_mask + [1] * len(turn), ep.logprobs + \
                logps[r][:len(turn)]
            for f, per_row in records.items():  # the positions this call ran first, the earlier ones kept
                seen = per_row[r][:len(ep.ids) - 1]
                ep.replay[f] = seen if f not in ep.replay else torch.cat([ep.replay[f], seen[len(ep.replay[f]):]])
            ep.turns += 1
            stopped = turn[-1] in tasks[i].stops
            message, calls = parse_turn(fmt.tok.decode(turn[:-1] if stopped else turn, keep_special=True), schemas)
            ep.messages.append(message)
            obs = respond(ep, calls, turn, stopped, envs[i], tools, a)
            if obs is None:
                continue
            more = observation_ids(fmt, ep.messages, listed, obs, turn)
            if len(ep.ids) + len(more) >= seq_len:
                ep.ended = "context"
                continue
            ep.ids, ep.loss_mask, ep.messages = ep.ids + more, ep.loss_mask + [0] * len(more), ep.messages + obs
            going.append(i)
        live = going
    for t, ep in zip(tasks, eps):
        ep.reward = ep.env_reward if reward is None else episode_reward(reward, t, ep, reward_name)
    return eps


def episode_reward(fn, t: Task, ep: Episode, name: str) -> float:
    """fn(messages=, ids=, loss_mask=, **the record's other fields) as a float; a ValueError naming the record when
    it raises or returns no finite number."""
    try:
        r = fn(messages=[dict(m) for m in ep.messages], ids=list(ep.ids), loss_mask=list(ep.loss_mask), **t.fields)
    except Exception as e:  # the user's code: any exception is theirs to see
        raise ValueError(f"{t.where}: {name} raised {type(e).__name__}: {e}") from None
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
        raise ValueError(f"{t.where}: {name} returned {r!r:.40}; it must return a finite number")
    return float(r)


# ---- tasks and the rollout source ---------------------------------------------------------------------------------

def task_of(rec, where: str, fmt: ChatFormat, tools: list | None) -> Task:
    """The Task of one record (see the module docstring): its messages rendered with the tools' schemas up to the
    assistant's turn; a ValueError naming `where` for a bad one."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    rec = chat_prompt(rec, where)
    if "messages" in rec:
        try:
            messages = chat_messages({"messages": rec["messages"]})[0]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    elif isinstance(rec.get("prompt"), str):
        messages = [{"role": "user", "content": rec["prompt"]}]
    else:
        raise ValueError(f"{where}: an agent's task needs 'messages' (a conversation) or 'prompt' (a string); found "
                         f"keys {sorted(rec)}")
    taken = [k for k in RESERVED if k in rec]
    if taken:
        raise ValueError(f"{where}: field {taken[0]!r} is the name of the reward function's argument for the episode; "
                         f"rename it")
    try:
        text = fmt.render(messages, tools, add_generation_prompt=True)[0]
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return Task(fmt.tok.encode_offsets(text)[0], text, tuple(fmt.stop_ids),
                record_columns(rec, where), where, tuple(messages), rec)


def read_tasks(path: str, fmt: ChatFormat, tools: dict) -> list[Task]:
    """Every task of a JSONL file (blank lines skipped); a ValueError naming file:line for a bad record."""
    listed = [tool_schema(fn) for fn in tools.values()] or None
    return [task_of(rec, where, fmt, listed) for where, rec in file_records(path, "agent tasks")]


def agent_groups(params: dict, cfg: GLM5Config, tasks: list[Task], s, a: AgentSettings,
                 fmt: ChatFormat, tools: dict, factory, reward, seq_len: int,
                 generators: list[torch.Generator] | None = None, reward_name: str = "--rl.reward") -> list[Group]:
    """One Group per task of s.group_size episodes (`run_episodes`, all of the call's together), member j of a
    task drawing from a generator seeded by (its task's generator's seed, j)."""
    rows = [t for t in tasks for _ in range(s.group_size)]
    gens = None
    if generators is not None:
        gens = [torch.Generator(g.device).manual_seed(shuffle_draw(g.initial_seed(), j) >> 1)
                for g in generators for j in range(s.group_size)]
    eps = run_episodes(params, cfg, rows, s, a, fmt, tools, factory, reward, seq_len, gens, reward_name)
    n = s.group_size
    return [Group(tuple(ep.completion(len(t.ids)) for ep in eps[g * n:(g + 1) * n]), t.where,
                  {"prompt_ids": list(t.ids), **t.fields},
                  tuple((ep.turns, ep.ended, len(ep.errors)) for ep in eps[g * n:(g + 1) * n]))
            for g, t in enumerate(tasks)]


class AgentSource(PromptSource):
    """The on-policy sampler's PromptSource (order, seeds, layouts, resume) whose groups are agent episodes: its
    batch is GRPO's rollout batch, "labels" IGNORE_INDEX on the untrained tokens (observations, prompts)."""

    def __init__(self, path: str, batch_size: int, seq_len: int, cfg: GLM5Config, seed: int, settings,
                 agent: AgentSettings, fmt: ChatFormat, reward_spec: str | None, sample_seed: int,
                 device: torch.device | str = "cpu", skip_overlong: bool = False):
        reward = None if reward_spec is None else load_reward(reward_spec)
        agent.check(reward)
        self.agent, self.fmt, self.tools = agent, fmt, load_tools(agent.tool_specs)
        self.factory = None if agent.environment is None else load_reward(agent.environment, "--rl.environment")
        super().__init__(read_tasks(path, fmt, self.tools), batch_size, seq_len, cfg, seed, fmt.tok.pad_id, settings,
                         reward, f"--rl.reward {reward_spec}", fmt.tok, sample_seed, device, skip_overlong)

    def sample(self, params: dict, prompts: list[Prompt], generators: list[torch.Generator]) -> list[Group]:
        return agent_groups(params, self.cfg, prompts, self.settings, self.agent, self.fmt, self.tools, self.factory,
                            self.reward, self.S, generators, self.reward_name)

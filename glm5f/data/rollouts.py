"""Rollouts (`--data.type rollouts`): JSONL records of a prompt with a group of its sampled completions or
trajectories, each with its reward (and what the engine kept of how it sampled), read into memory and served one
completion per row, a batch holding whole groups, for the GRPO objective. Other engines' files: glm5f/data/engines.py.

Record: {"prompt": str | "messages": [...] (with "tools") | "prompt_ids": [int], "completions": [completion, ...],
...metadata}. A completion is one of
- {"text": str}: followed by eos (a chat's by the template's stop token, as SFT trains it), unless cut;
- {"ids": [int], "loss_mask"?: [0|1]}: token ids as given; loss_mask 1 where the policy generated the token (the
  rest, e.g. tool output, is context and never trained; default all 1);
- {"messages": [...]}: the turns after the chat prompt (assistant turns with "tool_calls", "tool" or "observation"
  turns) rendered with the run's chat template, trained on every assistant token and the marker ending its turn;
with "reward": float; "logprobs"?: the engine's log-probability of each completion token, or of each trained one
(null: none; for text, the eos glm5f appends may have none: its importance weight is then 1); "finish_reason"?:
"stop" | "eos" | "tool_calls" | "length", or "truncated"?: bool (cut by the engine: no eos appended, and
--rl.mask_truncated leaves it out of the loss, its reward still in its group's statistics); "routing"?: [per
position of prompt + completion but the last: per MoE layer: its top-k expert ids], "indexer"?: [per such position:
per indexed DSA layer: the key positions (GLM-5.3: pools) it selected, -1 filling unused slots]. A completion field
glm5f does not read is refused, as are fields of a completion written on the record. Every group of a file has the
same number of completions, at least 2: a group's advantages compare them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from glm5f.core.replay import REPLAY_KEYS, check_replay
from glm5f.data import engines
from glm5f.data.chat import chat_messages
from glm5f.data.files import file_records
from glm5f.data.overlong import fitting
from glm5f.data.readers import chat_prompt
from glm5f.data.rollout_trees import tree_rows
from glm5f.data.tokens import IGNORE_INDEX, Example

# the chat template's tool-call markup: a call it renders itself, never text a message holds
CALL_MARKUP = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
COMPLETION_FIELDS = ("text", "ids", "messages", "loss_mask", "reward", "logprobs", "finish_reason", "truncated",
                     *REPLAY_KEYS)
PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
# Fields on a record that belong to its completions (or that glm5f does not read): refused there, never dropped.
NOT_ON_RECORD = ("text", "ids", "loss_mask", "reward", "logprobs", "finish_reason", "truncated", "labels",
                 "input_ids", "attention_mask", "response", "completion", "chosen", "rejected", *REPLAY_KEYS)
FINISH_REASONS = {"stop": False, "eos": False, "tool_calls": False, "length": True}  # -> cut by the engine


@dataclass(frozen=True)
class ReadOptions:
    """How a rollouts file is read: --data.format and --data.group_key, the --rl.replay records each completion must
    carry, and --rl.mask_truncated."""

    format: str = "glm5f"
    group_key: str | None = None
    replay: tuple[str, ...] = ()
    mask_truncated: bool = False


@dataclass(frozen=True)
class Completion:
    example: Example  # prompt + completion; labels on the trained tokens
    reward: float
    logprobs: list[float] | None  # the engine's log-probability of each of the last len(logprobs) tokens (NaN: none)
    replay: dict  # field ("routing", "indexer") -> LongTensor [len(ids) - 1, slots, k]
    truncated: bool = False  # cut by the engine
    prompt_len: int | None = None
    where: str | None = None  # file:line (and which completion of the record)


@dataclass(frozen=True)
class Group:
    completions: tuple[Completion, ...]
    where: str
    prompt: dict  # the record's prompt fields and any other fields it has ("completions" aside)
    episodes: tuple = ()  # an agent group's (turns, why it ended, failed tool calls) per completion


def _ids(value, what: str, where: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{where}: {what} must be a list of integer token ids, found {json.dumps(value)[:40]}")
    return value


def prompt_ids(rec: dict, where: str, tok, fmt=None) -> list[int]:
    """A record's prompt as token ids: "prompt_ids" as given, "prompt" text (bos first) or "messages" (or "prompt" as
    a list of messages) rendered with the run's template (and the record's "tools") up to the assistant's turn (its
    generation prompt)."""
    rec = chat_prompt(rec, where)
    given = [k for k in PROMPT_FIELDS if k in rec]
    if len(given) > 1:
        raise ValueError(f"{where}: the record gives its prompt twice ({' and '.join(map(repr, given))}); keep one")
    if "tools" in rec and given != ["messages"]:
        raise ValueError(f"{where}: 'tools' are rendered by the chat template with 'messages', but the prompt is "
                         f"{given[0] if given else 'missing'!r}; give the prompt as 'messages'")
    if "prompt_ids" in rec:
        return _ids(rec["prompt_ids"], "prompt_ids", where)
    if "messages" in rec:
        if fmt is None:
            raise ValueError(f"{where}: a chat record ('messages'), but no chat template was given to render it")
        if not isinstance(rec["messages"], list):
            raise ValueError(f"{where}: 'messages' must be a list of messages, found "
                             f"{json.dumps(rec['messages'])[:40]}")
        try:
            messages, tools = chat_messages({"messages": rec["messages"], "tools": rec.get("tools")})
            return fmt.ids(messages, tools, add_generation_prompt=True)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{where}: field 'prompt' must be a string, found {json.dumps(rec['prompt'])[:40]}")
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(rec["prompt"])
    raise ValueError(f"{where}: a record needs 'prompt', 'messages' or 'prompt_ids'; found keys {sorted(rec)}")


def record_columns(rec: dict, where: str) -> dict:
    """The fields of a prompt record other than its prompt's, as a reward function is called with them: each as
    given, and verl's `reward_model.ground_truth` also as `ground_truth` (a ValueError when the record gives another
    `ground_truth` of its own)."""
    out = {k: v for k, v in rec.items() if k not in PROMPT_FIELDS}
    nested = rec.get("reward_model")
    if isinstance(nested, dict) and "ground_truth" in nested:
        if "ground_truth" in out and out["ground_truth"] != nested["ground_truth"]:
            raise ValueError(f"{where}: 'ground_truth' {json.dumps(out['ground_truth'])[:40]} and "
                             f"'reward_model.ground_truth' {json.dumps(nested['ground_truth'])[:40]} differ; keep one")
        out["ground_truth"] = nested["ground_truth"]
    return out


def completion_example(rec: dict, prompt: list[int], completion, what: str, tok, fmt=None,
                       cut: bool = False) -> tuple[Example, int]:
    """(prompt + completion as an Example with labels on the completion, 1 when an end token was appended): token
    ids as given; text followed by eos, or in a chat record rendered as the assistant's answer (its stop token
    scored, as SFT trains it); a `cut` text has nothing appended."""
    added = 0
    if isinstance(completion, list):
        ids = _ids(completion, "'ids'", what)
    elif "messages" in rec:
        turns, tools = chat_messages({"messages": rec["messages"] + [{"role": "assistant", "content": completion}],
                                      "tools": rec.get("tools")})
        full = fmt.example(turns, tools, train_on="last")
        if full.ids[:len(prompt)] != prompt:
            raise ValueError(f"{what}: the template renders the conversation with the answer differently from its "
                             f"generation prompt; give the completion as 'ids'")
        rendered = len(fmt.tokenize(turns, tools)[0])
        added = len(full.ids) - rendered  # the eos appended after an answer the template ends in no stop token
        ids = full.ids[len(prompt):rendered] if cut else full.ids[len(prompt):]
        added = 0 if cut else added
    else:
        added = int(tok.eos_id is not None and not cut)
        ids = tok.encode(completion) + ([tok.eos_id] if added else [])
    if not ids:
        raise ValueError(f"{what} has no tokens; remove it or its group")
    return Example(prompt + ids, [IGNORE_INDEX] * len(prompt) + ids), added


def listed_tools(messages: list[dict], tools: list | None) -> None:
    """A trajectory whose record lists its tools calls only those (a ValueError naming the message otherwise): the
    policy was given those schemas, so a call to another is a broken record."""
    named = {f.get("name") for t in tools or () if isinstance(t, dict) for f in [t.get("function", t)]
             if isinstance(f, dict)}
    for i, m in enumerate(messages if tools else ()):
        for c in m.get("tool_calls", ()):
            if c["function"]["name"] not in named:
                raise ValueError(f"message {i}: a tool call names {c['function']['name']!r}, which is not among the "
                                 f"record's tools ({', '.join(sorted(map(str, named)))}); fix the name or add its "
                                 f"schema to 'tools'")


def trajectory_example(rec: dict, prompt: list[int], turns, what: str, fmt) -> Example:
    """prompt + the turns after it rendered with the chat template: labels on every assistant token and the marker
    ending its turn (as SFT trains them), never on the prompt, tool, observation or user tokens."""
    if fmt is None or "messages" not in rec:
        raise ValueError(f"{what}: a 'messages' trajectory continues a chat prompt: give the record's prompt as "
                         f"'messages' (and its 'tools')")
    if not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
        raise ValueError(f"{what}: 'messages' must be a list of message objects, found {json.dumps(turns)[:60]}")
    if not any(m.get("role") == "assistant" for m in turns):
        raise ValueError(f"{what}: the trajectory has no assistant turn (nothing the policy generated to train)")
    turns = [{**m, "role": "tool"} if m.get("role") == "observation" else m for m in turns]
    for i, m in enumerate(turns):
        markup = next((k for k in CALL_MARKUP if m.get("role") == "assistant" and k in str(m.get("content"))), None)
        if markup:
            raise ValueError(f"{what}: turn {i} (assistant) has the tool-call markup {markup!r} in its text; give its "
                             f"calls as 'tool_calls' ([{{'function': {{'name', 'arguments'}}}}]) for the template to "
                             f"render")
    try:
        messages, tools = chat_messages({"messages": rec["messages"] + turns, "tools": rec.get("tools")})
        listed_tools(messages, tools)
        ex = fmt.example(messages, tools, "assistant")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{what}: {e}") from None
    if ex.ids[:len(prompt)] != prompt:
        raise ValueError(f"{what}: the conversation with the trajectory renders its prompt differently from the "
                         f"prompt's generation prompt (does the trajectory begin with an assistant turn?); give it "
                         f"as 'ids' with a 'loss_mask'")
    return Example(ex.ids, [IGNORE_INDEX] * len(prompt) + ex.labels[len(prompt):])


def _mask(value, n: int, what: str) -> list[int]:
    if value is None:
        return [1] * n
    if not (isinstance(value, list) and all(v in (0, 1) for v in value)):
        raise ValueError(f"{what}: 'loss_mask' must be a list of 0 and 1, found {json.dumps(value)[:60]}")
    if len(value) != n:
        raise ValueError(f"{what}: 'loss_mask' has {len(value)} entries for {n} token ids; give one per id")
    return [int(v) for v in value]


def rollout_logprobs(value, trained: list[int], added: int, what: str) -> list[float]:
    """The engine's log-probabilities over the n completion tokens (NaN where none): one per token, one per trained
    token (`trained`: 1 for each), or, with `added` an eos glm5f appended, one per token before it."""
    ok = lambda x: x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
                                 and math.isfinite(x) and x <= 0)
    if not (isinstance(value, list) and all(ok(x) for x in value)):
        raise ValueError(f"{what}: 'logprobs' must be a list of finite log-probabilities (<= 0, or null), found "
                         f"{json.dumps(value)[:60]}")
    n, k = len(trained), sum(trained)
    nan = float("nan")
    if len(value) == n:
        out = value
    elif len(value) == k:
        it = iter(value)
        out = [next(it) if t else None for t in trained]
    elif added and len(value) == n - added:
        out = value + [None] * added
    else:
        raise ValueError(f"{what}: {len(value)} logprobs for {n} completion tokens ({k} trained): give the engine's "
                         f"log-probability of each completion token, or of each trained one, in order")
    return [nan if x is None or not t else float(x) for x, t in zip(out, trained)]


def replay_array(value, field: str, ids: list[int], cfg, what: str) -> torch.Tensor:
    """A completion's `field` ("routing" | "indexer") as a LongTensor [len(ids) - 1, slots, k]: one entry per
    position of prompt + completion but the last (a record of len(ids) rows: its last row dropped), integral
    numbers as integers, no id repeated within a position and layer, checked against the model of `cfg`
    (`replay.check_replay`: shapes, expert ids, key positions) when given."""
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    fractional = t is not None and t.is_floating_point() and not bool((t == t.round()).all())
    if t is None or t.ndim != 3 or t.dtype == torch.bool or fractional:
        raise ValueError(f"{what}: {field!r} must be a list (one per position) of lists (one per layer) of integer "
                         f"lists, found {json.dumps(value)[:60]}")
    t = t.long()
    if t.shape[0] == len(ids):
        t = t[:-1]
    if t.shape[0] != len(ids) - 1:
        raise ValueError(f"{what}: {field!r} has {t.shape[0]} positions, expected {len(ids) - 1} (every position of "
                         f"prompt + completion but the last)")
    if cfg is not None:
        whole = torch.cat([t, t.new_full((1, *t.shape[1:]), -1)])  # the last position has no record
        try:
            check_replay({"input_ids": torch.tensor(ids), field: whole}, cfg)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    ordered = t.sort(-1).values
    repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1)
    if bool(repeated.any()):
        pos, layer = repeated.nonzero()[0].tolist()
        raise ValueError(f"{what}: {field!r} repeats {'an expert id' if field == 'routing' else 'a key'} at position "
                         f"{pos}, layer slot {layer} ({t[pos, layer].tolist()}): a top-k record names each once")
    return t


def _cut(c: dict, what: str) -> bool:
    """Whether the engine cut the completion ("finish_reason": "length" or "truncated": true)."""
    reason, flag = c.get("finish_reason"), c.get("truncated", False)
    if reason is not None and reason not in FINISH_REASONS:
        raise ValueError(f"{what}: 'finish_reason' {json.dumps(reason)} is none of {', '.join(FINISH_REASONS)} (an "
                         f"aborted sample is not trained); fix or remove the completion")
    if not isinstance(flag, bool):
        raise ValueError(f"{what}: 'truncated' must be true or false, found {json.dumps(flag)}")
    return flag or bool(FINISH_REASONS.get(reason))


def completion_of(c, what: str, rec: dict, prompt: list[int], tok, fmt=None, cfg=None,
                  options: ReadOptions = ReadOptions()) -> Completion:
    """The Completion of one completion object `c` of a record (see the module docstring)."""
    if not isinstance(c, dict):
        raise ValueError(f"{what}: expected a JSON object, found {type(c).__name__}")
    unread = [k for k in c if k not in COMPLETION_FIELDS]
    if unread:
        raise ValueError(f"{what}: field(s) {', '.join(map(repr, unread))} glm5f does not read (a completion holds "
                         f"{', '.join(COMPLETION_FIELDS)}); remove them or write what they say in those")
    forms = [k for k in ("text", "ids", "messages") if k in c]
    if len(forms) != 1 or (forms == ["text"] and not isinstance(c["text"], str)):
        found = f"both {forms[0]!r} and {forms[1]!r}" if len(forms) > 1 else f"keys {sorted(c)}"
        raise ValueError(f"{what} needs one of 'text' (a string), 'ids' (token ids) or 'messages' (turns); found "
                         f"{found}")
    if "loss_mask" in c and forms != ["ids"]:
        raise ValueError(f"{what}: 'loss_mask' marks token ids: give it with 'ids', not with {forms[0]!r}")
    cut, added = _cut(c, what), 0
    if "messages" in c:
        if "logprobs" in c:
            raise ValueError(f"{what}: 'logprobs' need the tokens they were taken on: give the trajectory as 'ids' "
                             f"with a 'loss_mask' instead of 'messages'")
        ex = trajectory_example(rec, prompt, c["messages"], what, fmt)
    elif "ids" in c:
        ids = _ids(c["ids"], "'ids'", what)
        mask = _mask(c.get("loss_mask"), len(ids), what)
        ex = Example(prompt + ids, [IGNORE_INDEX] * len(prompt) + [t if m else IGNORE_INDEX for t, m in zip(ids, mask)])
    else:
        ex, added = completion_example(rec, prompt, c["text"], what, tok, fmt, cut)
    trained = [int(t != IGNORE_INDEX) for t in ex.labels[len(prompt):]]
    if not ex.ids[len(prompt):]:
        raise ValueError(f"{what} has no tokens; remove it or its group")
    if not any(trained):
        raise ValueError(f"{what}: no token is trained (its 'loss_mask' is all 0); remove it or its group")
    reward = c.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{what}: 'reward' must be a finite number, found {json.dumps(reward)}")
    logprobs = None if c.get("logprobs") is None else rollout_logprobs(c["logprobs"], trained, added, what)
    replay = {f: replay_array(c[f], f, ex.ids, cfg, what) for f in REPLAY_KEYS if f in c}
    if cut and options.mask_truncated:
        ex = Example(ex.ids, [IGNORE_INDEX] * len(ex.ids))
    return Completion(ex, float(reward), logprobs, replay, cut, len(prompt), what)


def group_of(rec, where: str, tok, fmt=None, cfg=None, options: ReadOptions = ReadOptions()) -> Group:
    """The Group of one record (see the module docstring)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    misplaced = [k for k in NOT_ON_RECORD if k in rec]
    if misplaced:
        raise ValueError(f"{where}: field(s) {', '.join(map(repr, misplaced))} on the record: a completion's fields "
                         f"go in its object under 'completions', and glm5f reads no other such field; move or remove "
                         f"them")
    rec = chat_prompt(rec, where)
    if "completions" not in rec and engines.formats_of(rec):
        raise ValueError(f"{where}: a glm5f record needs 'completions'; this one has the fields of a "
                         f"{' or '.join(engines.formats_of(rec))} sample: pass --data.format")
    prompt = prompt_ids(rec, where, tok, fmt)
    completions = rec.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        found = f"{len(completions)}" if isinstance(completions, list) else json.dumps(completions)[:40]
        raise ValueError(f"{where}: 'completions' must list at least 2 completions of the prompt (a group's "
                         f"advantages compare them), found {found}")
    return Group(tuple(completion_of(c, f"{where}: completion {i}", rec, prompt, tok, fmt, cfg, options)
                       for i, c in enumerate(completions)), where,
                 {k: v for k, v in rec.items() if k != "completions"})


def read_groups(path: str, tok, fmt=None, cfg=None, options: ReadOptions = ReadOptions()) -> list[Group]:
    """Every group of a JSONL file (blank lines skipped) in `options.format` (glm5f's records, or an engine's
    samples: `engines.ENGINES`); a ValueError naming file:line for a bad record. `cfg`: the model's config, which
    replay records are checked against (`replay.check_replay`)."""
    if options.format not in engines.FORMATS:
        raise ValueError(f"--data.format {options.format!r} is unknown; choose one of {', '.join(engines.FORMATS)}")
    if options.format == "glm5f":
        groups = [group_of(rec, where, tok, fmt, cfg, options) for where, rec in file_records(path, "rollout groups")]
    else:
        groups = [Group(tuple(completion_of(c, where, {"prompt_ids": p}, p, tok, fmt, cfg, options)
                              for where, p, c in members), first, {})
                  for first, members in engines.engine_groups(path, options.format, options.group_key)]
    row = engines.ENGINES.get(options.format)
    for g in groups:
        if len(g.completions) != len(groups[0].completions):
            raise ValueError(f"{g.where}: {len(g.completions)} completions, but {groups[0].where} has "
                             f"{len(groups[0].completions)}: every group of a file has the same size")
    # --rl.replay on a file that holds none of a record is refused; a completion without it routes itself (a file
    # may replay some groups' choices and not others')
    lacking = [f for f in options.replay if not any(f in c.replay for g in groups for c in g.completions)]
    if lacking and groups:
        named = [f"{f!r}" + (f" ({options.format}: {getattr(row, f) or 'writes none'})" if row else "")
                 for f in lacking]
        first = groups[0].completions[0]
        raise ValueError(f"{first.where or groups[0].where}: no {' or '.join(named)} record, but --rl.replay "
                         f"{','.join(lacking)} replays it; record it when sampling, or drop --rl.replay")
    return groups


def file_group_size(path: str, options: ReadOptions = ReadOptions()) -> int | None:
    """The number of completions in the first group of a rollouts file or folder (every group has as many), None
    when the file or its first record cannot be read (the run's reader says why)."""
    if options.format in engines.ENGINES:
        return engines.engine_group_size(path, options.format, options.group_key)
    try:
        return len(next(file_records(path, "rollout groups"))[1]["completions"])
    except (OSError, ImportError, StopIteration, ValueError, KeyError, TypeError):
        return None


def rollout_batch(groups: list[Group], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One completion per row (prompt, completion, then padding with positions of its own, never scored), the
    groups in order: "input_ids", "labels", "position_ids" [R, S]; "rollout_logprobs" [R, S] (fp64: the engine's
    log-probability at each label, NaN where it gave none); "reward" [R] (fp64) and "group" [R] (the group's
    index in the batch); each replay field the completions carry, [R, S, slots, k] (-1 where none); "valid" [R, S]
    (0 on padding: the MoE load counts skip it); per row "tokens_computed" and "tokens_unshared" [R] (its
    sequence's tokens; a tree batch, `rollout_trees.tree_rows`, computes fewer)."""
    rows = [(c, gi) for gi, g in enumerate(groups) for c in g.completions]
    R, S = len(rows), seq_len
    out = {"input_ids": torch.full((R, S), pad_id), "labels": torch.full((R, S), IGNORE_INDEX),
           "position_ids": torch.empty(R, S, dtype=torch.long),
           "rollout_logprobs": torch.full((R, S), math.nan, dtype=torch.float64),
           "reward": torch.tensor([c.reward for c, _ in rows], dtype=torch.float64),
           "group": torch.tensor([gi for _, gi in rows]), "valid": torch.zeros(R, S, dtype=torch.long)}
    for r, (c, _) in enumerate(rows):
        ids = c.example.ids
        n = len(ids)
        out["input_ids"][r, :n] = torch.tensor(ids)
        out["labels"][r, 1:n] = torch.tensor(c.example.labels[1:])  # the first token is not predicted
        out["position_ids"][r] = torch.cat([torch.arange(n), torch.arange(S - n)])
        out["valid"][r, :n] = 1
        if c.logprobs is not None:
            out["rollout_logprobs"][r, n - len(c.logprobs):n] = torch.tensor(c.logprobs, dtype=torch.float64)
    for f in REPLAY_KEYS:
        have = [c.replay[f] for c, _ in rows if f in c.replay]
        if not have:
            continue
        t = torch.full((R, S, *have[0].shape[1:]), -1, dtype=torch.long)
        for r, (c, _) in enumerate(rows):
            if f in c.replay:
                t[r, :len(c.replay[f])] = c.replay[f]
        out[f] = t
    out["tokens_computed"] = out["tokens_unshared"] = out["valid"].sum(1)
    return out


def overlong(c: Completion, what: str, seq_len: int) -> str | None:
    """Why prompt + completion `c` (read at its own where, else `what`) do not fit --data.seq_len (a prompt that
    leaves no room called a prompt); None when they fit."""
    n, p, what = len(c.example.ids), c.prompt_len or 0, c.where or what
    if p >= seq_len:
        return (f"{what.split(': completion ')[0]}: the prompt has {p} tokens, leaving no room for a completion in "
                f"--data.seq_len {seq_len}; raise it or shorten the prompt")
    if n > seq_len:
        return f"{what}: {n - p} tokens after a prompt of {p} do not fit --data.seq_len {seq_len}; raise it"
    return None


def check_completion(c: Completion, what: str, seq_len: int, vocab_size: int) -> None:
    """A ValueError naming where `c` was read (else `what`) when prompt + completion do not fit --data.seq_len
    (`overlong`) or hold a token id outside the vocabulary."""
    why = overlong(c, what, seq_len)
    if why is not None:
        raise ValueError(why)
    p, what = c.prompt_len or 0, c.where or what
    loc = what.split(": completion ")[0]
    bad = next((j for j, t in enumerate(c.example.ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        part = "the prompt" if bad < p else (what[len(loc) + 2:] or "the completion")
        raise ValueError(f"{loc}: {part} has token id {c.example.ids[bad]} (position {bad}) outside [0, "
                         f"vocab_size={vocab_size}): the tokenizer or the data does not fit the model's vocabulary")


def group_overlong(g: Group, seq_len: int) -> str | None:
    """Why group `g` does not fit --data.seq_len: its first completion that does not (`overlong`); None if all do."""
    return next((why for i, c in enumerate(g.completions)
                 if (why := overlong(c, f"{g.where}: completion {i}", seq_len)) is not None), None)


class RolloutSource:
    """--data.batch_size groups per batch (`rollout_batch`), in a seeded per-epoch order of the file's groups; a group
    with a completion longer than --data.seq_len refuses the source, or with `skip_overlong` is left out (`skipped`:
    `overlong.Skipped`, None when none was); with `share_prefixes`, batches as tree rows (`rollout_trees.tree_rows`,
    carrying the records of `replayed`)."""

    def __init__(self, groups: list[Group], batch_size: int, seq_len: int, vocab_size: int, seed: int, pad_id: int,
                 name: str = "rollouts", skip_overlong: bool = False, share_prefixes: bool = False,
                 replayed: tuple[str, ...] = ()):
        groups, self.skipped = fitting(groups, lambda g: group_overlong(g, seq_len), lambda g: g.where, skip_overlong,
                                       "groups", name, seq_len)
        for g in groups:
            for i, c in enumerate(g.completions):
                check_completion(c, f"{g.where}: completion {i}", seq_len, vocab_size)
        self.groups, self.B, self.S, self.seed, self.pad_id = groups, batch_size, seq_len, seed, pad_id
        self.share_prefixes, self.replayed = share_prefixes, replayed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.groups), generator=g).tolist()

    def _next_group(self) -> Group:
        g = self.groups[self._order[self.index]]
        self.index += 1
        if self.index == len(self.groups):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        return g

    def next_batch(self) -> dict[str, torch.Tensor]:
        batch = rollout_batch([self._next_group() for _ in range(self.B)], self.S, self.pad_id)
        return tree_rows(batch, self.S, self.pad_id, self.replayed) if self.share_prefixes else batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)

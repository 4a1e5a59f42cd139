"""Rollouts (`--data.type rollouts`): JSONL records of a prompt with a group of its sampled completions, each with its
reward (and what the engine kept of how it sampled), read into memory and served one completion per row, a batch
holding whole groups, for the GRPO objective.

Record: {"prompt": str | "messages": [...] | "prompt_ids": [int], "completions": [{"text": str | "ids": [int],
"reward": float, "logprobs"?: [float: the engine's log-probability of each completion token], "routing"?: [per
position of prompt + completion but the last: per MoE layer: its top-k expert ids], "indexer"?: [per such position:
per indexed DSA layer: the key positions (GLM-5.3: pools) it selected, -1 filling unused slots]}, ...]}. A text
completion is followed by eos (a chat's by the template's stop token, as SFT trains it); token ids are scored as
given. Every group of a file has the same number of completions, at least 2: a group's advantages compare them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from glm5f.data.readers import jsonl_records
from glm5f.core.replay import REPLAY_KEYS, check_replay
from glm5f.data.tokens import IGNORE_INDEX, Example, check_vocab



@dataclass(frozen=True)
class Completion:
    example: Example  # prompt + completion; labels on the completion's tokens
    reward: float
    logprobs: list[float] | None  # the engine's log-probability of each completion token
    replay: dict  # field ("routing", "indexer") -> LongTensor [len(ids) - 1, slots, k]


@dataclass(frozen=True)
class Group:
    completions: tuple[Completion, ...]
    where: str
    prompt: dict  # the record's prompt fields and any other fields it has ("completions" aside)


def _ids(value, what: str, where: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{where}: {what} must be a list of integer token ids, found {json.dumps(value)[:40]}")
    return value


def prompt_ids(rec: dict, where: str, tok, fmt=None) -> list[int]:
    """A record's prompt as token ids: "prompt_ids" as given, "prompt" text (bos first) or "messages" rendered with
    the run's template up to the assistant's turn (its generation prompt)."""
    if "prompt_ids" in rec:
        return _ids(rec["prompt_ids"], "prompt_ids", where)
    if "messages" in rec:
        if fmt is None:
            raise ValueError(f"{where}: a chat record ('messages'), but no chat template was given to render it")
        if not isinstance(rec["messages"], list):
            raise ValueError(f"{where}: 'messages' must be a list of messages, found {json.dumps(rec['messages'])[:40]}")
        try:
            return fmt.ids(rec["messages"], add_generation_prompt=True)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{where}: field 'prompt' must be a string, found {json.dumps(rec['prompt'])[:40]}")
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(rec["prompt"])
    raise ValueError(f"{where}: a record needs 'prompt', 'messages' or 'prompt_ids'; found keys {sorted(rec)}")


def completion_example(rec: dict, prompt: list[int], completion, what: str, tok, fmt=None) -> Example:
    """prompt + completion as an Example, labels on the completion: token ids as given; text followed by eos, or
    in a chat record rendered as the assistant's answer (its stop token scored, as SFT trains it)."""
    if isinstance(completion, list):
        ids = _ids(completion, "'ids'", what)
    elif "messages" in rec:
        full = fmt.example(rec["messages"] + [{"role": "assistant", "content": completion}], train_on="last")
        if full.ids[:len(prompt)] != prompt:
            raise ValueError(f"{what}: the template renders the conversation with the answer differently from its "
                             f"generation prompt; give the completion as 'ids'")
        ids = full.ids[len(prompt):]
    else:
        ids = tok.encode(completion) + ([tok.eos_id] if tok.eos_id is not None else [])
    if not ids:
        raise ValueError(f"{what} has no tokens; remove it or its group")
    return Example(prompt + ids, [IGNORE_INDEX] * len(prompt) + ids)


def replay_array(value, field: str, ids: list[int], cfg, what: str) -> torch.Tensor:
    """A completion's `field` ("routing" | "indexer") as a LongTensor [len(ids) - 1, slots, k]: one entry per
    position of prompt + completion but the last, checked against the model of `cfg` (`replay.check_replay`:
    shapes, expert ids, key positions) when given."""
    try:
        t = torch.tensor(value, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.ndim != 3:
        raise ValueError(f"{what}: {field!r} must be a list (one per position) of lists (one per layer) of integer "
                         f"lists, found {json.dumps(value)[:60]}")
    if t.shape[0] != len(ids) - 1:
        raise ValueError(f"{what}: {field!r} has {t.shape[0]} positions, expected {len(ids) - 1} (every position of "
                         f"prompt + completion but the last)")
    if cfg is not None:
        whole = torch.cat([t, t.new_full((1, *t.shape[1:]), -1)])  # the last position has no record
        try:
            check_replay({"input_ids": torch.tensor(ids), field: whole}, cfg)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return t


def completion_of(c, i: int, rec: dict, prompt: list[int], where: str, tok, fmt=None, cfg=None) -> Completion:
    what = f"{where}: completion {i}"
    if not isinstance(c, dict):
        raise ValueError(f"{what}: expected a JSON object, found {type(c).__name__}")
    if "ids" in c:
        ex = completion_example(rec, prompt, c["ids"], what, tok, fmt)
    elif isinstance(c.get("text"), str):
        ex = completion_example(rec, prompt, c["text"], what, tok, fmt)
    else:
        raise ValueError(f"{what} needs 'text' (a string) or 'ids' (token ids); found keys {sorted(c)}")
    reward = c.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{what}: 'reward' must be a finite number, found {json.dumps(reward)}")
    n = len(ex.ids) - len(prompt)
    logprobs = c.get("logprobs")
    if logprobs is not None:
        if not (isinstance(logprobs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   and math.isfinite(x) and x <= 0 for x in logprobs)):
            raise ValueError(f"{what}: 'logprobs' must be a list of finite log-probabilities (<= 0), found "
                             f"{json.dumps(logprobs)[:60]}")
        if len(logprobs) != n:
            raise ValueError(f"{what}: {len(logprobs)} logprobs for {n} completion tokens; give the engine's "
                             f"log-probability of each completion token, in order")
    replay = {f: replay_array(c[f], f, ex.ids, cfg, what) for f in REPLAY_KEYS if f in c}
    return Completion(ex, float(reward), None if logprobs is None else [float(x) for x in logprobs], replay)


def group_of(rec, where: str, tok, fmt=None, cfg=None) -> Group:
    """The Group of one record (see the module docstring)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    prompt = prompt_ids(rec, where, tok, fmt)
    completions = rec.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        found = f"{len(completions)}" if isinstance(completions, list) else json.dumps(completions)[:40]
        raise ValueError(f"{where}: 'completions' must list at least 2 completions of the prompt (a group's "
                         f"advantages compare them), found {found}")
    return Group(tuple(completion_of(c, i, rec, prompt, where, tok, fmt, cfg)
                       for i, c in enumerate(completions)), where,
                 {k: v for k, v in rec.items() if k != "completions"})


def read_groups(path: str, tok, fmt=None, cfg=None) -> list[Group]:
    """Every group of a JSONL file (blank lines skipped); a ValueError naming file:line for a bad record. `cfg`:
    the model's config, which replay records are checked against (`replay.check_replay`)."""
    groups = []
    for where, rec in jsonl_records(path, "rollout groups"):
        groups.append(group_of(rec, where, tok, fmt, cfg))
        if len(groups[-1].completions) != len(groups[0].completions):
            raise ValueError(f"{where}: {len(groups[-1].completions)} completions, but {groups[0].where} has "
                             f"{len(groups[0].completions)}: every group of a file has the same size")
    return groups


def file_group_size(path: str) -> int | None:
    """The number of completions in the first group of a rollouts file (every group has as many), None when the
    file or its first record cannot be read (the run's reader says why)."""
    try:
        with open(path, "rb") as f:
            first = next(line for line in f if line.strip())
        return len(json.loads(first)["completions"])
    except (OSError, StopIteration, ValueError, KeyError, TypeError):
        return None


def rollout_batch(groups: list[Group], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One completion per row (prompt, completion, then padding with positions of its own, never scored), the
    groups in order: "input_ids", "labels", "position_ids" [R, S]; "rollout_logprobs" [R, S] (fp64: the engine's
    log-probability at each label, NaN where it gave none); "reward" [R] (fp64) and "group" [R] (the group's
    index in the batch); each replay field the completions carry, [R, S, slots, k] (-1 where none)."""
    rows = [(c, gi) for gi, g in enumerate(groups) for c in g.completions]
    R, S = len(rows), seq_len
    out = {"input_ids": torch.full((R, S), pad_id), "labels": torch.full((R, S), IGNORE_INDEX),
           "position_ids": torch.empty(R, S, dtype=torch.long),
           "rollout_logprobs": torch.full((R, S), math.nan, dtype=torch.float64),
           "reward": torch.tensor([c.reward for c, _ in rows], dtype=torch.float64),
           "group": torch.tensor([gi for _, gi in rows])}
    for r, (c, _) in enumerate(rows):
        ids = c.example.ids
        n = len(ids)
        out["input_ids"][r, :n] = torch.tensor(ids)
        out["labels"][r, 1:n] = torch.tensor(c.example.labels[1:])  # the first token is not predicted
        out["position_ids"][r] = torch.cat([torch.arange(n), torch.arange(S - n)])
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
    return out


class RolloutSource:
    """--data.batch_size groups per batch (`rollout_batch`), in a seeded per-epoch order of the file's groups."""

    def __init__(self, groups: list[Group], batch_size: int, seq_len: int, vocab_size: int, seed: int, pad_id: int,
                 name: str = "rollouts"):
        for g in groups:
            for c in g.completions:
                if len(c.example.ids) > seq_len:
                    raise ValueError(f"{g.where}: a completion of {len(c.example.ids)} tokens with its prompt does "
                                     f"not fit --data.seq_len {seq_len}; raise it")
        check_vocab([c.example for g in groups for c in g.completions], vocab_size, name)
        self.groups, self.B, self.S, self.seed, self.pad_id = groups, batch_size, seq_len, seed, pad_id
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
        return rollout_batch([self._next_group() for _ in range(self.B)], self.S, self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)

"""Rollouts (`--data.type rollouts`): JSONL records of a prompt and a group of its sampled completions, each with
its reward (and, when the engine kept them, its log-probabilities), read into memory and served one completion per
row, a batch holding whole groups, for the GRPO objective.

Record: {"prompt": str | "messages": [...] | "prompt_ids": [int], "completions": [{"text": str | "ids": [int],
"reward": float, "logprobs"?: [float, one per completion token]}, ...]}. Every group of a file has the same number
of completions (at least 2: a group's advantages compare its completions).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from glm5f.tokens import IGNORE_INDEX, Example, check_vocab


@dataclass(frozen=True)
class Completion:
    example: Example  # prompt + completion; labels on the completion's tokens
    reward: float
    logprobs: list[float] | None  # the engine's log-probability of each completion token


@dataclass(frozen=True)
class Group:
    completions: tuple[Completion, ...]
    where: str


def _ids(value, what: str, where: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{where}: {what} must be a list of integer token ids, found {json.dumps(value)[:40]}")
    return value


def prompt_ids(rec: dict, where: str, tok, fmt=None) -> list[int]:
    """The prompt's token ids: given, the text's (bos first), or the conversation rendered with the run's template
    up to the assistant's turn."""
    if "prompt_ids" in rec:
        return _ids(rec["prompt_ids"], "prompt_ids", where)
    if "messages" in rec:
        if fmt is None:
            raise ValueError(f"{where}: a chat record ('messages'), but no chat template was given to render it")
        try:
            return fmt.ids(rec["messages"], add_generation_prompt=True)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{where}: field 'prompt' must be a string, found {json.dumps(rec['prompt'])[:40]}")
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(rec["prompt"])
    raise ValueError(f"{where}: a record needs 'prompt', 'messages' or 'prompt_ids', found keys {sorted(rec)}")


def completion_of(c, i: int, prompt: list[int], where: str, tok) -> Completion:
    what = f"{where}: completion {i}"
    if not isinstance(c, dict):
        raise ValueError(f"{what}: expected a JSON object, found {type(c).__name__}")
    if "ids" in c:
        ids = _ids(c["ids"], f"completion {i}'s ids", where)
    elif isinstance(c.get("text"), str):
        ids = tok.encode(c["text"]) + ([tok.eos_id] if tok.eos_id is not None else [])
    else:
        raise ValueError(f"{what} needs 'text' (a string) or 'ids' (token ids), found keys {sorted(c)}")
    if not ids:
        raise ValueError(f"{what} has no tokens; remove it or its group")
    reward = c.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{what}: 'reward' must be a finite number, found {json.dumps(reward)}")
    logprobs = c.get("logprobs")
    if logprobs is not None:
        if not (isinstance(logprobs, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   and math.isfinite(x) and x <= 0 for x in logprobs)):
            raise ValueError(f"{what}: 'logprobs' must be a list of finite log-probabilities (<= 0)")
        if len(logprobs) != len(ids):
            raise ValueError(f"{what}: {len(logprobs)} logprobs for {len(ids)} completion tokens; the engine's "
                             f"log-probability of each completion token, in order")
    return Completion(Example(prompt + ids, [IGNORE_INDEX] * len(prompt) + ids), float(reward), logprobs)


def group_of(rec, where: str, tok, fmt=None) -> Group:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    prompt = prompt_ids(rec, where, tok, fmt)
    completions = rec.get("completions")
    if not isinstance(completions, list) or len(completions) < 2:
        found = len(completions) if isinstance(completions, list) else json.dumps(completions)[:40]
        raise ValueError(f"{where}: 'completions' must list at least 2 completions of the prompt (a group's "
                         f"advantages compare them), found {found}")
    return Group(tuple(completion_of(c, i, prompt, where, tok) for i, c in enumerate(completions)), where)


def read_groups(path: str, tok, fmt=None) -> list[Group]:
    """Every group of a JSONL file (blank lines skipped); a ValueError naming file:line for a bad record."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data.path {path!r}: no such file (expected a JSONL file of rollout groups)")
    groups = []
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line}"
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            groups.append(group_of(rec, where, tok, fmt))
            if len(groups[-1].completions) != len(groups[0].completions):
                raise ValueError(f"{where}: {len(groups[-1].completions)} completions, but {groups[0].where} has "
                                 f"{len(groups[0].completions)}: every group of a file has the same size")
    if not groups:
        raise ValueError(f"{path}: no rollout records")
    return groups


class RolloutSource:
    """--data.batch_size groups per batch in a seeded per-epoch order, one completion per row (prompt, completion,
    then padding positions of their own, never scored). A batch holds "input_ids", "labels", "position_ids",
    "rollout_logprobs" [R, S] (the engine's log-probability at each label, NaN where it gave none) and "reward",
    "group" [R] (the group's index in the batch)."""

    def __init__(self, groups: list[Group], batch_size: int, seq_len: int, vocab_size: int, seed: int, pad_id: int):
        for g in groups:
            for c in g.completions:
                if len(c.example.ids) > seq_len:
                    raise ValueError(f"{g.where}: a completion of {len(c.example.ids)} tokens with its prompt does not "
                                     f"fit --data.seq_len {seq_len}; raise it")
        check_vocab([c.example for g in groups for c in g.completions], vocab_size, "rollouts")
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

    def _row(self, c: Completion):
        ids, labels = c.example.ids, [IGNORE_INDEX] + c.example.labels[1:]
        lp = [math.nan] * len(ids)
        if c.logprobs is not None:
            lp[len(ids) - len(c.logprobs):] = c.logprobs
        pad = self.S - len(ids)
        return (ids + [self.pad_id] * pad, labels + [IGNORE_INDEX] * pad, list(range(len(ids))) + list(range(pad)),
                lp + [math.nan] * pad)

    def next_batch(self) -> dict[str, torch.Tensor]:
        groups = [self._next_group() for _ in range(self.B)]
        rows = [(self._row(c), c.reward, gi) for gi, g in enumerate(groups) for c in g.completions]
        out = {name: torch.tensor([r[0][i] for r in rows]) for i, name in
               enumerate(("input_ids", "labels", "position_ids"))}
        out["rollout_logprobs"] = torch.tensor([r[0][3] for r in rows], dtype=torch.float64)
        out["reward"] = torch.tensor([r[1] for r in rows], dtype=torch.float64)
        out["group"] = torch.tensor([r[2] for r in rows])
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)

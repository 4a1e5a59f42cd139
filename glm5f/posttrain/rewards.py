"""Reward functions of the on-policy sampler as users write them (glm5f's keywords, TRL's lists, verl's compute_score),
several with weights and called on a thread pool (`Rewards`); and the toy task's reward (recipes/grpo-tiny.yaml).
"""

from __future__ import annotations

import inspect
import math
import numbers
import string
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

FORM_MARKS = {"glm5f": "completion", "trl": "completions", "verl": "solution_str"}  # the parameter naming each form
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def lowercase_share(*, completion: str, completion_ids: list[int], **fields) -> float:
    """The share of the completion's tokens (its stop token included) that are lowercase ASCII letters in its text:
    0 for an untrained model's almost-uniform tokens, 1 for a completion of letters only, which never stops."""
    return sum(ch in string.ascii_lowercase for ch in completion) / max(len(completion_ids), 1)


def form_of(fn: Callable, flag: str) -> str:
    """How `fn` is called, by the names of its parameters (`inspect.signature`):

    - "verl" when it names `solution_str`: verl's compute_score, per completion, with those of data_source,
      solution_str (the completion's text), ground_truth (the record's reward_model.ground_truth, else its
      ground_truth) and extra_info (the record's, else None) it names (all four when it takes **kwargs); it returns
      a number or a dict whose "score" is one.
    - "trl" when it names `completions`: TRL's batched form, once per group, with lists of one entry per
      completion: prompts (the record's messages for a chat record, else its prompt text), completions (a chat
      record's [{"role": "assistant", "content": text}], else the text), completion_ids, and each of the record's
      other fields; it returns a list of numbers, one per completion.
    - "glm5f" when it names `completion`, or none of these three but takes **kwargs: per completion, with prompt
      (text), completion (text), prompt_ids, completion_ids, messages (a chat record's, only for one) and the
      record's other fields; it returns a number.

    A function naming two of completion, completions and solution_str is ambiguous, and one naming none without
    **kwargs takes none of the arguments: both are refused with a ValueError naming `flag`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): called as glm5f's form
        return "glm5f"
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    found = [form for form, mark in FORM_MARKS.items() if mark in names]
    if len(found) > 1:
        raise ValueError(f"{flag}: its parameters name {' and '.join(FORM_MARKS[f] for f in found)}, the arguments of "
                         f"{' and '.join(found)} reward functions; name one of completion (glm5f, one completion), "
                         f"completions (TRL, a group's lists) or solution_str (verl's compute_score)")
    if found:
        return found[0]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return "glm5f"
    raise ValueError(f"{flag}: it takes none of a reward function's arguments (parameters {sorted(names)}); name "
                     f"completion (glm5f), completions (TRL) or solution_str (verl's compute_score), or take **kwargs")


@dataclass(frozen=True)
class RewardFn:
    """One reward function of the run: the function, its `form_of`, its weight in the total, the name its mean is
    logged under (rewards/NAME/mean) and the flag naming it in errors."""

    fn: Callable
    form: str
    weight: float
    name: str
    flag: str


def checked(r, where: str, flag: str) -> float:
    """`r` as a float; a ValueError naming the record when it is no finite number (a bool is not one)."""
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
        raise ValueError(f"{where}: {flag} returned {r!r:.40}; it must return a finite number")
    return float(r)


def verl_arguments(fn: Callable, p, text: str, flag: str) -> dict:
    """verl's compute_score keywords for prompt `p` and completion `text`, those `fn` names (all with **kwargs)."""
    fields = p.fields
    truth = fields.get("reward_model", {}).get("ground_truth") if isinstance(fields.get("reward_model"), dict) \
        else None
    truth = fields.get("ground_truth") if truth is None else truth
    params = inspect.signature(fn).parameters
    wanted = VERL_ARGS if any(q.kind is q.VAR_KEYWORD for q in params.values()) else \
        [a for a in VERL_ARGS if a in params]
    if "ground_truth" in wanted and truth is None and params.get("ground_truth", None) is not None and \
            params["ground_truth"].default is inspect.Parameter.empty:
        raise ValueError(f"{p.where}: {flag} (verl's compute_score) reads ground_truth, and the record has neither "
                         f"reward_model.ground_truth nor ground_truth; add one")
    values = {"data_source": fields.get("data_source"), "solution_str": text, "ground_truth": truth,
              "extra_info": fields.get("extra_info")}
    return {a: values[a] for a in wanted}


def call_one(f: RewardFn, p, texts: list[str], ids: list[list[int]], j: int | None) -> float | list[float]:
    """f's reward of completion j of prompt `p`'s group (texts, ids), or with j None (TRL's form) the group's list;
    a ValueError naming the prompt record when the function raises or returns what is not a reward."""
    if f.form == "trl":
        n, chat = len(texts), p.messages is not None
        kwargs = dict(prompts=[p.messages if chat else p.text] * n,
                      completions=[[{"role": "assistant", "content": t}] if chat else t for t in texts],
                      completion_ids=[list(i) for i in ids], **{k: [v] * n for k, v in p.fields.items()})
    elif f.form == "verl":
        kwargs = verl_arguments(f.fn, p, texts[j], f.flag)
    else:
        kwargs = dict(prompt=p.text, completion=texts[j], prompt_ids=list(p.ids), completion_ids=list(ids[j]),
                      **({"messages": p.messages} if p.messages is not None else {}), **p.fields)
    try:
        r = f.fn(**kwargs)
    except Exception as e:  # the user's code: any exception is theirs to see
        raise ValueError(f"{p.where}: {f.flag} raised {type(e).__name__}: {e}") from None
    if f.form == "verl" and isinstance(r, dict) and "score" in r:
        r = r["score"]
    if j is not None:
        return checked(r, p.where, f.flag)
    if not isinstance(r, (list, tuple)) or len(r) != len(texts):
        got = f"{len(r)} rewards" if isinstance(r, (list, tuple)) else f"{r!r:.40}"
        raise ValueError(f"{p.where}: {f.flag} returned {got} for the group's {len(texts)} completions; TRL's form "
                         f"returns a list of one number per completion")
    return [checked(x, p.where, f.flag) for x in r]


class Rewards:
    """The run's reward: each completion's weighted sum of its functions' rewards (sum of weight x reward, as TRL's
    reward_weights), the functions called on `workers` threads (1: in this thread), one call per completion (TRL's
    form: per group), the results in the calls' order whatever the order they finish in; the first failing call in
    that order names its record."""

    def __init__(self, fns: list[RewardFn], workers: int = 1):
        self.fns, self.workers = fns, workers

    @classmethod
    def of(cls, fn: Callable, flag: str = "the reward function") -> "Rewards":
        """One function, weight 1."""
        return cls([RewardFn(fn, form_of(fn, flag), 1.0, getattr(fn, "__name__", "reward"), flag)])

    def score(self, groups: list[tuple[object, list[str], list[list[int]]]]
              ) -> tuple[list[list[float]], dict[str, list[list[float]]]]:
        """(each group's completions' totals, {function name: each group's completions' rewards}) of `groups`:
        (prompt, the completions' texts, their ids) each."""
        calls = [(f, g, j) for f in self.fns for g in range(len(groups))
                 for j in ([None] if f.form == "trl" else range(len(groups[g][1])))]
        run = lambda c: call_one(c[0], *groups[c[1]], c[2])  # noqa: E731
        if self.workers > 1:
            with ThreadPoolExecutor(self.workers) as pool:
                results = list(pool.map(run, calls))
        else:
            results = [run(c) for c in calls]
        parts = {f.name: [[0.0] * len(texts) for _, texts, _ in groups] for f in self.fns}
        for (f, g, j), r in zip(calls, results):
            if j is None:
                parts[f.name][g] = list(r)
            else:
                parts[f.name][g][j] = r
        totals = [[sum(f.weight * parts[f.name][g][j] for f in self.fns) for j in range(len(texts))]
                  for g, (_, texts, _) in enumerate(groups)]
        return totals, parts
class LowercaseTurns:
    """The toy environment of recipes/agent-tiny.yaml (`--rl.environment glm5f.posttrain.rewards:LowercaseTurns`):
    after each assistant turn it rewards the share of that turn's text made of lowercase ASCII letters (0 for an
    empty turn) and asks for another, so an episode's reward is the sum over its turns, at most --rl.max_turns. A
    turn that runs out of --rl.max_new_tokens without its stop token ends the episode: the policy earns most by
    writing letters and ending each turn itself."""

    PROMPT = "more"  # the user's message after each turn

    def __init__(self, record: dict):
        self.turns = 0

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float]:
        text = messages[-1].get("content") or ""
        self.turns += 1
        share = sum(ch in string.ascii_lowercase for ch in text) / len(text) if text else 0.0
        return [{"role": "user", "content": self.PROMPT}], False, share

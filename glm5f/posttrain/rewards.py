"""Reward functions shipped with glm5f for the on-policy sampler (`--rl.reward glm5f.posttrain.rewards:NAME`): the toy task of
recipes/grpo-tiny.yaml, and the form a reward function takes (keyword arguments, a float back)."""

from __future__ import annotations

import string


def lowercase_share(*, completion: str, completion_ids: list[int], **fields) -> float:
    """The share of the completion's tokens (its stop token included) that are lowercase ASCII letters in its text:
    0 for an untrained model's almost-uniform tokens, 1 for a completion of letters only, which never stops."""
    return sum(ch in string.ascii_lowercase for ch in completion) / max(len(completion_ids), 1)


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

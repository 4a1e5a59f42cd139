"""Reward functions shipped with glm5f for the on-policy sampler (`--rl.reward glm5f.posttrain.rewards:NAME`): the toy task of
recipes/grpo-tiny.yaml, and the form a reward function takes (keyword arguments, a float back)."""

from __future__ import annotations

import string


def lowercase_share(*, completion: str, completion_ids: list[int], **fields) -> float:
    """The share of the completion's tokens (its stop token included) that are lowercase ASCII letters in its text:
    0 for an untrained model's almost-uniform tokens, 1 for a completion of letters only, which never stops."""
    return sum(ch in string.ascii_lowercase for ch in completion) / max(len(completion_ids), 1)

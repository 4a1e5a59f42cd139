"""Reward functions shipped with glm5f for the on-policy sampler (`--rl.reward glm5f.posttrain.rewards:NAME`): the toy task of
recipes/grpo-tiny.yaml, and the form a reward function takes (keyword arguments, a float back)."""

from __future__ import annotations

import string


def lowercase_share(*, completion: str, completion_ids: list[int], **fields) -> float:
    """The share of the completion's tokens (its stop token included) that are lowercase ASCII letters in its text:
    0 for an untrained model's almost-uniform tokens, 1 for a completion of letters only, which never stops."""
    return sum(ch in string.ascii_lowercase for ch in completion) / max(len(completion_ids), 1)


def checksum(word: str) -> int:
    """The checksum of a word: the sum of its UTF-8 bytes, modulo 100.

    Args:
        word: the word to check.
    """
    return sum(word.encode("utf-8")) % 100


def checksum_answer(*, messages: list[dict], word: str, **fields) -> float:
    """The agent toy task's reward (recipes/agent-tiny.yaml, tool glm5f.posttrain.rewards:checksum): 0.5 when a
    tool result in the episode is the checksum of the record's word (the tool was called with it), 0.5 more when
    the last assistant message's text is that number."""
    want = str(checksum(word))
    called = any(m["role"] == "tool" and m.get("name") == "checksum" and m["content"] == want for m in messages)
    last = [m for m in messages if m["role"] == "assistant"][-1:]
    answered = bool(last) and last[0].get("content", "").strip() == want
    return 0.5 * called + 0.5 * answered

"""Other RL engines' rollout files (`--data.format`): one row per engine naming the fields its samples carry, and the
reading of a sample into glm5f's token-form completion (prompt ids; completion ids, loss_mask, logprobs, replay).

A file holds a sample per line, grouped by a key (`--data.group_key`, default the engine's; a dotted path reaches
into an object), or a group per line (a JSON list of samples). Spans are normalised as read: a mask or
log-probabilities over the response or over the whole sequence; log-probabilities for every token or only the
trained ones (null: none); routing and indexer records with a row per position but the last (T - 1) or per
position (T, the last row dropped); booleans and integral floats as integers. Where the engine gives the whole
sequence without a prompt/response split, the prompt is what precedes the first trained token.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import torch

from glm5f.data.files import file_records


@dataclass(frozen=True)
class Engine:
    """Where an engine's sample keeps each thing glm5f reads (None: it has no such field)."""

    prompt: str | None = None  # prompt token ids
    response: str | None = None  # response token ids (after the prompt)
    tokens: str | None = None  # the whole sequence's token ids
    response_length: str | None = None  # with `tokens`: how many of them are the response
    messages: str | None = None  # a message log whose messages carry their own token ids (`message_fields`)
    mask: tuple[str, ...] = ()  # the trained mask (1: the policy generated it), the first present
    logprobs: str | None = None  # the rollout engine's log-probabilities
    reward: str = "reward"  # a number; a list (per-token rewards) is summed
    routing: str | None = None  # per position, per MoE layer: its experts
    indexer: str | None = None  # per position, per DSA layer: its selected keys
    temperatures: str | None = None  # per-token sampling temperatures: the log-probabilities' (1 only)
    group_key: str | None = None  # the default --data.group_key
    cut: tuple[tuple[str, tuple], ...] = ()  # (field, values): the sample was cut by the engine (length)
    refused: tuple[tuple[str, tuple], ...] = ()  # (field, values) a sample glm5f cannot train as written
    message_fields: tuple[str, str, str] = ("token_ids", "token_loss_mask", "generation_logprobs")


# Field names as each engine's own source writes them (docs/posttraining.md: where each was read).
ENGINES = {
    "slime": Engine(tokens="tokens", response_length="response_length", mask=("loss_mask",),
                    logprobs="rollout_log_probs", routing="rollout_routed_experts", indexer="rollout_indexer_topk",
                    group_key="group_index", cut=(("status", ("truncated",)),),
                    refused=(("status", ("aborted", "failed", "pending")), ("remove_sample", (True,)))),
    "verl": Engine(prompt="prompt_ids", response="response_ids", mask=("response_mask",),
                   logprobs="response_logprobs", reward="reward_score", routing="routed_experts", group_key="uid"),
    "skyrl": Engine(prompt="prompt_token_ids", response="response_ids", mask=("loss_masks", "loss_mask"),
                    logprobs="rollout_logprobs", reward="rewards", routing="rollout_expert_indices",
                    group_key="trajectory_ids.instance_id",
                    cut=(("stop_reasons", ("length",)), ("stop_reason", ("length",)))),
    "prime_rl": Engine(tokens="token_ids", mask=("mask",), logprobs="logprobs", routing="routed_experts",
                       temperatures="temperatures"),
    "nemo_rl": Engine(messages="message_log", reward="total_reward", group_key="idx"),
    "trl": Engine(prompt="prompt_ids", response="completion_ids", mask=("env_mask", "tool_mask"), logprobs="logprobs",
                  group_key="prompt"),
}
FORMATS = ("glm5f", *ENGINES)
# Fields that change what a sample trains on and that glm5f does not apply: a sample holding one (not null) is
# refused rather than trained as if it were not there.
UNREAD = ("labels", "advantages", "advantage", "teacher_logprobs", "ref_logprobs", "multi_modal_data",
          "multimodal_inputs", "mm_kwargs", "pixel_values", "images")


def _get(rec: dict, path: str):
    """The value at a dotted path of `rec` (None when absent)."""
    for part in path.split("."):
        if not isinstance(rec, dict) or part not in rec:
            return None
        rec = rec[part]
    return rec


def _ints(value, what: str) -> list[int]:
    """A list of integers (booleans as 0/1, integral floats as integers)."""
    if isinstance(value, list) and all(isinstance(v, (bool, int)) or (isinstance(v, float) and v.is_integer())
                                       for v in value):
        return [int(v) for v in value]
    raise ValueError(f"{what} must be a list of integers, found {json.dumps(value)[:60]}")


def _rows(value, what: str):
    """A replay record as nested lists: prime-rl's {"data": flat list or base64 bytes, "shape", "dtype"} unpacked."""
    if not isinstance(value, dict):
        return value
    dtypes = {"int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
    data, shape = value.get("data"), value.get("shape")
    try:
        if isinstance(data, str):
            t = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=dtypes[value.get("dtype", "int32")])
        else:
            t = torch.tensor(data, dtype=torch.long)
        return t.reshape(shape).tolist()
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"{what} must be {{'data': integers or base64 bytes, 'shape': [T, layers, k], 'dtype': one "
                         f"of {', '.join(dtypes)}}}, found {json.dumps(value)[:60]} ({e})") from None


def _span(value, n_all: int, n_response: int, what: str, field: str) -> list:
    """`value` over the response: given over it, or over the whole sequence (its response part kept)."""
    if not isinstance(value, list):
        raise ValueError(f"{what}: {field!r} must be a list, found {json.dumps(value)[:40]}")
    if len(value) == n_response:
        return value
    if len(value) == n_all:
        return value[n_all - n_response:]
    raise ValueError(f"{what}: {field!r} has {len(value)} entries for {n_response} response tokens ({n_all} with the "
                     f"prompt): give one per response token or one per token of the sequence")


def _message_log(rec: dict, row: Engine, what: str) -> tuple[list[int], list[int], list]:
    """(ids, mask, logprobs) of a message log: each message's token ids, its mask (default: 1 for the assistant's)
    and its log-probabilities (null where none)."""
    log = rec[row.messages]
    ids_f, mask_f, lp_f = row.message_fields
    if not isinstance(log, list) or not all(isinstance(m, dict) and ids_f in m for m in log):
        raise ValueError(f"{what}: {row.messages!r} must be a list of messages each with {ids_f!r}")
    ids, mask, lps = [], [], []
    for i, m in enumerate(log):
        t = _ints(m[ids_f], f"{what}: message {i}: {ids_f!r}")
        ids += t
        mask += _ints(m[mask_f], f"{what}: message {i}: {mask_f!r}") if mask_f in m else \
            [int(m.get("role") == "assistant")] * len(t)
        lp = m.get(lp_f)
        lps += lp if isinstance(lp, list) and len(lp) == len(t) else [None] * len(t)
        if len(mask) != len(ids):
            raise ValueError(f"{what}: message {i} has {len(t)} token ids but a {mask_f!r} of another length")
    return ids, mask, lps


def required(row: Engine) -> list[str]:
    """The fields every sample of `row`'s engine has."""
    return [f for f in (row.prompt, row.response, row.tokens, row.response_length, row.messages, row.reward) if f]


def formats_of(rec) -> list[str]:
    """The engines whose samples have every field `rec` has of theirs (a hint for a record of another format)."""
    return [name for name, row in ENGINES.items() if isinstance(rec, dict) and all(f in rec for f in required(row))]


def sample_completion(rec, row: Engine, name: str, what: str) -> tuple[list[int], dict]:
    """(prompt ids, glm5f token-form completion {"ids", "loss_mask", "reward", "logprobs"?, "truncated",
    "routing"?, "indexer"?}) of one engine sample (see the module docstring); a ValueError naming `what` and the
    fields it lacks when it is no sample of that engine."""
    if not isinstance(rec, dict):
        raise ValueError(f"{what}: expected a JSON object (a {name} sample), found {type(rec).__name__}")
    lacking = [f for f in required(row) if f not in rec]
    if lacking:
        raise ValueError(f"{what}: not a {name} sample: it lacks {', '.join(map(repr, lacking))} (found keys "
                         f"{sorted(rec)[:8]}); pass the --data.format its engine wrote")
    unread = [f for f in UNREAD if rec.get(f) is not None]
    refused = [f"{f}={json.dumps(rec[f])}" for f, values in row.refused if rec.get(f) in values]
    if unread or refused:
        raise ValueError(f"{what}: {', '.join(map(repr, unread)) or ', '.join(refused)}: glm5f does not train "
                         f"such a sample as written (it would be read as if {'that were' if refused else 'they were'} "
                         f"not there); drop {'it' if refused else 'those fields'} or the sample")
    temps = rec.get(row.temperatures) if row.temperatures else None
    if isinstance(temps, list) and any(t != 1 for t in temps):
        raise ValueError(f"{what}: {row.temperatures!r} holds {next(t for t in temps if t != 1)}: its "
                         f"log-probabilities are at that temperature and glm5f's ratio is at temperature 1; sample at "
                         f"temperature 1")
    mask_field = next((f for f in row.mask if rec.get(f) is not None), None)
    if row.messages:
        ids, mask, lps = _message_log(rec, row, what)
    else:
        if row.tokens:
            ids = _ints(rec[row.tokens], f"{what}: {row.tokens!r}")
            n = len(ids)
            if row.response_length:
                n = rec[row.response_length]
                if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= len(ids):
                    raise ValueError(f"{what}: {row.response_length!r} is {json.dumps(n)}, expected 1 .. "
                                     f"{len(ids)} (the number of {row.tokens!r})")
        else:
            ids = _ints(rec[row.prompt], f"{what}: {row.prompt!r}") + _ints(rec[row.response],
                                                                           f"{what}: {row.response!r}")
            n = len(ids) - len(rec[row.prompt])
        if mask_field is None:
            mask = [0] * (len(ids) - n) + [1] * n
        else:
            mask = [0] * (len(ids) - n) + _ints(_span(rec[mask_field], len(ids), n, what, mask_field),
                                                f"{what}: {mask_field!r}")
        lps = None
        if row.logprobs and rec.get(row.logprobs) is not None:
            lp = rec[row.logprobs]
            if isinstance(lp, list) and len(lp) == sum(mask[len(ids) - n:]) != n:  # the trained tokens' only
                lp = iter(lp)
                lp = [next(lp) if m else None for m in mask[len(ids) - n:]]
            lps = [None] * (len(ids) - n) + _span(lp, len(ids), n, what, row.logprobs)
    if not any(mask):
        raise ValueError(f"{what}: its mask ({mask_field or row.messages!r}) trains no token")
    start = mask.index(1) if (row.tokens and not row.response_length) or row.messages else len(ids) - n
    completion = {"ids": ids[start:], "loss_mask": mask[start:],
                  "reward": _reward(rec[row.reward], f"{what}: {row.reward!r}"),
                  "truncated": any(_get(rec, f) in values for f, values in row.cut)}
    if lps is not None:
        completion["logprobs"] = lps[start:]
    for field, src in (("routing", row.routing), ("indexer", row.indexer)):
        if src and rec.get(src) is not None:
            completion[field] = _rows(rec[src], f"{what}: {src!r}")
    return ids[:start], completion


def _reward(value, what: str) -> float:
    """A number, or per-token rewards (their sum: the trajectory's return)."""
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return float(sum(value))
    if isinstance(value, dict):
        raise ValueError(f"{what} is an object ({sorted(value)[:5]}): write the one number the run trains on")
    return value


def engine_groups(path: str, name: str, group_key: str | None):
    """[(where of the group's first sample, [(where, prompt ids, completion)])] of an engine's file, groups in the
    order their first sample appears; a ValueError naming file:line for a bad sample or a key with one sample."""
    row = ENGINES[name]
    key = group_key or row.group_key
    groups: dict = {}
    for where, rec in file_records(path, f"{name} rollout samples"):
        if isinstance(rec, list):  # a group per line
            groups[("line", where)] = [(w, *sample_completion(s, row, name, w))
                                       for w, s in ((f"{where}: sample {i}", s) for i, s in enumerate(rec))]
            continue
        sample = (where, *sample_completion(rec, row, name, where))
        if key is None:
            raise ValueError(f"{where}: a {name} sample per line, but no group key: pass --data.group_key FIELD (the "
                             f"field its group's samples share) or write a group per line (a JSON list of samples)")
        value = _get(rec, key)
        if value is None:
            raise ValueError(f"{where}: the sample has no group key {key!r} (--data.group_key); pass the field its "
                             f"group's samples share, or write a group per line (a JSON list of samples)")
        groups.setdefault(("key", json.dumps(value, sort_keys=True)), []).append(sample)
    for (kind, k), members in groups.items():
        if len(members) < 2:
            what = f"group key {key}={k}" if kind == "key" else "the group"
            raise ValueError(f"{members[0][0] if members else k}: {what} has {len(members)} sample(s); a group's "
                             f"advantages compare at least 2 (check --data.group_key)")
    return [(members[0][0], members) for members in groups.values()]


def engine_group_size(path: str, name: str, group_key: str | None) -> int | None:
    """The size of the first group of an engine's file, None when it cannot be told (the reader then says why)."""
    try:
        first, count, key = None, 0, group_key or ENGINES[name].group_key
        for _, rec in file_records(path, f"{name} rollout samples"):
            if isinstance(rec, list):
                return len(rec) if first is None else count
            value = json.dumps(_get(rec, key), sort_keys=True)
            first = value if first is None else first
            count += value == first
        return count or None
    except (OSError, ImportError, ValueError, TypeError, AttributeError, KeyError):
        return None

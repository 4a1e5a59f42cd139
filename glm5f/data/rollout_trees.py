"""GRPO batches as trees (--data.share_prefixes): each group's shared prompt laid out once, its completions branching
from it (`glm5f.model.tree`), so the forward, the `old` pass and the reference pass compute the prompt once.

A rollout batch (`rollouts.rollout_batch`: one completion per row, a group's rows together) becomes tree rows: per
group, the prefix its rows share (the same ids, no label and no engine log-probability in it, each row keeping at
least one token after it), then each completion's rest as a child segment; a group whose tree does not fit
--data.seq_len is split over rows by children (the prefix again in each). A group is laid out unshared (each
completion a row of its own) when the replay records of its prefix differ between completions ("replay"), when some
completions carry a record and others not ("mixed"), or when the batch replays the indexer, whose records name key
positions of the unshared sequence ("indexer": the whole batch stays unshared). Shape suffixes: R completions, B tree
rows, S positions, K completion slots per tree row.
"""

from __future__ import annotations

import math

import torch

from glm5f.core import IGNORE_INDEX
from glm5f.core.replay import REPLAY_KEYS

TREE_ROW_MULTIPLE = 64  # a tree batch's rows are as long as its longest tree, rounded up to this (at most seq_len)
REASONS = ("replay", "mixed", "indexer")  # why a group's prefix was not shared: its "prefixes_unshared_<why>" count


def shared_prefix(ids: list[list[int]], labels: list[list[int]], engine: list[list[bool]]) -> int:
    """How many leading tokens the sequences `ids` all share that none scores (no label, no engine log-probability:
    `engine` marks the tokens that have one), each sequence keeping at least one token after them."""
    n, most = 0, min(len(x) for x in ids) - 1
    while n < most and all(x[n] == ids[0][n] and lab[n] == IGNORE_INDEX and not e[n]
                           for x, lab, e in zip(ids, labels, engine)):
        n += 1
    return n


def why_unshared(records: dict, rows: list[int], P: int) -> str | None:
    """Why the prefix of length P of the completions `rows` cannot be shared (a `REASONS` entry), None when it can:
    each replayed record [R, S, slots, k] (-1: none) must hold the same choices over the prefix in every row."""
    for f, rec_RxSxMxK in records.items():
        pre = rec_RxSxMxK[rows, :P]
        if not bool((pre == pre[:1]).all()):
            has = (pre >= 0).flatten(1).any(1)
            return "mixed" if bool(has.any() and not has.all()) else "replay"
    return None


def plan_rows(lengths: list[int], P: int, seq_len: int) -> list[list[int]]:
    """The completions (indices into `lengths`, their sequences' tokens) of each tree row of one group sharing a
    prefix of P tokens: in order, as many per row as fit seq_len with the prefix."""
    out, used = [], seq_len
    for i, n in enumerate(lengths):
        if used + n - P > seq_len:
            out.append([])
            used = P
        out[-1].append(i)
        used += n - P
    return out


def tree_rows(batch: dict, seq_len: int, pad_id: int, replayed: tuple[str, ...] = ()) -> dict:
    """The tree batch of a rollout batch (see the module docstring): per token [B, S] "input_ids", "labels",
    "position_ids" (each token's position in its sequence), "tree_prev", "tree_reach", "valid" (the completions
    whose sequences hold the token: the prefix's one per child of its row, 0 on padding), "rollout_logprobs", the
    --rl.replay records `replayed`, "completion_slot" (which of its row's completions the token belongs to, -1 on the
    prefix and padding); per completion slot [B, K] "reward" (0 where none) and "group" (-1 where none); per row [B]
    "tokens_computed", "tokens_unshared" and one "prefixes_unshared_<why>" per `REASONS` entry (the groups laid out
    unshared, counted on their first row). A batch replaying the indexer is returned unshared, with its counts."""
    ids_RxS, labels_RxS, rollout_RxS = batch["input_ids"], batch["labels"], batch["rollout_logprobs"]
    R, S = ids_RxS.shape
    n_R = batch["valid"].sum(1).tolist()
    group_R = batch["group"].tolist()
    groups: dict[int, list[int]] = {}
    for r, g in enumerate(group_R):
        groups.setdefault(g, []).append(r)
    records = {f: batch[f] for f in REPLAY_KEYS if f in replayed and batch.get(f) is not None}
    if "indexer" in records:
        first = torch.zeros(R, dtype=torch.long)
        first[[rows[0] for rows in groups.values()]] = 1
        return {**batch, **{f"prefixes_unshared_{why}": first * (why == "indexer") for why in REASONS}}
    ids = [row[:n] for row, n in zip(ids_RxS.tolist(), n_R)]
    labels = [row[:n] for row, n in zip(labels_RxS.tolist(), n_R)]
    engine = [[not math.isnan(x) for x in row[:n]] for row, n in zip(rollout_RxS.tolist(), n_R)]
    plans = []  # per tree row: (shared prefix length, its completions' rows, the reason its group is unshared)
    for rows in groups.values():
        P = shared_prefix([ids[r] for r in rows], [labels[r] for r in rows], [engine[r] for r in rows])
        why = why_unshared(records, rows, P) if P else None
        if P == 0 or why is not None:
            plans += [(0, [r], why if k == 0 else None) for k, r in enumerate(rows)]
        else:
            plans += [(P, [rows[i] for i in part], None) for part in plan_rows([n_R[r] for r in rows], P, seq_len)]
    longest = max(P + sum(n_R[r] - P for r in rows) for P, rows, _ in plans)
    S_tree = min(seq_len, -(-longest // TREE_ROW_MULTIPLE) * TREE_ROW_MULTIPLE)
    B, K = len(plans), max(len(rows) for _, rows, _ in plans)
    src_r = torch.zeros(B, S_tree, dtype=torch.long)  # the unshared (row, position) each token is taken from
    src_s = torch.zeros(B, S_tree, dtype=torch.long)
    real = torch.zeros(B, S_tree, dtype=torch.bool)
    out = {"tree_prev": torch.empty(B, S_tree, dtype=torch.long),
           "tree_reach": torch.empty(B, S_tree, dtype=torch.long), "valid": torch.zeros(B, S_tree, dtype=torch.long),
           "completion_slot": torch.full((B, S_tree), -1),
           "reward": torch.zeros(B, K, dtype=torch.float64), "group": torch.full((B, K), -1),
           "tokens_computed": torch.zeros(B, dtype=torch.long), "tokens_unshared": torch.zeros(B, dtype=torch.long),
           **{f"prefixes_unshared_{why}": torch.zeros(B, dtype=torch.long) for why in REASONS}}
    for b, (P, rows, why) in enumerate(plans):
        end = P + sum(n_R[r] - P for r in rows)
        prev, reach, valid, slot = list(range(-1, P - 1)), [end - 1] * P, [len(rows)] * P, [-1] * P
        taken = [(rows[0], s) for s in range(P)]
        for k, r in enumerate(rows):
            a, n = len(prev), n_R[r] - P
            prev += [P - 1 if P else -1] + list(range(a, a + n - 1))
            reach += [a + n - 1] * n
            valid += [1] * n
            slot += [k] * n
            taken += [(r, s) for s in range(P, n_R[r])]
            out["reward"][b, k], out["group"][b, k] = batch["reward"][r], group_R[r]
        pad = S_tree - end
        out["tree_prev"][b] = torch.tensor(prev + ([-1] + list(range(end, S_tree - 1)) if pad else []))
        out["tree_reach"][b] = torch.tensor(reach + [S_tree - 1] * pad)
        out["valid"][b, :end], out["completion_slot"][b, :end] = torch.tensor(valid), torch.tensor(slot)
        src_r[b, :end], src_s[b, :end] = torch.tensor(taken).T
        real[b, :end] = True
        out["tokens_computed"][b], out["tokens_unshared"][b] = end, sum(n_R[r] for r in rows)
        if why is not None:
            out[f"prefixes_unshared_{why}"][b] = 1
    pad_pos = torch.arange(S_tree).expand(B, -1) - (real.sum(1, keepdim=True))
    out["input_ids"] = torch.where(real, ids_RxS[src_r, src_s], pad_id)
    out["labels"] = torch.where(real, labels_RxS[src_r, src_s], IGNORE_INDEX)
    out["position_ids"] = torch.where(real, src_s, pad_pos)
    out["rollout_logprobs"] = torch.where(real, rollout_RxS[src_r, src_s], math.nan)
    for f, rec_RxSxMxK in records.items():
        out[f] = torch.where(real[..., None, None], rec_RxSxMxK[src_r, src_s], -1)
    return out

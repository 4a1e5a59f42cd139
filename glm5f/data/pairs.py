"""Preference pairs (`--data.type preference`): JSONL records of a prompt with a chosen and a rejected answer, read
into memory and served one pair per row, both answers packed back to back, for the DPO objective.

Records: {"prompt": str, "chosen": str, "rejected": str} (text: the answers' tokens and eos are scored);
{"messages": [...], "chosen", "rejected"} (a chat: each answer, a string or a list of assistant messages, follows
the conversation and is rendered with the run's template; its tokens and the stop token that ends it are scored, as
SFT trains them); {"prompt_ids", "chosen_ids", "rejected_ids"} (token ids, the answers' scored as given). TRL's
conversational rows: "prompt" a list of messages is read as "messages"; without a prompt, "chosen" and "rejected" as
whole conversations share their leading messages, which are the prompt (`implicit_prompt`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from glm5f.data.files import file_records
from glm5f.data.readers import chat_prompt
from glm5f.data.tokens import IGNORE_INDEX, Example, check_vocab

CHOSEN, REJECTED = 1, 2  # a batch's "answer" entries: which answer a label belongs to (0: none)
TREE_ROW_MULTIPLE = 64  # a tree batch's rows are as long as its longest tree, rounded up to this (at most seq_len)


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    where: str


def _ids(rec: dict, name: str, where: str) -> list[int]:
    ids = rec[name]
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(f"{where}: {name} must be a list of integer token ids, found {json.dumps(ids)[:40]}")
    return ids


def _text(rec: dict, name: str, where: str) -> str:
    if not isinstance(rec[name], str):
        raise ValueError(f"{where}: field {name!r} must be a string, found {json.dumps(rec[name])[:40]}; fix the "
                         f"record or remove it")
    return rec[name]


def _answer_messages(value, name: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and m.get("role") == "assistant" for m in value):
        return value
    raise ValueError(f"{where}: {name!r} must be a string or a list of assistant messages, found "
                     f"{json.dumps(value)[:60]}")


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def implicit_prompt(rec: dict, where: str) -> dict:
    """TRL's implicit-prompt row ({"chosen", "rejected"}: two whole conversations) as {"messages": the leading
    messages both share, "chosen", "rejected": what follows them}; a ValueError naming `where` when they share no
    leading message or one holds nothing after the shared ones."""
    chosen, rejected = rec["chosen"], rec["rejected"]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        found = "share no leading message" if n == 0 else "leave no answer after the messages they share"
        raise ValueError(f"{where}: 'chosen' and 'rejected' without a 'prompt' are whole conversations whose shared "
                         f"leading messages are the prompt, but these {found}; give 'prompt' (or 'messages') and the "
                         f"two answers")
    return {**{k: v for k, v in rec.items() if k not in ("chosen", "rejected")}, "messages": chosen[:n],
            "chosen": chosen[n:], "rejected": rejected[n:]}


def implicit_text_prompt(rec: dict, where: str) -> dict:
    """TRL's standard implicit-prompt row ({"chosen": "The sky is blue.", "rejected": "The sky is green."}) as
    {"prompt", "chosen", "rejected"}: the prompt is the two texts' common beginning up to its last whitespace, which
    starts both answers ("The sky is", " blue.", " green."); a ValueError naming `where` when that leaves no prompt
    or no answer."""
    chosen, rejected = rec["chosen"], rec["rejected"]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    n = max((i for i in range(n) if chosen[i].isspace()), default=0)
    if n == 0 or n >= len(chosen) or n >= len(rejected) or chosen == rejected:
        raise ValueError(f"{where}: 'chosen' and 'rejected' texts without a 'prompt' are whole texts whose common "
                         f"beginning (up to a space) is the prompt, but these share none; give 'prompt' and the two "
                         f"answers")
    return {**{k: v for k, v in rec.items() if k not in ("chosen", "rejected")}, "prompt": chosen[:n],
            "chosen": chosen[n:], "rejected": rejected[n:]}


NOT_READ = ("labels", "input_ids", "attention_mask", "text", "response", "completion")  # refused, never dropped


def check_fields(rec: dict, where: str) -> None:
    """A ValueError naming `where` for a record whose fields conflict (its prompt given twice, token ids beside text)
    or that holds a field of another record kind that a pair does not read."""
    given = [k for k in ("prompt", "messages", "prompt_ids") if k in rec]
    if len(given) > 1:
        raise ValueError(f"{where}: the record gives its prompt twice ({' and '.join(map(repr, given))}); keep one")
    ids = [k for k in ("prompt_ids", "chosen_ids", "rejected_ids") if k in rec]
    text = [k for k in ("prompt", "messages", "chosen", "rejected") if k in rec]
    if ids and text:
        raise ValueError(f"{where}: the record mixes token ids ({', '.join(map(repr, ids))}) with text "
                         f"({', '.join(map(repr, text))}); give the pair one way")
    unread = [k for k in NOT_READ if k in rec]
    if unread:
        raise ValueError(f"{where}: field(s) {', '.join(map(repr, unread))} a preference record does not read (it "
                         f"holds a prompt, 'chosen' and 'rejected'); remove them or write what they say in those")


def pair_of(rec, where: str, tok, fmt=None) -> Pair:
    """The Pair of one record (see the module docstring): two Examples sharing the prompt, labels on the answer's
    tokens only. `tok` tokenizes text records; `fmt` (a glm5f.data.chat.ChatFormat) renders chat records."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    check_fields(rec, where)
    rec = chat_prompt(rec, where)
    if "messages" not in rec and "prompt" not in rec and all(_is_conversation(rec.get(k))
                                                            for k in ("chosen", "rejected")):
        rec = implicit_prompt(rec, where)
    elif not {"prompt", "messages", "prompt_ids"} & set(rec) and all(isinstance(rec.get(k), str)
                                                                 for k in ("chosen", "rejected")):
        rec = implicit_text_prompt(rec, where)
    if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(rec):
        prompt = _ids(rec, "prompt_ids", where)
        return Pair(*(Example(prompt + a, [IGNORE_INDEX] * len(prompt) + a)
                      for a in (_ids(rec, "chosen_ids", where), _ids(rec, "rejected_ids", where))), where)
    missing = [k for k in ("chosen", "rejected") if k not in rec]
    if missing or ("prompt" not in rec and "messages" not in rec):
        raise ValueError(f"{where}: a preference record needs 'prompt' (or 'messages'), 'chosen' and 'rejected' "
                         f"(or 'prompt_ids', 'chosen_ids', 'rejected_ids'); found keys {sorted(rec)}")
    if "messages" in rec:
        if fmt is None:
            raise ValueError(f"{where}: a chat record ('messages'), but no chat template was given to render it")
        messages = rec["messages"]
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'messages' must be a list of messages, found {json.dumps(messages)[:40]}")
        answers = [_answer_messages(rec[k], k, where) for k in ("chosen", "rejected")]  # they name `where`
        try:
            return Pair(*(fmt.example(messages + a, train_on="last") for a in answers), where)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(_text(rec, "prompt", where))
    eos = [tok.eos_id] if tok.eos_id is not None else []
    answers = [tok.encode(_text(rec, k, where)) + eos for k in ("chosen", "rejected")]
    return Pair(*(Example(head + a, [IGNORE_INDEX] * len(head) + a) for a in answers), where)


def read_pairs(path: str, tok, fmt=None) -> list[Pair]:
    """Every pair of a JSON-lines or parquet file or a folder of them (`files.file_records`); a ValueError naming
    the record's file:line (parquet: file:row N) for a bad one."""
    return [pair_of(rec, where, tok, fmt) for where, rec in file_records(path, "preference records")]


def scored(ex: Example) -> int:
    """The tokens of an answer that are scored: labels other than IGNORE_INDEX past the first token."""
    return sum(t != IGNORE_INDEX for t in ex.labels[1:])


def fit(pair: Pair, seq_len: int) -> tuple[Pair, str | None]:
    """The pair cut so both sequences fit one row of seq_len (each to at most its half when together they do
    not), with a note saying what was done; an empty pair when an answer would have no scored token left."""
    c, r = pair.chosen, pair.rejected
    if len(c.ids) + len(r.ids) <= seq_len:
        return pair, None
    half = seq_len // 2
    cut = [Example(e.ids[:half], e.labels[:half]) if len(e.ids) > half else e for e in (c, r)]
    if not all(scored(e) for e in cut):
        return Pair(Example([], []), Example([], []), pair.where), \
            f"have an answer with no token left within half of --data.seq_len {seq_len}: dropped"
    return Pair(cut[0], cut[1], pair.where), f"do not fit --data.seq_len {seq_len} together: cut to half each"


def shared_prompt(p: Pair) -> int:
    """How many leading tokens a pair's two sequences share and score in neither (the prompt), leaving each
    answer at least one token."""
    c, r = p.chosen, p.rejected
    n, most = 0, min(len(c.ids), len(r.ids)) - 1
    while n < most and c.ids[n] == r.ids[n] and (n == 0 or c.labels[n] == r.labels[n] == IGNORE_INDEX):
        n += 1
    return n


class PairSource:
    """One pair per row, in a seeded per-epoch order: the chosen sequence, then the rejected one (positions
    restarting, so each attends only to itself), then padding (its own positions, never scored). A batch holds
    "input_ids", "labels", "position_ids" [B, S], "answer" [B, S]: CHOSEN or REJECTED where the label is an
    answer's, else 0, and "valid" [B, S], 0 on padding (the MoE load counts and per-query terms skip it); with reference sums given (`use_reference`), also each row's pair's "ref_chosen" and
    "ref_rejected" [B] (fp64). `pairs` are the pairs kept (fitted to seq_len), indexed as the reference sums are.
    Each row's "tokens_computed" and "tokens_unshared" [B]: the tokens it runs, and its two sequences' tokens.

    With `share_prefixes`, each row is a tree (`glm5f.model.tree`): the prompt once (`shared_prompt`), then the
    chosen and the rejected answer, each continuing it (positions from the prompt's end), then padding to the
    batch's longest tree (rounded up to TREE_ROW_MULTIPLE, at most seq_len); the batch adds "tree_prev" and
    "tree_reach" [B, S], its "valid" counts the sequences holding each token (the prompt's 2: the MoE load counts
    weigh tokens by it), and its labels and "answer" sit at the token they name (a token is predicted by its
    predecessor on its path: `train.loss.with_targets`)."""

    def __init__(self, pairs: list[Pair], batch_size: int, seq_len: int, vocab_size: int, seed: int, pad_id: int,
                 warn=lambda message: None, name: str = "preference data", share_prefixes: bool = False):
        notes, kept = {}, []
        for p in pairs:
            p, note = fit(p, seq_len)
            if note:
                notes.setdefault(note, []).append(p.where)
            if p.chosen.ids:
                kept.append(p)
        for note, where in notes.items():
            warn(f"{len(where)} pair(s) {note} (first: {where[0]})")
        if not kept:
            raise ValueError(f"{name}: no pair fits --data.seq_len {seq_len}; raise it")
        for p in kept:  # named by the record's file:line
            for which, ex in (("chosen", p.chosen), ("rejected", p.rejected)):
                bad = next((j for j, t in enumerate(ex.ids) if not 0 <= t < vocab_size), None)
                if bad is not None:
                    part = "prompt" if bad < shared_prompt(p) else f"{which} answer"
                    raise ValueError(f"{p.where}: the {part} has token id {ex.ids[bad]} (position {bad} of the "
                                     f"{which} sequence) outside [0, vocab_size={vocab_size}): the tokenizer or the "
                                     f"data does not fit the model's vocabulary")
        check_vocab([e for p in kept for e in (p.chosen, p.rejected)], vocab_size, name)
        self.pairs, self.B, self.S, self.seed, self.pad_id = kept, batch_size, seq_len, seed, pad_id
        self.share_prefixes = share_prefixes
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)
        self.reference_Px2 = None

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.pairs), generator=g).tolist()

    def _next_pair(self) -> int:
        """The index of the next pair in this epoch's order (the position moves on)."""
        i = self._order[self.index]
        self.index += 1
        if self.index == len(self.pairs):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        return i

    def _row(self, p: Pair) -> tuple[list[int], ...]:
        ids, labels, pos, answer = [], [], [], []
        for ex, which in ((p.chosen, CHOSEN), (p.rejected, REJECTED)):
            lab = [IGNORE_INDEX] + ex.labels[1:]  # a sequence's first token is not predicted from another
            ids += ex.ids
            labels += lab
            pos += range(len(ex.ids))
            answer += [which if t != IGNORE_INDEX else 0 for t in lab]
        pad = self.S - len(ids)
        return (ids + [self.pad_id] * pad, labels + [IGNORE_INDEX] * pad, pos + list(range(pad)),
                answer + [0] * pad, [1] * len(ids) + [0] * pad)

    def _tree_row(self, p: Pair, S: int) -> tuple[list[int], ...]:
        """`_row` as a tree of S tokens: the chosen sequence (the prompt, then its answer), the rejected answer
        after the prompt's last token, padding; its valid counts each token's sequences (the prompt's 2); with each
        token's predecessor on its path and reach (`glm5f.model.tree`)."""
        n, c, r = shared_prompt(p), p.chosen, p.rejected
        lab_c, lab_r = [IGNORE_INDEX] + c.labels[1:], [IGNORE_INDEX] + r.labels[1:]
        Lc, Lr = len(c.ids), len(r.ids)
        end, pad = Lc + Lr - n, S - (Lc + Lr - n)
        answer = [CHOSEN if t != IGNORE_INDEX else 0 for t in lab_c] + \
            [REJECTED if t != IGNORE_INDEX else 0 for t in lab_r[n:]]
        prev = list(range(-1, Lc - 1)) + [n - 1] + list(range(Lc, end - 1)) + \
            ([-1] + list(range(end, S - 1)) if pad else [])
        reach = [end - 1] * n + [Lc - 1] * (Lc - n) + [end - 1] * (Lr - n) + [S - 1] * pad
        valid = [2] * n + [1] * (Lc + Lr - 2 * n) + [0] * pad
        return (c.ids + r.ids[n:] + [self.pad_id] * pad, lab_c + lab_r[n:] + [IGNORE_INDEX] * pad,
                list(range(Lc)) + list(range(n, Lr)) + list(range(pad)), answer + [0] * pad, valid, prev, reach)

    def batch_of(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The batch of the pairs `indices` (one row each, in that order); the position does not move."""
        names = ("input_ids", "labels", "position_ids", "answer", "valid")
        pairs = [self.pairs[i] for i in indices]
        if self.share_prefixes:
            S = min(self.S, -(-max(len(p.chosen.ids) + len(p.rejected.ids) - shared_prompt(p) for p in pairs)
                              // TREE_ROW_MULTIPLE) * TREE_ROW_MULTIPLE)
            rows = [self._tree_row(p, S) for p in pairs]
            names += ("tree_prev", "tree_reach")
        else:
            rows = [self._row(p) for p in pairs]
        batch = {name: torch.tensor([r[i] for r in rows]) for i, name in enumerate(names)}
        batch["tokens_unshared"] = torch.tensor([len(p.chosen.ids) + len(p.rejected.ids) for p in pairs])
        batch["tokens_computed"] = batch["tokens_unshared"] - torch.tensor(
            [shared_prompt(p) if self.share_prefixes else 0 for p in pairs])
        if self.reference_Px2 is not None:
            batch["ref_chosen"], batch["ref_rejected"] = self.reference_Px2[indices].unbind(1)
        return batch

    def next_batch(self) -> dict[str, torch.Tensor]:
        return self.batch_of([self._next_pair() for _ in range(self.B)])

    def use_reference(self, reference_Px2: torch.Tensor) -> None:
        """From now on, batches carry each row's reference sums: reference_Px2[i] = (chosen, rejected) of pair i."""
        if tuple(reference_Px2.shape) != (len(self.pairs), 2):
            raise ValueError(f"reference sums must be [pairs, 2] = [{len(self.pairs)}, 2], found "
                             f"{list(reference_Px2.shape)}")
        self.reference_Px2 = reference_Px2.to("cpu", torch.float64)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)


def answer_sums(logp_BxS: torch.Tensor, answer_BxS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) [B]: each row's summed log-probabilities of its chosen and rejected answer's targets
    (fp64 sums), `answer_BxS` each target's answer (CHOSEN, REJECTED, else 0)."""
    return tuple((logp_BxS * (answer_BxS == which)).sum(1, dtype=torch.float64) for which in (CHOSEN, REJECTED))

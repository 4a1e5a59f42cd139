"""Packing examples into rows of seq_len: positions restart at each document, its first token is not a target,
padding (pack=False) is masked out; and the check that a batch has a token to learn.
"""

from __future__ import annotations

import torch

from glm5f.data.tokens import IGNORE_INDEX, Example


class RowPacker:
    """Rows of seq_len cut from a sequence of examples, packed back to back (or one example per row, truncated and
    padded, when pack=False). A subclass says which example is current (`_current`) and moves on (`_advance`);
    `offset` is how far into the current example the rows have come."""

    def _row(self):
        ids, labels, pos = [], [], []
        while len(ids) < self.S:
            ex = self._current()
            take = min(self.S - len(ids), len(ex.ids) - self.offset)
            ids += ex.ids[self.offset:self.offset + take]
            lab = ex.labels[self.offset:self.offset + take]
            if self.offset == 0 and lab:
                lab = [IGNORE_INDEX] + lab[1:]  # the first token of a document is not predicted from another
            labels += lab
            pos += range(self.offset, self.offset + take)
            self.offset += take
            if self.offset >= len(ex.ids) or not self.pack:
                self._advance()
            if not self.pack:
                break
        n = len(ids)
        valid = [1] * n + [0] * (self.S - n)
        return (ids + [self.pad_id] * (self.S - n), labels + [IGNORE_INDEX] * (self.S - n),
                pos + list(range(n, self.S)), valid)

    def next_batch(self) -> dict[str, torch.Tensor]:
        rows = [self._row() for _ in range(self.B)]
        batch = {"input_ids": torch.tensor([r[0] for r in rows]), "labels": torch.tensor([r[1] for r in rows]),
                 "position_ids": torch.tensor([r[2] for r in rows])}
        if not self.pack:
            batch["attention_mask"] = torch.tensor([r[3] for r in rows])
        return batch


class PackedSource(RowPacker):
    """Rows of seq_len cut from the examples (all in memory) in a seeded per-epoch order, packed back to back (or
    one example per row, truncated and padded, when pack=False)."""

    def __init__(self, examples: list[Example], batch_size: int, seq_len: int, seed: int, pad_id: int,
                 pack: bool = True, name: str = "data"):
        if not examples or not any(ex.ids for ex in examples):
            raise ValueError(f"{name}: the dataset is empty (no examples with tokens)")
        self.examples, self.B, self.S, self.seed, self.pad_id, self.pack = \
            examples, batch_size, seq_len, seed, pad_id, pack
        self.epoch, self.index, self.offset = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()

    def _current(self) -> Example:
        return self.examples[self._order[self.index]]

    def _advance(self):
        self.index, self.offset = self.index + 1, 0
        if self.index == len(self.examples):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.offset = state["epoch"], state["index"], state["offset"]
        self._order = self._permutation(self.epoch)


def check_first_batch(batch: dict[str, torch.Tensor], step: int, source: str) -> None:
    """Before the first step: a ValueError when the batch holds no target token (every label IGNORE_INDEX past
    each document's first token), which would "train" to loss 0.0000 on nothing."""
    labels = batch["labels"][:, 1:]
    if not bool((labels != IGNORE_INDEX).any()):
        raise ValueError(f"{source}: the batch of step {step + 1} holds no token to learn (every label is "
                         f"{IGNORE_INDEX} or the first of its document), so the loss would be 0 and nothing "
                         f"trained; check the labels of the data")

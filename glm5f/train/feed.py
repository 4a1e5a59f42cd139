"""A run's batch schedule (`Feed`): where each optimizer step's batch comes from, how many updates each batch gets,
and what of it a checkpoint keeps. An objective whose batches come otherwise names its own (`Objective.feed`)."""

from __future__ import annotations

import torch


class Feed:
    """One batch of the data source per optimizer step, on the layout's device (every objective's, unless its row
    names another). A subclass that gives each batch `per_batch` updates keeps the batch between them, and a
    checkpoint taken between them holds it (`state_dict`), so a resume continues its updates.

    metrics: what the run logs beside a step's metrics about how its batch was made (e.g. the sampling time)."""

    per_batch = 1
    per_batch_flag = "the updates per batch"  # the flag that sets per_batch, for the resume error

    def __init__(self, data, trainer):
        self.data, self.trainer = data, trainer
        self.batch: dict | None = None
        self.metrics: dict = {}

    def next(self, state, step: int) -> dict:
        """The batch of step index `step` (0-based) for the state `state`: a new one at each multiple of per_batch
        (or when none is held), else the one held."""
        if self.batch is None or step % self.per_batch == 0:
            self.batch = self.fetch(state)
        return self.batch

    def fetch(self, state) -> dict:
        """A new batch: the data source's next, on the layout's device."""
        return on_device(self.data.next_batch(), self.trainer.layout.device)

    def state_dict(self, steps_done: int) -> dict:
        """What a checkpoint after `steps_done` steps keeps: the data position, and the batch when that is
        between a batch's updates."""
        held = {"batch": {k: v.cpu() for k, v in self.batch.items()}} if steps_done % self.per_batch else {}
        return {"data": self.data.state_dict(), **held}

    def load_state_dict(self, extra: dict, steps_done: int, ckpt: str) -> None:
        """Continue from a checkpoint's `extra` taken after `steps_done` steps (its data position; between a
        batch's updates, its batch). The data source raises KeyError or TypeError for a position of another type."""
        self.data.load_state_dict(extra["data"])
        if steps_done % self.per_batch:
            saved = extra.get("batch")
            if saved is None:
                raise ValueError(f"{ckpt}: taken between the updates of a batch ({self.per_batch_flag}), but it holds "
                                 f"no batch; resume with the {self.per_batch_flag} it was saved with")
            self.batch = on_device(saved, self.trainer.layout.device)


def on_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`."""
    return {k: v.to(device) for k, v in batch.items()}

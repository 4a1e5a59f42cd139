"""Records longer than --data.seq_len: refused (the default), or with --data.skip_overlong counted and skipped
(verl's filter_overlong_prompts), the count said once at the start with the file it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Skipped:
    """What --data.skip_overlong left out of a file: `count` of its `total` records (`what`: their noun, plural),
    the first at `first` (file:line), for --data.seq_len `seq_len`."""

    count: int
    total: int
    what: str
    first: str | None
    path: str
    seq_len: int

    def line(self) -> str:
        """The start line's report: how many were skipped, from which file, the first one."""
        return (f"--data.skip_overlong: skipped {self.count} of {self.total} {self.what} of {self.path} that do not "
                f"fit --data.seq_len {self.seq_len} (the first at {self.first})")


def fitting(items: list[T], refusal: Callable[[T], str | None], where: Callable[[T], str], skip: bool, what: str,
            path: str, seq_len: int) -> tuple[list[T], Skipped | None]:
    """(the items that fit, what was skipped: None when nothing was). `refusal(item)` is why an item does not fit
    (None: it fits). Without `skip` the first that does not fit raises its refusal as a ValueError; with it, every
    one that does not is left out, and a ValueError says so when none is left."""
    kept, count, first = [], 0, None
    for item in items:
        why = refusal(item)
        if why is None:
            kept.append(item)
            continue
        if not skip:
            raise ValueError(f"{why}, or pass --data.skip_overlong to skip such {what}")
        count, first = count + 1, first or where(item)
    if items and not kept:
        raise ValueError(f"{path}: every one of its {len(items)} {what} is longer than --data.seq_len {seq_len}, so "
                         f"--data.skip_overlong leaves nothing to train on; raise --data.seq_len (the first at "
                         f"{first})")
    return kept, Skipped(count, len(items), what, first, path, seq_len) if count else None

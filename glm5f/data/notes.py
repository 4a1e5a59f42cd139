"""What the data says to the user: warnings about a dataset's records (empty fields, records with nothing to
learn, an unused tokenizer), and how warnings print on the command line (one `warning:` line each).
"""

from __future__ import annotations

import sys

from glm5f.data.tokens import IGNORE_INDEX, Example, has_target


class RecordNotes:
    """What the first records of a dataset say about it: how many were read, how many hold input_ids, and where
    the ones with an empty response or text and the ones with nothing to learn (skipped) are (the first, and a
    count)."""

    def __init__(self):
        self.records, self.tokenized = 0, 0
        self.empty: dict[str, list] = {}  # "response" / "text" -> [records where it is empty, the first one]
        self.notes: dict[str, list] = {}  # an Example's note -> [count, where the first one is]
        self.untrained, self.first_untrained = 0, None

    def add(self, rec: dict, where: str, ex: Example) -> None:
        self.records += 1
        if ex.note:  # skipped or cut for a reason of its own (a chat record), said once by that note
            self.notes.setdefault(ex.note, [0, where])[0] += 1
        elif not has_target(ex):
            self.untrained += 1
            self.first_untrained = self.first_untrained or where
        self.tokenized += "input_ids" in rec
        field = "response" if "prompt" in rec and "response" in rec else "text" if "text" in rec else None
        if "input_ids" not in rec and field and not str(rec[field]).strip() and has_target(ex):
            self.empty.setdefault(field, [0, where])[0] += 1

    def warn(self, complete: bool, tokenizer_path: str | None, warn) -> None:
        """Warn once about records with an empty response or text, and about a --model.tokenizer_path that no record
        uses (all hold input_ids); `complete`: the notes cover the whole dataset."""
        counted = f"{self.records}" if complete else f"the first {self.records}"
        if self.untrained and self.untrained < self.records:
            warn(f"{self.untrained} of {counted} records have no token to learn (at most one token, or every "
                 f"label {IGNORE_INDEX}; the first at {self.first_untrained}): they are skipped")
        for field, (count, first) in self.empty.items():
            warn(f"{count} of {counted} records have an empty {field} (the first at {first}); each trains only on "
                 f"its end-of-sequence token")
        if tokenizer_path and self.records and self.tokenized == self.records:
            warn(f"--model.tokenizer_path {tokenizer_path} is not used: every record holds input_ids already")
        for note, (count, first) in self.notes.items():
            warn(f"{count} of {counted} records {note} (the first at {first})")


def nothing_to_learn(name: str, records: int) -> str:
    if not records:
        return f"{name}: the dataset is empty (no records)"
    return (f"{name}: nothing to learn: none of its {records} records has a token to predict (each has at most one "
            f"token, or every label {IGNORE_INDEX}); training on it would report loss 0. Check the data's fields "
            f"(a response to learn, labels not all {IGNORE_INDEX})")


def print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def warnings_as_lines() -> None:
    """Print Python warnings (glm5f's, and its libraries') as one `warning:` line each, without the category and
    source line Python adds; for the command-line scripts."""
    import warnings

    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: print_warning(
        str(message))

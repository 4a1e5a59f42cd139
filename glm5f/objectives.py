"""The main objectives --train.objective names, one row each (`train.loss.Objective`), each row's code in a file
of its own. The table sits above train/ and posttrain/ (it names rows of both); run/, train.py and configs.py read it.
"""

from __future__ import annotations

from glm5f.posttrain import dpo, grpo
from glm5f.train.loss import LM, Objective

OBJECTIVES: dict[str, Objective] = {"lm": LM, "dpo": dpo.DPO, "grpo": grpo.GRPO}


def objective(name: str) -> Objective:
    """The main objective --train.objective names."""
    if name not in OBJECTIVES:
        raise ValueError(f"--train.objective must be one of {', '.join(OBJECTIVES)}, found {name!r}")
    return OBJECTIVES[name]

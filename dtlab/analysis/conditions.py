"""``%dt_run --until`` conditions: text -> :class:`dtlab.records.Condition`.

    step>=200    loss>4.5    loss<0.1    nonfinite    diverged

``nonfinite`` holds when a rank's loss or any gradient element is inf/nan; ``diverged``
when the ranks' gradient or parameter fingerprints stop being all equal.
"""

from __future__ import annotations

import math
import re

from dtlab.records import Condition, StepRecord
from dtlab.records.errors import InputError

_FORMS = "step>=N, loss>X, loss<X, nonfinite, diverged"
_COMPARISON = re.compile(r"^(step|loss)\s*(>=|>|<)\s*([-+0-9.eE]+)$")
_KINDS = {("step", ">="): "step", ("loss", ">"): "loss_above", ("loss", "<"): "loss_below"}


def parse_condition(text: str) -> Condition:
    """Parse one condition; InputError names the text and the forms understood."""
    cleaned = text.strip().lower().replace(" ", "")
    if cleaned in ("nonfinite", "diverged"):
        return Condition(cleaned)
    match = _COMPARISON.match(cleaned)
    kind = _KINDS.get((match.group(1), match.group(2))) if match else None
    if match is None or kind is None:
        raise InputError(f"cannot read the condition {text!r}; write one of: {_FORMS}")
    try:
        value = float(match.group(3))
    except ValueError:
        raise InputError(f"{match.group(3)!r} in {text!r} is not a number") from None
    if kind == "step" and (value != int(value) or value < 1):
        raise InputError(f"step>=N needs a whole number of steps >= 1, got {match.group(3)}")
    return Condition(kind, value)


def describe_condition(cond: Condition) -> str:
    """The condition as the user would write it."""
    if cond.kind == "step":
        assert cond.value is not None  # a "step" condition always has its step
        return f"step>={int(cond.value)}"
    if cond.kind == "loss_above":
        return f"loss>{cond.value:g}"
    if cond.kind == "loss_below":
        return f"loss<{cond.value:g}"
    return cond.kind


def condition_holds(cond: Condition | None, rec: StepRecord) -> bool:
    """Does this rank's step meet ``cond``? ("diverged" is decided across ranks instead.)"""
    if cond is None or cond.kind == "diverged":
        return False
    if cond.kind == "nonfinite":
        return not math.isfinite(rec.loss) or rec.num_nonfinite > 0
    if cond.value is None or cond.kind not in ("step", "loss_above", "loss_below"):
        raise ValueError(f"unknown condition {cond!r}")
    if cond.kind == "step":
        return rec.step >= cond.value
    return rec.loss > cond.value if cond.kind == "loss_above" else rec.loss < cond.value

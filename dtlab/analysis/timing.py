"""Before/after timings judged against their spread: a verdict only when it is beyond noise.

Pure. One timing of each side says nothing on a shared machine (a step measured at 106 ms
then 156 ms on a busy 2-core box was noise, not the plan); so every comparison dtlab
prints takes several samples per side, shows each side's median with its interquartile
range, and calls the change "faster" or "slower" only when the two ranges do not overlap.
Otherwise it says "within noise", and with too few samples "too few to judge".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dtlab.records import StepRecord

MIN_SAMPLES = 5  # per side: fewer cannot show a spread worth the name


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range of ``n`` samples (seconds, or any unit)."""

    median: float
    low: float  # 25th percentile
    high: float  # 75th percentile
    n: int


def spread(samples: Sequence[float]) -> Spread:
    values = sorted(samples)
    if not values:
        raise ValueError("no samples to take a spread of")
    if len(values) == 1:
        return Spread(values[0], values[0], values[0], 1)
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(statistics.median(values), low, high, len(values))


@dataclass(frozen=True)
class Change:
    """How ``after`` compares with ``before`` (for times: smaller is faster)."""

    before: Spread
    after: Spread
    verdict: str  # "faster" | "slower" | "within noise" | "too few to judge"

    @property
    def ratio(self) -> float:
        """before / after of the medians (> 1: after is faster)."""
        return self.before.median / self.after.median if self.after.median else float("inf")


def change(before: Sequence[float], after: Sequence[float]) -> Change:
    """Judge a change of times: beyond noise only when the interquartile ranges are apart."""
    b, a = spread(before), spread(after)
    if min(b.n, a.n) < MIN_SAMPLES:
        verdict = "too few to judge"
    elif a.high < b.low:
        verdict = "faster"
    elif a.low > b.high:
        verdict = "slower"
    else:
        verdict = "within noise"
    return Change(b, a, verdict)


def describe(found: Change, what: str, fmt: Callable[[float], str]) -> str:
    """``step 106 ms (IQR 98-120, 10 samples) → 81 ms (IQR 79-84, 10 samples): 1.31x
    faster, beyond the spread``; "within noise (the spreads overlap)" otherwise."""
    sides = f"{what} {_side(found.before, fmt)} → {_side(found.after, fmt)}"
    if found.verdict == "too few to judge":
        need = max(0, MIN_SAMPLES - min(found.before.n, found.after.n))
        return f"{sides}: too few samples to judge ({need} more per side needed)"
    if found.verdict == "within noise":
        return f"{sides}: within noise (the spreads overlap)"
    times = found.ratio if found.verdict == "faster" else 1 / found.ratio
    return f"{sides}: {times:.2f}x {found.verdict}, beyond the spread"


def _side(s: Spread, fmt: Callable[[float], str]) -> str:
    if s.n == 1:
        return f"{fmt(s.median)} (1 sample)"
    return f"{fmt(s.median)} (IQR {fmt(s.low)}-{fmt(s.high)}, {s.n} samples)"


def step_times(
    records: Mapping[int, Sequence[StepRecord]], steps: Sequence[int] | None = None
) -> list[float]:
    """Per step, the slowest rank's forward + backward time (a pipeline's schedule: what
    sets its step; data loading and the optimizer are left out), for ``steps`` (default:
    every step all ranks recorded)."""
    by_step: dict[int, dict[int, StepRecord]] = {}
    for rank, recs in records.items():
        for rec in recs:
            by_step.setdefault(rec.step, {})[rank] = rec
    chosen = sorted(by_step) if steps is None else list(steps)
    return [
        max(r.times.forward + r.times.backward for r in by_step[s].values())
        for s in chosen
        if s in by_step and len(by_step[s]) == len(records)
    ]

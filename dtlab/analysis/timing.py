"""Before/after timings judged against their spread: a verdict only when it is beyond noise.

Pure. One timing of each side says nothing on a shared machine (a step measured at 106 ms
then 156 ms on a busy 2-core box was noise, not the plan); so every comparison dtlab
prints takes several samples per side, shows each side's median with its interquartile
range, and calls the change "faster" or "slower" only when the two ranges do not overlap.
Otherwise it says "within noise", and with too few samples "too few to judge".

A before-then-after comparison also takes any change of the machine's load between the two
windows for the change made (on a busy 2-core box a pipeline step measured 2.14x "slower"
after a move that makes it faster: the load had risen). So where both sides can be run
again, dtlab measures them in alternating rounds (A B A B A B, :func:`interleaved_change`)
and judges each sample against its own round's median: a load that drifts from round to
round cancels out, and a claim needs every round to agree.
"""

from __future__ import annotations

import math
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
    rounds: int = 1  # alternating A/B rounds the samples came from (1: before, then after)
    paired_ratio: float | None = None  # interleaved: geometric mean of per-round ratios

    @property
    def ratio(self) -> float:
        """before / after (> 1: after is faster): of the medians, or interleaved, the
        geometric mean of each round's ratio of medians (drift between rounds cancels)."""
        if self.paired_ratio is not None:
            return self.paired_ratio
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


def interleaved_change(rounds: Sequence[tuple[Sequence[float], Sequence[float]]]) -> Change:
    """Judge B against A from alternating rounds ``[(a_samples, b_samples), ...]``.

    Each sample is divided by the median of its own round (both sides together), so that a
    load which changes between rounds scales both sides of that round alike and drops out;
    the rule of :func:`change` (interquartile ranges apart) is then applied to these
    relative times, and a verdict also needs each round's medians to point the same way.
    The spreads shown are of the raw samples; the ratio is the geometric mean of the
    rounds' ratios of medians."""
    pairs = [(list(a), list(b)) for a, b in rounds if a and b]
    if not pairs:
        raise ValueError("no round with samples on both sides")
    rel_a: list[float] = []
    rel_b: list[float] = []
    ratios = []
    for a, b in pairs:
        mid = statistics.median(a + b) or 1.0
        rel_a += [x / mid for x in a]
        rel_b += [x / mid for x in b]
        ma, mb = statistics.median(a), statistics.median(b)
        ratios.append(ma / mb if mb else float("inf"))
    raw_a = [x for a, _ in pairs for x in a]
    raw_b = [x for _, b in pairs for x in b]
    judged = change(rel_a, rel_b).verdict
    agree = all(r > 1 for r in ratios) if judged == "faster" else all(r < 1 for r in ratios)
    if judged in ("faster", "slower") and not agree:
        judged = "within noise"
    finite = [r for r in ratios if 0 < r < float("inf")]
    paired = math.exp(statistics.fmean(math.log(r) for r in finite)) if finite else None
    return Change(spread(raw_a), spread(raw_b), judged, len(pairs), paired)


def describe(found: Change, what: str, fmt: Callable[[float], str]) -> str:
    """``step 106 ms (IQR 98-120, 10 samples) → 81 ms (IQR 79-84, 10 samples): 1.31x
    faster, beyond the spread``; "within noise (the spreads overlap)" otherwise."""
    sides = f"{what} {_side(found.before, fmt)} → {_side(found.after, fmt)}"
    if found.rounds > 1:
        sides += f" (alternating, {found.rounds} rounds)"
    if found.verdict == "too few to judge":
        need = max(0, MIN_SAMPLES - min(found.before.n, found.after.n))
        return f"{sides}: too few samples to judge ({need} more per side needed)"
    if found.verdict == "within noise" and found.rounds > 1:
        return f"{sides}: within noise (within each round the spreads overlap, or rounds disagree)"
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

"""Per-rank series over steps: gradient-norm spread, stragglers, memory leaks.

1. collect (each rank, agent/): :class:`dtlab.records.StepTimes` and
   :class:`dtlab.records.StepMemory` every step, gradient norms when recording is on.
2. combine (notebook, here): :func:`grad_norm_spread` per step; :func:`find_stragglers` and
   :func:`find_leaks` compare each rank with the others and return findings only where a
   rank stands out beyond ordinary noise; :func:`memory_trends` gives the fitted lines.
3. present (views/): findings as sentences, series as line plots.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from dtlab.analysis.ranks import label_ranks
from dtlab.records import Finding, StepMemory, StepRecord
from dtlab.records.columns import StepColumns, step_seconds
from dtlab.records.steps import aligned_steps

KiB = 1 << 10
MiB = 1 << 20

# What a rank computes itself; backward also holds DDP's all-reduce, where ranks wait.
COMPUTE_PHASES = ("data", "forward", "optimizer")
SLOWEST_FRACTION = 0.6  # a straggler is the slowest rank in at least this share of steps
# ... and its extra compute is at least this share of a step: 0.2 ms more in a 17 ms step
# is scheduling noise of 4 ranks on 2 cores (seen on a healthy script), not a straggler
STRAGGLER_MIN_SHARE = 0.05

LEAK_T_STAT = 4.0  # slope / its standard error
LEAK_MIN_GROWTH = 4 * MiB  # fitted growth over the window, at least ...
LEAK_RESIDUAL_FACTOR = 3.0  # ... and this many residual standard deviations
LEAK_MIN_DURBIN_WATSON = 1.2  # residuals must not run in long same-sign stretches
LEAK_EXACT_FRACTION = 0.01  # residual std below this share of the growth: a clean line
LEAK_SPREAD_FACTOR = 3.0  # above the others' median slope by this many robust spreads
LEAK_SPREAD_FLOOR = 64 * KiB  # bytes per step: the spread is at least this
_MAD_TO_STD = 1.4826  # median absolute deviation -> standard deviation for normal noise

LEAK_FIX = (
    "something on this rank keeps references across steps (a growing list, stored losses "
    "without .item(), hooks): look for code that runs only on this rank (if rank == 0: "
    "logging, metrics, checkpoint buffers) and tensors kept with their autograd graph; "
    "count the live tensors of two steps on it (gc.get_objects(); tracemalloc does not see "
    "tensor storage) or compare torch.cuda.memory_snapshot()s"
)
SHARED_GROWTH_FIX = (
    "growth on every rank at once is warm-up (allocator caches, autotuning, data loader "
    "workers) if it levels off; if it keeps growing, the training code all ranks run keeps "
    "references across steps (a growing list, stored losses without .item(), hooks)"
)
STRAGGLER_FIX = {
    "data": "its data loading is slow: check num_workers, its disk or network, and "
    "per-rank shard sizes",
    "forward": "its forward pass is slow: check for larger inputs on this rank (uneven "
    "batches or sequence lengths), a slower or shared device, CPU threads and other "
    "processes on its host",
    "optimizer": "its optimizer step is slow: check for extra work on this rank only "
    "(logging, clipping, host syncs) and a slower or shared device",
}


# --- gradient norms -----------------------------------------------------------------------


def grad_norm_spread(records: Mapping[int, Sequence[StepRecord]]) -> list[tuple[int, float]]:
    """``[(step, (max - min) / median)]`` of the ranks' total gradient norms.

    A rank's total norm (``StepRecord.grad_norm``) is the L2 norm over all its gradients.
    Under DDP the spread is 0; without DDP it shows how different the ranks' batches are.
    Steps where some rank recorded no norm are left out.
    """
    spread = []
    for step, at_step in aligned_steps(records):
        if any(rec.grad_norm is None for rec in at_step.values()):
            continue
        totals = np.array([rec.grad_norm for rec in at_step.values()], dtype=float)
        spread.append((step, _relative_range(totals)))
    return spread


def _relative_range(values: np.ndarray) -> float:
    width = float(values.max() - values.min())
    if width == 0:
        return 0.0
    median = float(np.median(values))
    return width / median if median > 0 else math.inf


# --- stragglers ---------------------------------------------------------------------------


def find_stragglers(
    records: Mapping[int, Sequence[StepRecord]],
    *,
    min_steps: int = 5,
    threshold: float = 1.3,
    skip_first: int = 2,
    doubtful: list[int] | None = None,
    table: tuple | None = None,
) -> list[Finding]:
    """Ranks whose own compute (data + forward + optimizer) is slower than the others'.

    Under DDP the other ranks absorb a straggler's delay waiting in the gradient
    all-reduce, so whole step times look alike; compute time does not. The first
    ``skip_first`` common steps (warm-up) are left out and at least ``min_steps`` must
    remain. Rule: a rank's compute / the median over ranks, per step, has a median of at
    least ``threshold``, the rank is the slowest in at least 60% of the steps, and its
    median extra compute is at least STRAGGLER_MIN_SHARE of a step; and it is slower by
    half the threshold in three steps of four (steadily, not by a few slow steps). Ranks
    slower by the median but not steadily are added to ``doubtful`` when it is given.
    ``table``: the records as ``Evidence.table`` holds them (built from ``records`` if
    not given).
    """
    step_numbers, ranks, rows = table if table is not None else _table(records)
    step_numbers, rows = step_numbers[skip_first:], rows[skip_first:]
    if len(step_numbers) < min_steps or len(ranks) < 2:
        return []
    ranks = tuple(int(r) for r in ranks)
    phases = np.stack([rows[p] for p in COMPUTE_PHASES], axis=2)  # steps x ranks x phases
    compute = phases.sum(axis=2)
    median = np.median(compute, axis=1, keepdims=True)
    ratio = compute / np.maximum(median, 1e-12)
    slowest = np.argmax(compute, axis=1)
    backward = rows["backward"]
    excess = compute - median
    step_s = np.median(step_seconds(rows))
    low_ratio = np.percentile(ratio, 25, axis=0)
    median_ratio = np.median(ratio, axis=0)
    median_excess = np.median(excess, axis=0)
    found = []
    for i, rank in enumerate(ranks):
        slowest_in = int(np.sum(slowest == i))
        matters = median_excess[i] >= STRAGGLER_MIN_SHARE * step_s
        # slower in most steps by a clear margin, not a median pulled up by noisy steps
        steady = low_ratio[i] >= 1 + (threshold - 1) / 2
        slow = median_ratio[i] >= threshold and matters
        if slow and slowest_in >= SLOWEST_FRACTION * len(step_numbers) and steady:
            first = int(step_numbers[np.argmax(ratio[:, i] >= threshold)])
            found.append(
                _straggler_finding(rank, i, phases, ratio[:, i], backward, slowest_in, first)
            )
        elif slow and doubtful is not None:  # slower by the median, not steadily: noise?
            doubtful.append(rank)
    return found


def timing_noise(
    records: Mapping[int, Sequence[StepRecord]], skip_first: int = 2, table: tuple | None = None
) -> float:
    """How much a rank's compute time (data + forward + optimizer) varies from step to
    step: the median over ranks of its interquartile range over its median (0.1: +-5%),
    over the steps every rank recorded. On a machine whose cores other processes share
    this grows, and so does what one rank's timings can tell."""
    _, _, rows = table if table is not None else _table(records)
    compute = sum(rows[p] for p in COMPUTE_PHASES)[skip_first:]
    if len(compute) < 4:
        return 0.0
    median = np.median(compute, axis=0)
    q1, q3 = np.percentile(compute, [25, 75], axis=0)
    spreads = ((q3 - q1) / np.where(median > 0, median, 1))[median > 0]
    return float(np.median(spreads)) if len(spreads) else 0.0


def _table(records: Mapping[int, Sequence[StepRecord]]) -> tuple:
    return StepColumns.from_records(records).aligned(tuple(records))


def _straggler_finding(
    rank: int,
    i: int,
    phases: np.ndarray,
    ratio: np.ndarray,
    backward: np.ndarray,
    slowest_in: int,
    first_step: int,
) -> Finding:
    others = [j for j in range(phases.shape[1]) if j != i]
    mine_ms = float(np.median(phases[:, i].sum(axis=1))) * 1000
    others_ms = float(np.median(phases[:, others].sum(axis=2))) * 1000
    excess_ms = {
        phase: float(np.median(phases[:, i, k]) - np.median(phases[:, others, k])) * 1000
        for k, phase in enumerate(COMPUTE_PHASES)
    }
    worst = max(excess_ms, key=excess_ms.__getitem__)
    # What the others spend waiting for it: their backward beyond this rank's.
    wait_ms = float(np.median(np.median(backward[:, others], axis=1) - backward[:, i])) * 1000
    num_steps = phases.shape[0]
    summary = (
        f"{label_ranks([rank])} is a straggler: {mine_ms:.1f} ms of compute per step vs "
        f"{others_ms:.1f} ms on the others ({float(np.median(ratio)):.2f}x the median, slowest "
        f"in {slowest_in} of {num_steps} steps), mostly in {worst}; the others wait about "
        f"{max(wait_ms, 0.0):.1f} ms per step in the gradient all-reduce"
    )
    evidence = {
        "compute_ms": mine_ms,
        "others_compute_ms": others_ms,
        "ratio": float(np.median(ratio)),
        "slowest_in": slowest_in,
        "num_steps": num_steps,
        "excess_ms_by_phase": excess_ms,
        "others_wait_ms": wait_ms,
    }
    fix = f"{STRAGGLER_FIX[worst]}; every other rank waits for it at each all-reduce"
    return Finding("straggler", (rank,), summary, first_step, evidence, fix)


# --- memory leaks -------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryTrend:
    """A least-squares line through one rank's memory over steps."""

    rank: int
    field: str
    first_step: int
    last_step: int
    num_steps: int
    slope: float  # bytes per step
    growth: float  # fitted growth from first_step to last_step, bytes
    t_stat: float  # slope / standard error of the slope (inf for an exact line)
    residual_std: float  # bytes
    durbin_watson: float  # about 2 for noise around the line, near 0 for runs (drift, steps)
    beats_one_jump: bool  # the line fits better than one jump between two flat levels

    @property
    def steady(self) -> bool:
        """Growth spread along the window, not one plateau jump or a drift in runs.

        A near-exact line (residuals under 1% of the growth, e.g. a fixed allocation each
        step) is steady whatever the order of its tiny residuals."""
        if not self.beats_one_jump:
            return False
        exact = self.residual_std < LEAK_EXACT_FRACTION * abs(self.growth)
        return exact or self.durbin_watson >= LEAK_MIN_DURBIN_WATSON

    @property
    def growing(self) -> bool:
        """A slope well beyond noise, and more growth than the noise could fake."""
        return self.t_stat > LEAK_T_STAT and self.growth > max(
            LEAK_MIN_GROWTH, LEAK_RESIDUAL_FACTOR * self.residual_std
        )

    @property
    def significant(self) -> bool:
        """Steady growth well beyond noise: the per-rank part of the leak rule."""
        return self.growing and self.steady


def memory_trends(
    records: Mapping[int, Sequence[StepRecord]],
    *,
    skip_first: int = 3,
    min_steps: int = 8,
    field: str = "rss",
    per_rank: Mapping[int, np.ndarray] | None = None,
) -> dict[int, MemoryTrend]:
    """The fitted line of each rank that has ``min_steps`` values after its first
    ``skip_first`` records (ranks without the field, e.g. cuda_* on CPU, are left out).
    ``per_rank``: the records as ``Evidence.per_rank`` holds them (built if not given)."""
    valid = [f.name for f in fields(StepMemory)]
    if field not in valid:
        raise ValueError(f"field={field!r} is not a StepMemory field; use one of {valid}")
    if per_rank is None:
        per_rank = StepColumns.from_records(records).by_rank()
    trends = {}
    for rank, rows in sorted(per_rank.items()):
        rows = rows[skip_first:]
        values = rows[field].astype(float)
        if field == "rss":  # less what dtlab's own record buffer holds (it grows until full)
            values = values - rows["dtlab_bytes"]
        known = ~np.isnan(values)  # None is nan in the columns (cuda_* on CPU)
        if known.sum() >= max(min_steps, 3):
            trends[rank] = _fit(rank, field, rows["step"][known].astype(float), values[known])
    return trends


def _fit(rank: int, field: str, steps: np.ndarray, values: np.ndarray) -> MemoryTrend:
    x = steps - steps.mean()
    y = values - values.mean()  # centred: squares of raw byte counts lose precision
    sxx = float(np.sum(x * x))
    slope = float(np.sum(x * y)) / sxx if sxx > 0 else 0.0
    residuals = y - slope * x
    residual_ss = float(np.sum(residuals**2))
    n = len(y)
    residual_std = math.sqrt(residual_ss / (n - 2))
    stderr = residual_std / math.sqrt(sxx) if sxx > 0 else math.inf
    if stderr > 0:
        t_stat = slope / stderr
    else:  # an exact line: infinitely sure of its slope, whatever its sign
        t_stat = math.copysign(math.inf, slope) if slope else 0.0
    return MemoryTrend(
        rank=rank,
        field=field,
        first_step=int(steps[0]),
        last_step=int(steps[-1]),
        num_steps=n,
        slope=slope,
        growth=slope * float(steps[-1] - steps[0]),
        t_stat=t_stat,
        residual_std=residual_std,
        durbin_watson=_durbin_watson(residuals, residual_ss),
        beats_one_jump=residual_ss < _best_single_jump_ss(y),
    )


def _durbin_watson(residuals: np.ndarray, residual_ss: float) -> float:
    """Sum of squared successive residual differences / residual sum of squares.

    Plateaus and random drifts leave residuals in long runs of one sign (small values);
    a leak under noise leaves residuals that alternate like the noise (about 2).
    """
    if residual_ss == 0:
        return math.inf  # an exact line: nothing runs
    return float(np.sum(np.diff(residuals) ** 2)) / residual_ss


def _best_single_jump_ss(y: np.ndarray) -> float:
    """Residual sum of squares of the best fit by two flat levels with one jump between.

    Allocators grow in plateaus: one jump, then flat. Such a series can have a
    significant slope, but a single jump explains it at least as well as a line.
    """
    n = len(y)
    k = np.arange(1, n)  # the jump comes before index k
    head_sum, head_sq = np.cumsum(y)[:-1], np.cumsum(y * y)[:-1]
    tail_sum, tail_sq = y.sum() - head_sum, float(np.sum(y * y)) - head_sq
    ss = head_sq - head_sum**2 / k + tail_sq - tail_sum**2 / (n - k)
    return float(max(ss.min(), 0.0))


def _is_outlier(slope: float, others: Sequence[float]) -> bool:
    """Above the other ranks' median slope by several robust spreads (MAD, floored)."""
    if not others:
        return True
    median = float(np.median(others))
    spread = _MAD_TO_STD * float(np.median(np.abs(np.asarray(others) - median)))
    return slope > median + LEAK_SPREAD_FACTOR * max(spread, LEAK_SPREAD_FLOOR)


def find_leaks(
    records: Mapping[int, Sequence[StepRecord]],
    *,
    skip_first: int = 3,
    min_steps: int = 8,
    field: str = "rss",
    per_rank: Mapping[int, np.ndarray] | None = None,
) -> list[Finding]:
    """Ranks whose memory (``StepMemory.<field>``) grows steadily beyond noise and peers.

    Per rank, a least-squares line over the steps after its first ``skip_first`` records
    (at least ``min_steps`` of them). A rank leaks when its trend is ``significant`` (slope
    t-statistic > 4, fitted growth > max(4 MiB, 3 residual std), a line fits better than
    one plateau jump, residual Durbin-Watson >= 1.2) and its slope exceeds the other ranks'
    median slope by 3 robust spreads (MAD x 1.4826, at least 64 KiB per step), so growth
    every rank shares is not pinned on one. When every rank (of two or more) is
    ``growing`` and fits a line better than one jump, one more finding names them all:
    growth shared by every rank.
    """
    trends = memory_trends(
        records, skip_first=skip_first, min_steps=min_steps, field=field, per_rank=per_rank
    )
    found = []
    for rank, trend in trends.items():
        others = [t.slope for r, t in trends.items() if r != rank]
        if trend.significant and _is_outlier(trend.slope, others):
            found.append(_leak_finding(trend, others))
    # Every rank drifting alike is itself evidence, so shared growth skips the runs test.
    if len(trends) >= 2 and all(t.growing and t.beats_one_jump for t in trends.values()):
        found.append(_shared_growth_finding(trends))
    return found


def _leak_evidence(trend: MemoryTrend) -> dict[str, object]:
    return {
        "field": trend.field,
        "slope_bytes_per_step": trend.slope,
        "growth_bytes": trend.growth,
        "t_stat": trend.t_stat,
        "residual_std_bytes": trend.residual_std,
        "num_steps": trend.num_steps,
        "first_step": trend.first_step,
        "last_step": trend.last_step,
    }


def _leak_finding(trend: MemoryTrend, others: Sequence[float]) -> Finding:
    others_text = ""
    evidence = _leak_evidence(trend)
    if others:
        others_slope = float(np.median(others))
        evidence["others_median_slope_bytes_per_step"] = others_slope
        others_text = f"; the other ranks {_mib(others_slope)} per step"
    summary = (
        f"{label_ranks([trend.rank])} leaks memory: {trend.field} grows {_mib(trend.slope)} "
        f"per step ({_mib(trend.growth)} over steps {trend.first_step}-{trend.last_step}, "
        f"t = {trend.t_stat:.1f}){others_text}"
    )
    return Finding("leak", (trend.rank,), summary, trend.first_step, evidence, LEAK_FIX)


def _shared_growth_finding(trends: Mapping[int, MemoryTrend]) -> Finding:
    slopes = {rank: t.slope for rank, t in trends.items()}
    first = min(t.first_step for t in trends.values())
    last = max(t.last_step for t in trends.values())
    field = next(iter(trends.values())).field
    summary = (
        f"{field} grows on every rank ({label_ranks(slopes)}): {_mib(min(slopes.values()))} to "
        f"{_mib(max(slopes.values()))} per step over steps {first}-{last}; the growth is "
        "shared by every rank"
    )
    evidence = {
        "field": field,
        "slope_bytes_per_step_by_rank": slopes,
        "t_stat_by_rank": {rank: t.t_stat for rank, t in trends.items()},
        "growth_bytes_by_rank": {rank: t.growth for rank, t in trends.items()},
        "first_step": first,
        "last_step": last,
    }
    return Finding("leak", tuple(trends), summary, first, evidence, SHARED_GROWTH_FIX)


def _mib(num_bytes: float) -> str:
    """A size in MiB, or KiB where MiB would print 0.00."""
    if abs(num_bytes) < 10 * KiB:
        return f"{num_bytes / KiB:.2f} KiB"
    return f"{num_bytes / MiB:.2f} MiB"

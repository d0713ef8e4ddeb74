"""Ranks that wait for their next batch (part of the ``data_order`` check).

Pure: from each rank's recorded data time per step (``StepRecord.times.data``, the wait
for the loader's next batch) and step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dtlab.analysis.ranks import label_ranks
from dtlab.records import Finding, StepRecord
from dtlab.records.columns import StepColumns, step_seconds

Records = Mapping[int, Sequence[StepRecord]]

DATA_WAIT_FRACTION = 0.3  # median share of a step spent waiting for the next batch
DATA_WAIT_MIN_S = 0.001  # ... and at least this long (tiny steps make big fractions)
DATA_WAIT_SKIP = 2  # first steps start the loader's workers
DATA_WAIT_MIN_STEPS = 3
DATA_WAIT_OUTLIER_SHARE = 0.1  # one rank's data wait beyond the others' by this step share
# ... judged rank against rank over at least this many steps (after the skipped ones), as
# stragglers are: over 3 steps, 4 ranks on 2 busy cores made one rank's waits look steady
DATA_WAIT_OUTLIER_MIN_STEPS = 5
POOLED_FROM = 32  # above this many ranks, "the others" are all ranks (O(ranks), not O(ranks^2))

DATA_WAIT_FIX = (
    "give the DataLoader more num_workers (pin_memory=True, persistent_workers=True), move "
    "decoding/augmentation off the critical path, check that rank's disk or network"
)


def data_wait_findings(
    records: Records, per_rank: Mapping[int, np.ndarray] | None = None
) -> list[Finding]:
    """Ranks that wait for their next batch: for a large share of each step, or (what a
    busy machine hides behind longer steps) far longer than the other ranks do, steadily,
    which every rank then waits through in the gradient all-reduce. ``per_rank``: the
    records as ``Evidence.per_rank`` holds them (built if not given)."""
    if per_rank is None:
        per_rank = StepColumns.from_records(records).by_rank()
    waits = {}  # rank -> its data seconds per step, step totals, step numbers
    for rank, rows in sorted(per_rank.items()):
        rows = rows[DATA_WAIT_SKIP:]
        total = step_seconds(rows)
        rows, total = rows[total > 0], total[total > 0]
        if len(rows) >= DATA_WAIT_MIN_STEPS:
            waits[rank] = (rows["data"], total, [int(s) for s in rows["step"]])
    slow = {}  # rank -> (median fraction, median data seconds, first slow step)
    for rank, (data, total, steps) in waits.items():
        fraction, data_s = float(np.median(data / total)), float(np.median(data))
        if fraction > DATA_WAIT_FRACTION and data_s >= DATA_WAIT_MIN_S:
            first = next(
                s for s, d, t in zip(steps, data, total, strict=True) if d > DATA_WAIT_FRACTION * t
            )
            slow[rank] = (fraction, data_s, first)
    outliers = _data_wait_outliers(waits, skip=set(slow))
    findings = []
    if slow:
        ranks = tuple(slow)
        shares = ", ".join(f"rank {r} {f:.0%} ({d * 1e3:.1f} ms)" for r, (f, d, _) in slow.items())
        what = f"waiting for data takes a large share of each step (median): {shares}"
        if len(slow) == len(records):
            what += ": the input pipeline is the bottleneck"
        evidence: dict[str, object] = {
            "data_fraction": {r: v[0] for r, v in slow.items()},
            "data_seconds": {r: v[1] for r, v in slow.items()},
        }
        step = min(v[2] for v in slow.values())
        findings.append(
            Finding(
                "data_order",
                ranks,
                f"{what}, from step {step}",
                step,
                evidence,
                DATA_WAIT_FIX,
                "warning",
            )
        )
    if outliers:
        ranks = tuple(outliers)
        mine = ", ".join(
            f"rank {r} {d * 1e3:.1f} ms ({f:.0%} of the step)"
            for r, (d, _, f, _) in outliers.items()
        )
        others_ms = max(o for _, o, _, _ in outliers.values()) * 1e3
        step = min(v[3] for v in outliers.values())
        summary = (
            f"{label_ranks(ranks)} wait far longer for data than the other ranks (median "
            f"{mine} vs at most {others_ms:.1f} ms elsewhere, in most steps), from step {step}: "
            "every rank waits for it in the gradient all-reduce"
        )
        evidence = {
            "data_seconds": {r: v[0] for r, v in outliers.items()},
            "others_data_seconds": {r: v[1] for r, v in outliers.items()},
            "data_fraction": {r: v[2] for r, v in outliers.items()},
        }
        findings.append(
            Finding("data_order", ranks, summary, step, evidence, DATA_WAIT_FIX, "warning")
        )
    return findings


def _data_wait_outliers(waits: dict, skip: set[int]) -> dict[int, tuple[float, float, float, int]]:
    """Ranks whose data wait is beyond every other rank's in most steps (its lower quartile
    above the others' upper quartile) by at least DATA_WAIT_OUTLIER_SHARE of the step:
    ``{rank: (median data s, the others' median, median share of the step, first step)}``.
    Judged rank against rank, so that longer steps on a busy machine do not hide it."""
    waits = {r: w for r, w in waits.items() if len(w[0]) >= DATA_WAIT_OUTLIER_MIN_STEPS}
    if len(waits) < 2:
        return {}
    pooled = np.concatenate([d for d, _, _ in waits.values()])
    pooled_median, pooled_high = np.percentile(pooled, [50, 75])
    found = {}
    for rank, (data, total, steps) in waits.items():
        if rank in skip:
            continue
        if len(waits) > POOLED_FROM:
            others_median, others_high = pooled_median, pooled_high  # one rank moves them little
        else:
            others = np.concatenate([d for r, (d, _, _) in waits.items() if r != rank])
            others_median, others_high = np.percentile(others, [50, 75])
        low = np.percentile(data, 25)
        gap = float(np.median(data)) - float(others_median)
        if low > others_high and gap >= DATA_WAIT_OUTLIER_SHARE * float(np.median(total)):
            limit = others_high + DATA_WAIT_OUTLIER_SHARE * total
            first = next(
                (s for s, d, lim in zip(steps, data, limit, strict=True) if d > lim), steps[0]
            )
            share = float(np.median(data / total))
            found[rank] = (float(np.median(data)), float(others_median), share, first)
    return found

"""Ranks that wait for their next batch (part of the ``data_order`` check).

Pure: from each rank's recorded data time per step (``StepRecord.times.data``, the wait
for the loader's next batch) and step time, over the steps every rank recorded.
"""

from __future__ import annotations

import warnings
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


def data_wait_findings(records: Records, table: tuple | None = None) -> list[Finding]:
    """Ranks that wait for their next batch: for a large share of each step, or (what a
    busy machine hides behind longer steps) far longer than the other ranks do, steadily,
    which every rank then waits through in the gradient all-reduce. ``table``: the steps
    every rank recorded, as ``Evidence.table`` holds them (built if not given); judged as
    steps x ranks matrices, one pass each, whatever the number of ranks."""
    if table is None:
        table = StepColumns.from_records(records).aligned(tuple(records))
    numbers, ranks, rows = table
    rows, numbers = rows[DATA_WAIT_SKIP:], numbers[DATA_WAIT_SKIP:]
    if not len(numbers):
        return []
    data = np.ascontiguousarray(rows["data"])  # steps x ranks
    total = step_seconds(rows)
    valid = total > 0
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank with no valid step: nan
        fraction = np.nanmedian(np.where(valid, data / total, np.nan), axis=0)
        data_s = np.nanmedian(np.where(valid, data, np.nan), axis=0)
    enough = valid.sum(axis=0) >= DATA_WAIT_MIN_STEPS
    slow_at = enough & (fraction > DATA_WAIT_FRACTION) & (data_s >= DATA_WAIT_MIN_S)
    slow = {}  # rank -> (median fraction, median data seconds, first slow step)
    for j in np.flatnonzero(slow_at):
        first = numbers[np.argmax(valid[:, j] & (data[:, j] > DATA_WAIT_FRACTION * total[:, j]))]
        slow[int(ranks[j])] = (float(fraction[j]), float(data_s[j]), int(first))
    outliers = _data_wait_outliers(numbers, ranks, data, total, valid, skip=slow_at)
    findings = []
    if slow:
        slow_ranks = tuple(slow)
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
                slow_ranks,
                f"{what}, from step {step}",
                step,
                evidence,
                DATA_WAIT_FIX,
                "warning",
            )
        )
    if outliers:
        out_ranks = tuple(outliers)
        mine = ", ".join(
            f"rank {r} {d * 1e3:.1f} ms ({f:.0%} of the step)"
            for r, (d, _, f, _) in outliers.items()
        )
        others_ms = max(o for _, o, _, _ in outliers.values()) * 1e3
        step = min(v[3] for v in outliers.values())
        summary = (
            f"{label_ranks(out_ranks)} wait far longer for data than the other ranks (median "
            f"{mine} vs at most {others_ms:.1f} ms elsewhere, in most steps), from step {step}: "
            "every rank waits for it in the gradient all-reduce"
        )
        evidence = {
            "data_seconds": {r: v[0] for r, v in outliers.items()},
            "others_data_seconds": {r: v[1] for r, v in outliers.items()},
            "data_fraction": {r: v[2] for r, v in outliers.items()},
        }
        findings.append(
            Finding("data_order", out_ranks, summary, step, evidence, DATA_WAIT_FIX, "warning")
        )
    return findings


def _data_wait_outliers(
    numbers: np.ndarray,
    ranks: np.ndarray,
    data: np.ndarray,
    total: np.ndarray,
    valid: np.ndarray,
    skip: np.ndarray,
) -> dict[int, tuple[float, float, float, int]]:
    """Ranks whose data wait is beyond every other rank's in most steps (its lower quartile
    above the others' upper quartile) by at least DATA_WAIT_OUTLIER_SHARE of the step:
    ``{rank: (median data s, the others' median, median share of the step, first step)}``.
    Judged rank against rank, so that longer steps on a busy machine do not hide it; only
    ranks with DATA_WAIT_OUTLIER_MIN_STEPS valid steps take part. ``data``, ``total``,
    ``valid``: steps x ranks; ``skip``: ranks already named as slow."""
    judged = valid.sum(axis=0) >= DATA_WAIT_OUTLIER_MIN_STEPS
    if judged.sum() < 2:
        return {}
    waits = np.where(valid, data, np.nan)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        low, median = np.nanpercentile(waits, [25, 50], axis=0)
        step_median = np.nanmedian(np.where(valid, total, np.nan), axis=0)
        share = np.nanmedian(np.where(valid, data / total, np.nan), axis=0)
    pooled = waits[:, judged][valid[:, judged]]
    pooled_median, pooled_high = np.percentile(pooled, [50, 75])
    found = {}
    for j in np.flatnonzero(judged & ~skip):
        if judged.sum() > POOLED_FROM:
            others_median, others_high = pooled_median, pooled_high  # one rank moves them little
        else:
            others = judged.copy()
            others[j] = False
            others_median, others_high = np.percentile(waits[:, others][valid[:, others]], [50, 75])
        gap = float(median[j]) - float(others_median)
        if low[j] > others_high and gap >= DATA_WAIT_OUTLIER_SHARE * float(step_median[j]):
            limit = others_high + DATA_WAIT_OUTLIER_SHARE * total[:, j]
            beyond = valid[:, j] & (data[:, j] > limit)
            first = numbers[np.argmax(beyond if beyond.any() else valid[:, j])]
            found[int(ranks[j])] = (
                float(median[j]),
                float(others_median),
                float(share[j]),
                int(first),
            )
    return found

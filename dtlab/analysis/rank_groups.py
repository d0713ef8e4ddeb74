"""Many ranks as one band and a few outliers: what a figure draws past ``GROUP_ABOVE`` ranks.

A line per rank reads well for 8 ranks and not at all for 512 (and weighs megabytes in a
notebook). Past ``GROUP_ABOVE`` ranks, a series of every rank is drawn as the band between
the lowest and highest rank at each step, their median, and the few ranks that stand out:
any with a non-finite value, then those farthest from the median in most steps, measured in
robust spreads (the median absolute deviation across ranks at each step).

Pure: ``rank_bands(steps, ranks, values)`` on a steps x ranks matrix (``StepColumns.aligned``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

GROUP_ABOVE = 16  # more ranks than this: a band and outliers, not a line each
MAX_OUTLIERS = 4
OUTLIER_SCORE = 3.0  # robust spreads from the median, in at least a quarter of the steps
_MAD_TO_STD = 1.4826


@dataclass(frozen=True)
class RankBands:
    """A series over steps for many ranks, summed up."""

    steps: np.ndarray
    low: np.ndarray  # the lowest rank's value at each step
    median: np.ndarray
    high: np.ndarray
    outliers: dict[int, np.ndarray]  # rank -> its own series, most outlying first
    num_ranks: int


def rank_bands(
    steps: np.ndarray, ranks: np.ndarray, values: np.ndarray, max_outliers: int = MAX_OUTLIERS
) -> RankBands:
    """``values``: steps x ranks (nan where a rank has no value)."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.where(np.isfinite(values), values, np.nan)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # steps or ranks with no value
        low, median, high = (
            np.nanmin(finite, axis=1),
            np.nanmedian(finite, axis=1),
            np.nanmax(finite, axis=1),
        )
        deviation = np.abs(finite - median[:, None])
        spread = _MAD_TO_STD * np.nanmedian(deviation, axis=1)
        floor = np.maximum(1e-6 * np.abs(median), 1e-12)
        spread = np.where(np.isnan(spread), floor, np.maximum(spread, floor))
        score = np.nanpercentile(deviation / spread[:, None], 75, axis=0)
    broken = [j for j in range(values.shape[1]) if np.any(np.isinf(values[:, j]))]
    broken += [j for j in range(values.shape[1]) if _has_nan_among_values(values[:, j])]
    chosen = list(dict.fromkeys(broken))[:max_outliers]
    score = np.where(np.isnan(score), -1.0, score)
    for j in np.argsort(-score, kind="stable"):
        if len(chosen) >= max_outliers or score[j] < OUTLIER_SCORE:
            break
        if j not in chosen:
            chosen.append(int(j))
    outliers = {int(ranks[j]): values[:, j] for j in chosen}
    return RankBands(np.asarray(steps), low, median, high, outliers, len(ranks))


def _has_nan_among_values(series: np.ndarray) -> bool:
    """A NaN after a finite value: the series went non-finite (not merely unrecorded)."""
    seen = np.isfinite(series)
    return bool(seen.any() and np.isnan(series[np.argmax(seen) :]).any())


__all__ = ["GROUP_ABOVE", "RankBands", "rank_bands"]

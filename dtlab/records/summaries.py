"""One row per step across every rank: what a Trace keeps of the steps its window left.

A Trace holds the last ``window`` steps of every rank in memory (:mod:`dtlab.records.trace`);
the older ones are in its run folder. So that the doctor and a reader still see the whole
run without reading it back, each step that leaves the window leaves a summary: how many
ranks recorded it, the spread of step time, loss, gradient norm and memory with the rank at
the top, whether the ranks' gradient, parameter and buffer fingerprints agreed (one bit per
kind instead of a fingerprint per rank) and which rank stood apart when they did not, and
how many non-finite values were seen. ~130 bytes a step whatever the number of ranks:
100,000 steps take 13 MB.
"""

from __future__ import annotations

import numpy as np

from dtlab.records.row import TIME_FIELDS

FINGERPRINTS = ("grad", "param", "buffer")

SUMMARY = np.dtype(
    [
        ("step", np.int64),
        ("ranks", np.int32),  # how many ranks recorded the step
        ("step_s_min", np.float64),
        ("step_s_max", np.float64),
        ("step_s_max_rank", np.int32),
        ("loss_min", np.float64),
        ("loss_max", np.float64),
        ("nonfinite_loss_ranks", np.int32),  # ranks whose loss was nan or inf
        ("grad_norm_max", np.float64),
        ("grad_norm_max_rank", np.int32),
        ("rss_max", np.int64),
        ("rss_max_rank", np.int32),
        ("num_nonfinite", np.int64),  # non-finite gradient values, every rank together
        # 1: every rank that recorded one had the same; 0: they differed; -1: none recorded
        ("grad_agree", np.int8),
        ("param_agree", np.int8),
        ("buffer_agree", np.int8),
        # where they differed, the rank holding a value fewest ranks hold (-1: none)
        ("grad_odd_rank", np.int32),
        ("param_odd_rank", np.int32),
        ("buffer_odd_rank", np.int32),
    ]
)


def _argmax_by_group(values: np.ndarray, starts: np.ndarray, top: np.ndarray) -> np.ndarray:
    """For each group (rows ``starts[g]`` up to the next start), the first row whose value is
    the group's ``top``."""
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(values)]))
    hit = np.flatnonzero(values == top[group])
    first = np.full(len(starts), -1, dtype=np.int64)
    # the first hit of each group: hits are in row order, so reversed assignment keeps it
    first[group[hit[::-1]]] = hit[::-1]
    return first


def _odd_rank(fingerprints: np.ndarray, ranks: np.ndarray) -> int:
    """The rank whose fingerprint fewest ranks share (the lowest such rank)."""
    _, inverse, counts = np.unique(fingerprints, return_inverse=True, return_counts=True)
    rarest = counts[inverse] == counts.min()
    return int(ranks[np.flatnonzero(rarest)[0]])


def summarize(rows: np.ndarray) -> np.ndarray:
    """One SUMMARY row per step of ``rows`` (ROW, sorted by step then rank)."""
    if not len(rows):
        return np.zeros(0, dtype=SUMMARY)
    steps = rows["step"]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    out = np.zeros(len(starts), dtype=SUMMARY)
    out["step"] = steps[starts]
    out["ranks"] = np.diff(np.r_[starts, len(rows)])
    ranks = rows["rank"]

    step_s = np.zeros(len(rows), dtype=np.float64)
    for name in TIME_FIELDS:
        step_s += rows[name]
    out["step_s_min"] = np.minimum.reduceat(step_s, starts)
    out["step_s_max"] = np.maximum.reduceat(step_s, starts)
    out["step_s_max_rank"] = ranks[_argmax_by_group(step_s, starts, out["step_s_max"])]

    loss = rows["loss"]
    finite = np.isfinite(loss)
    out["loss_min"] = np.minimum.reduceat(np.where(finite, loss, np.inf), starts)
    out["loss_max"] = np.maximum.reduceat(np.where(finite, loss, -np.inf), starts)
    none = ~np.logical_or.reduceat(finite, starts)
    out["loss_min"][none] = out["loss_max"][none] = np.nan
    out["nonfinite_loss_ranks"] = np.add.reduceat((~finite).astype(np.int32), starts)

    norm = np.nan_to_num(rows["grad_norm"], nan=-np.inf)
    out["grad_norm_max"] = np.maximum.reduceat(norm, starts)
    at = _argmax_by_group(norm, starts, out["grad_norm_max"])
    out["grad_norm_max_rank"] = np.where(np.isfinite(out["grad_norm_max"]), ranks[at], -1)
    out["grad_norm_max"][~np.isfinite(out["grad_norm_max"])] = np.nan

    out["rss_max"] = np.maximum.reduceat(rows["rss"], starts)
    out["rss_max_rank"] = ranks[_argmax_by_group(rows["rss"], starts, out["rss_max"])]
    out["num_nonfinite"] = np.add.reduceat(rows["num_nonfinite"], starts)

    for kind in FINGERPRINTS:
        fp = rows[f"{kind}_fingerprint"]
        seen = fp != 0
        low = np.minimum.reduceat(np.where(seen, fp, np.iinfo(np.uint64).max), starts)
        high = np.maximum.reduceat(fp, starts)  # 0 where none was recorded
        any_seen = np.logical_or.reduceat(seen, starts)
        out[f"{kind}_agree"] = np.where(any_seen, (low == high).astype(np.int8), -1)
        out[f"{kind}_odd_rank"] = -1
        ends = np.r_[starts[1:], len(rows)]
        for g in np.flatnonzero(out[f"{kind}_agree"] == 0):
            part = slice(starts[g], ends[g])
            mine = seen[part]
            out[f"{kind}_odd_rank"][g] = _odd_rank(fp[part][mine], ranks[part][mine])
    return out


class Summaries:
    """SUMMARY rows of consecutive steps, grown as a Trace's window moves on."""

    def __init__(self) -> None:
        self._rows = np.zeros(0, dtype=SUMMARY)
        self._size = 0

    def add(self, rows: np.ndarray) -> None:
        """The summaries of ``rows`` (ROW, by step then rank), after the ones held."""
        new = summarize(rows)
        if self._size:
            new = new[new["step"] > self._rows["step"][self._size - 1]]
        size = self._size + len(new)
        if size > len(self._rows):
            grown = np.zeros(max(size, 2 * len(self._rows), 1024), dtype=SUMMARY)
            grown[: self._size] = self._rows[: self._size]
            self._rows = grown
        self._rows[self._size : size] = new
        self._size = size

    def rows(self) -> np.ndarray:
        return self._rows[: self._size]

    def __len__(self) -> int:
        return self._size

    @property
    def last_step(self) -> int:
        return int(self._rows["step"][self._size - 1]) if self._size else 0

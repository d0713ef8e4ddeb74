"""Where data-parallel ranks stop agreeing bit for bit.

Under DDP every rank holds the same gradients after the all-reduce and so the same
parameters after the optimizer step, to the last bit. The first (step, parameter) where
they do not is where a synchronisation bug starts; everything after it is consequence.

1. collect (each rank, agent/): fingerprints of every gradient after the all-reduce and of
   every parameter after the step, in :class:`dtlab.records.StepRecord`.
2. combine (notebook, here): :func:`find_divergence` scans steps in order for the first
   disagreement; :func:`divergence_findings` turns the grad and param scans into findings;
   :func:`deviation_matrix` gives one step as a rank x parameter picture;
   :func:`tensor_diff` measures two tensors fetched from two ranks.
3. present (views/): a sentence per finding, a heatmap of the deviation matrix.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.trends import aligned_steps
from dtlab.records import Finding, StepRecord
from dtlab.records.columns import StepColumns

FINGERPRINT_FIELDS = {"grad": "grad_fingerprints", "param": "param_fingerprints"}
_WHAT = {"grad": "gradients", "param": "parameters"}
TINY = 1e-30  # floor for a median norm we divide by
MIN_DEVIATION = 1e-12  # a bitwise difference with equal norms must still show in a heatmap

GRAD_FIX = (
    "gradients are not synchronised: wrap the model in DistributedDataParallel or all_reduce "
    "the gradients before the optimizer step; check no_sync() contexts, "
    "find_unused_parameters, and parameters whose gradients are changed after the all-reduce"
)
PARAM_FIX = (
    "parameters were changed outside the optimizer step on these ranks, or the initial "
    "broadcast was skipped: broadcast parameters from rank 0 (or wrap the model in "
    "DistributedDataParallel, which does) and look for in-place edits of weights on some ranks"
)


@dataclass(frozen=True)
class Divergence:
    """The first (step, parameter) where ranks' fingerprints are not all equal.

    ``groups`` are ranks with equal fingerprints, largest first; on a tie in size the group
    holding the lowest rank comes first (rank 0 is usually the one that broadcast the
    initial parameters), so ``majority`` is ``groups[0]`` even when it is no majority.
    """

    kind: str  # "grad" or "param"
    step: int
    param_index: int
    param: str
    groups: tuple[tuple[int, ...], ...]
    majority: tuple[int, ...]
    outliers: tuple[int, ...]
    num_params_differing: int  # at this step
    num_params: int
    norm_by_rank: dict[int, float]  # gradient L2 norm of this parameter at this step
    rel_norm_diff: float  # max over outliers of |norm - majority median| / median; nan: unknown

    @property
    def is_tie(self) -> bool:
        """True when no group is larger than all the others."""
        return len(self.groups) > 1 and len(self.groups[0]) == len(self.groups[1])

    @property
    def has_majority(self) -> bool:
        """True when one group holds more than half of the ranks: the others are odd."""
        return 2 * len(self.groups[0]) > sum(len(g) for g in self.groups)

    @property
    def named_ranks(self) -> tuple[int, ...]:
        """The ranks a finding names: the odd ones out, or every rank when there is no
        majority to tell which side is right."""
        if self.has_majority:
            return self.outliers
        return tuple(sorted(r for g in self.groups for r in g))

    @property
    def summary(self) -> str:
        """One sentence: what diverges, since when, where, on which ranks; numbers are
        phrased against what they are compared with, and without a majority every group
        is listed and none is taken as right."""
        head = f"{_WHAT[self.kind]} diverge from step {self.step}: {self.param}"
        count = f"{self.num_params_differing} of {self.num_params} parameters differ"
        if not self.has_majority:
            split = " | ".join(label_ranks(g) for g in self.groups)
            return f"{head} splits {split}, with no majority to tell which is right; " + (
                f"{count}{self._norms_by_group()}"
            )
        where = (
            f"{head} differs on {label_ranks(self.outliers)} from the copy "
            f"{label_ranks(self.majority)} hold"
        )
        norm = ""
        if math.isfinite(self.rel_norm_diff) and self.rel_norm_diff > 0:
            norm = (
                f"; its gradient norm there differs by {self.rel_norm_diff:.3g}x from "
                f"{label_ranks(self.majority)}'s"
            )
        return f"{where}; {count}{norm}"

    def _norms_by_group(self) -> str:
        parts = []
        for group in self.groups:
            norms = [self.norm_by_rank[r] for r in group if r in self.norm_by_rank]
            norms = [n for n in norms if math.isfinite(n)]
            if norms:
                parts.append(f"{statistics.median(norms):.4g} on {label_ranks(group)}")
        return f"; its gradient norm: {', '.join(parts)}" if len(parts) > 1 else ""


def find_divergence(
    records: Mapping[int, Sequence[StepRecord]],
    names: Sequence[str],
    *,
    kind: str = "grad",
) -> Divergence | None:
    """The first step, and first parameter in module order, where ranks' fingerprints differ.

    ``kind="grad"`` compares gradients after the all-reduce, ``kind="param"`` parameters
    after the step. Only steps every rank recorded with fingerprints on are compared (a
    rank that skipped recording at a step cannot disagree there). ``names`` label the
    parameters (``Trace.param_names``); beyond them a parameter is called ``#index``.
    """
    if kind not in FINGERPRINT_FIELDS:
        raise ValueError(f"kind={kind!r}: use one of {sorted(FINGERPRINT_FIELDS)}")
    field = FINGERPRINT_FIELDS[kind]
    for step, at_step in aligned_steps(records):
        prints = {rank: getattr(rec, field) for rank, rec in at_step.items()}
        if any(not p for p in prints.values()) or len(set(prints.values())) == 1:
            continue  # recording off on some rank, or all equal: the common fast path
        found = _divergence_at(kind, step, at_step, prints, names)
        if found is not None:
            return found
    return None


SUMMARY_FIELDS = {
    "grad": "grad_fingerprint",
    "param": "param_fingerprint",
    "buffer": "buffer_fingerprint",
}


def first_divergent_step(
    records: Mapping[int, Sequence[StepRecord]], *, kind: str = "grad", table: tuple | None = None
) -> int | None:
    """The first step where the ranks' whole-step fingerprints differ, from summaries
    (``table``: the same as ``Evidence.table`` holds them, built from ``records`` if not
    given). Summaries carry one fingerprint per step; the per-parameter record of that
    step (kept on the ranks) then tells :func:`find_divergence` which parameter it is.
    """
    if kind not in SUMMARY_FIELDS:
        raise ValueError(f"kind={kind!r}: use one of {sorted(SUMMARY_FIELDS)}")
    if table is None:
        table = StepColumns.from_records(records).aligned(tuple(records))
    steps, _, rows = table
    prints = rows[SUMMARY_FIELDS[kind]]  # steps x ranks
    if not len(steps):
        return None
    differs = (prints != prints[:, :1]).any(axis=1) & (prints != 0).all(axis=1)
    hits = np.flatnonzero(differs)
    return int(steps[hits[0]]) if len(hits) else None


def _divergence_at(
    kind: str,
    step: int,
    at_step: Mapping[int, StepRecord],
    prints: Mapping[int, tuple[int, ...]],
    names: Sequence[str],
) -> Divergence | None:
    # Tuples of different lengths mean different models; consistency checks report that.
    num_params = min(len(p) for p in prints.values())
    differing = [i for i in range(num_params) if len({p[i] for p in prints.values()}) > 1]
    if not differing:
        return None
    index = differing[0]
    groups = rank_groups({rank: p[index] for rank, p in prints.items()})
    majority = groups[0][0]
    outliers = tuple(sorted(r for ranks, _ in groups[1:] for r in ranks))
    norms = {rank: _norm(rec, index) for rank, rec in at_step.items()}
    return Divergence(
        kind=kind,
        step=step,
        param_index=index,
        param=names[index] if index < len(names) else f"#{index}",
        groups=tuple(ranks for ranks, _ in groups),
        majority=majority,
        outliers=outliers,
        num_params_differing=len(differing),
        num_params=num_params,
        norm_by_rank=norms,
        rel_norm_diff=_rel_norm_diff(norms, majority, outliers),
    )


def rank_groups(by_rank: Mapping[int, Hashable]) -> list[tuple[tuple[int, ...], Hashable]]:
    """``(ranks, value)`` groups, largest first; equal sizes keep the lowest rank first."""
    # group_by_value orders by first rank and sorted() is stable, so ties stay in that order.
    return sorted(group_by_value(by_rank), key=lambda group: -len(group[0]))


def _norm(record: StepRecord, index: int) -> float:
    return float(record.grad_norms[index]) if index < len(record.grad_norms) else math.nan


def _rel_norm_diff(
    norms: Mapping[int, float], majority: Sequence[int], outliers: Sequence[int]
) -> float:
    reference = [norms[r] for r in majority if math.isfinite(norms[r])]
    others = [norms[r] for r in outliers if math.isfinite(norms[r])]
    if not reference or not others:
        return math.nan
    median = statistics.median(reference)
    return max(abs(n - median) for n in others) / max(abs(median), TINY)


def divergence_findings(
    records: Mapping[int, Sequence[StepRecord]], names: Sequence[str]
) -> list[Finding]:
    """Findings for the first gradient divergence and the first parameter divergence.

    Parameters that differ while the gradients agree point at the parameters themselves
    (skipped broadcast, edits outside the step); after a gradient divergence they are its
    consequence, and the fix says so.
    """
    grad = find_divergence(records, names, kind="grad")
    param = find_divergence(records, names, kind="param")
    found = []
    if grad is not None:
        found.append(_finding(grad, GRAD_FIX))
    if param is not None:
        fix = (
            f"follows from the gradient divergence at step {grad.step}: fix that first"
            if grad is not None and grad.step <= param.step
            else PARAM_FIX
        )
        found.append(_finding(param, fix))
    return found


def _finding(d: Divergence, fix: str) -> Finding:
    evidence = {
        "fingerprints": d.kind,
        "param": d.param,
        "param_index": d.param_index,
        "groups": d.groups,
        "majority": d.majority,
        "num_params_differing": d.num_params_differing,
        "num_params": d.num_params,
        "norm_by_rank": dict(d.norm_by_rank),
        "rel_norm_diff": d.rel_norm_diff,
    }
    return Finding(
        kind="divergence",
        ranks=d.named_ranks,
        summary=d.summary,
        step=d.step,
        evidence=evidence,
        fix=fix,
        severity="error",  # data-parallel replicas that differ train a different model
    )


def deviation_matrix(
    records_at_step: Mapping[int, StepRecord],
) -> tuple[tuple[int, ...], np.ndarray]:
    """``(ranks, matrix)``: each rank's gradient deviation from the rank majority at one step.

    ``matrix[i, j]`` is 0.0 where rank ``ranks[i]`` has the majority's fingerprint for
    parameter ``j``; elsewhere ``|norm - median majority norm| / median``, at least
    ``MIN_DEVIATION`` so that a bitwise difference with an equal norm still shows, and
    ``inf`` where either norm is not finite (no gradient, or nan/inf in it).
    """
    ranks = tuple(sorted(records_at_step))
    prints = [records_at_step[r].grad_fingerprints for r in ranks]
    num_params = min((len(p) for p in prints), default=0)
    matrix = np.zeros((len(ranks), num_params))
    for j in range(num_params):
        groups = rank_groups({r: p[j] for r, p in zip(ranks, prints, strict=True)})
        if len(groups) == 1:
            continue
        majority = groups[0][0]
        reference = [_norm(records_at_step[r], j) for r in majority]
        median = statistics.median(reference) if all(map(math.isfinite, reference)) else math.nan
        for i, rank in enumerate(ranks):
            if rank not in majority:
                norm = _norm(records_at_step[rank], j)
                rel = abs(norm - median) / max(abs(median), TINY)
                matrix[i, j] = max(rel, MIN_DEVIATION) if math.isfinite(rel) else math.inf
    return ranks, matrix


# --- two tensors from two ranks ------------------------------------------------------------

_SAME_WIDTH_INT = {
    np.dtype(np.float16): np.int16,
    np.dtype(np.float32): np.int32,
    np.dtype(np.float64): np.int64,
}


@dataclass(frozen=True)
class TensorDiff:
    """How far two same-shape float tensors are apart.

    ``num_differing`` and ``first_index`` (flat, C order) count bitwise differences, which is
    what fingerprints see: -0.0 against 0.0 is one differing element at 0 ulps and 0 abs.
    A NaN against a NaN is 0 apart; a NaN against a number is ``inf`` abs and rel apart.
    """

    shape: tuple[int, ...]
    dtype: str
    num_elements: int
    num_differing: int
    first_index: int | None
    max_abs: float
    max_rel: float  # relative to |a|, floored at the dtype's smallest normal number
    max_ulps: int  # units in the last place: how many representable floats lie between

    @property
    def identical(self) -> bool:
        return self.num_differing == 0

    @property
    def summary(self) -> str:
        if self.identical:
            return f"identical ({self.num_elements} elements of {self.dtype})"
        return (
            f"{self.num_differing} of {self.num_elements} elements differ (first at flat index "
            f"{self.first_index}): max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, "
            f"max {self.max_ulps} ulps"
        )


def tensor_diff(a: np.ndarray, b: np.ndarray) -> TensorDiff:
    """Compare two float arrays of one shape and dtype (float16, float32 or float64).

    bfloat16 has no numpy dtype: compare such tensors as float32 (exact), keeping in mind
    that the ulps are then float32 ulps.
    """
    a, b = np.asarray(a), np.asarray(b)
    _check_comparable(a, b)
    flat_a, flat_b = a.ravel(), b.ravel()  # 1-d: flat indices, and array (not scalar) math
    int_type = _SAME_WIDTH_INT[a.dtype]
    bits_differ = flat_a.view(int_type) != flat_b.view(int_type)
    differing = np.flatnonzero(bits_differ)
    both_nan = np.isnan(flat_a) & np.isnan(flat_b)
    same_value = (flat_a == flat_b) | both_nan  # also covers inf == inf and -0.0 == 0.0
    wide_a, wide_b = flat_a.astype(np.float64), flat_b.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf and NaN arithmetic are handled below
        abs_diff = np.where(same_value, 0.0, np.abs(wide_a - wide_b))
        abs_diff[np.isnan(abs_diff)] = math.inf  # NaN against a number, inf against -inf
        floor = float(np.finfo(a.dtype).tiny)
        rel_diff = np.where(abs_diff == 0, 0.0, abs_diff / np.fmax(np.abs(wide_a), floor))
    rel_diff[np.isnan(rel_diff)] = math.inf  # inf apart from an infinite a
    ulps = np.where(same_value, np.uint64(0), _ulp_distance(flat_a, flat_b))
    return TensorDiff(
        shape=tuple(a.shape),
        dtype=str(a.dtype),
        num_elements=int(a.size),
        num_differing=int(differing.size),
        first_index=int(differing[0]) if differing.size else None,
        max_abs=float(abs_diff.max(initial=0.0)),
        max_rel=float(rel_diff.max(initial=0.0)),
        max_ulps=int(ulps.max(initial=0)),
    )


def _check_comparable(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"tensor_diff needs one shape: a is {a.shape}, b is {b.shape}")
    if a.dtype != b.dtype:
        raise ValueError(
            f"tensor_diff needs one dtype: a is {a.dtype}, b is {b.dtype}; "
            "cast one (e.g. b.astype(a.dtype)) if that is what you mean to compare"
        )
    if a.dtype not in _SAME_WIDTH_INT:
        raise ValueError(
            f"tensor_diff compares float16, float32 or float64 arrays, not {a.dtype}; "
            "convert bfloat16 tensors with .float() first"
        )


def _ordered_bits(x: np.ndarray) -> np.ndarray:
    """Float bits as int64 in the floats' order: neighbouring floats differ by 1."""
    signed = x.view(_SAME_WIDTH_INT[x.dtype])
    wide = signed.astype(np.int64)
    # Floats are sign-magnitude: map negatives so they count down from zero (-0.0 -> 0).
    # For int64 the result stays within [min + 1, 0], so nothing overflows.
    return np.where(wide < 0, np.iinfo(signed.dtype).min - wide, wide)


def _ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ordered_a, ordered_b = _ordered_bits(a), _ordered_bits(b)
    high, low = np.maximum(ordered_a, ordered_b), np.minimum(ordered_a, ordered_b)
    # The true distance is below 2**64, so unsigned wrap-around subtraction is exact.
    return high.view(np.uint64) - low.view(np.uint64)

"""``%dt_doctor`` checks of the training loop: numerics, learning rate (data order is in
:mod:`dtlab.analysis.checks_data`).

1. collect (each rank, agent/): a :class:`dtlab.records.StepRecord` summary every step
   (sample indices, epoch, loss, LR, GradScaler scale, phase times).
2. combine (notebook, here): each ``check_*(evidence) -> CheckResult`` compares the ranks'
   records and returns findings only for what a healthy DDP job never shows.
3. present (views/): ``%dt_doctor`` prints the findings, or with ``--explain`` why it passed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence, Set

import numpy as np

from dtlab.analysis.checks_data import check_data_order
from dtlab.analysis.checks_deepspeed import fp16_scaler
from dtlab.analysis.evidence import shape_of
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding, StepRecord
from dtlab.records.row import NULLABLE

Records = Mapping[int, Sequence[StepRecord]]

# A dynamic loss scaler (GradScaler, DeepSpeed's fp16 one) skips the step and halves its
# scale on each overflow, and doubles it after a clean window (GradScaler's growth_interval
# 2000, DeepSpeed's loss_scale_window 1000): once it found its level, a healthy one skips
# about once per window (a run of 1, or 2 with DeepSpeed's hysteresis). So, per rank:
MAX_SKIP_RUN = 2  # more skipped steps in a row than this ...
# ... unless the scaler is calibrating: coming down from its initial scale at the start,
# it may skip in the first 10 steps from 2**16, both scalers' default (10 halvings leave
# 64; a scaler that must go lower has gradients over 65504/64 ~ 1e3), plus one step for
# each power of 2 a higher initial scale adds (DeepSpeed's initial_scale_power) and its
# hysteresis less one
SCALER_WARMUP_STEPS = 10
DEFAULT_INITIAL_SCALE = 2.0**16
# more than half of any 20 steps skipped (calibration aside), however short the runs: over
# 50x the rate of a healthy scaler even with a loss_scale_window as short as 100
SKIP_WINDOW = 20
# DeepSpeed: the scale at its floor (fp16.min_loss_scale) on 3 steps. It gets there only by
# overflows and leaves only after a clean loss_scale_window (1000 steps), so it stays there:
# gradients scaled by the floor alone (fp16 flushes small ones to 0), and under ZeRO the
# next overflow ends the run ("Current loss scale already at minimum")
FLOOR_STEPS = 3
MIN_SCALE = 1.0  # a scale under 1 shrinks gradients: the overflow is not the scaler's
HISTORY_ENTRIES = 32  # of the skipped runs and scale changes a finding carries
LR_REL_TOL = 1e-12
_SCALE_IS_NONE = 1 << NULLABLE.index("scale")  # the row's nulls bit: no scaler

NONFINITE_REMEDY = (
    "with fp16 use torch.amp.GradScaler (it skips overflowing steps); else lower the LR "
    "(or add warm-up / clipping)"
)
NONFINITE_FIX = (
    "find the module whose output turns inf/nan first: dt.watch_modules() or %dt_run --until "
    f"nonfinite names it; {NONFINITE_REMEDY}"
)
SCALER_FIX = (
    "gradients overflow even at a small scale, so they are inf/nan before scaling: find the "
    "module that makes them and run it in fp32 (autocast(enabled=False)), or lower the LR"
)
DEEPSPEED_SCALER_FIX = (
    'each step DeepSpeed logs as "OVERFLOW! Skipping step" made no update: the fp16 gradients '
    "overflow even at a small scale, so they are inf/nan before scaling. Find the module that "
    "makes them (dt.watch_modules() or %dt_run --until nonfinite names it) and keep it in fp32, "
    'or lower the LR / add warm-up or gradient_clipping, or train in bf16 ("bf16": {"enabled": '
    "true} needs no loss scale); raising fp16.min_loss_scale or hysteresis only hides it"
)
LR_FIX = (
    "build the optimizer and scheduler alike on every rank: look for an LR that depends on the "
    "rank, a scheduler stepped on some ranks only, a checkpoint loaded on one rank"
)


# --- numerics -----------------------------------------------------------------------------


@check("numerics", order=70, observes=("backward", "gradients", "scaler"))
def check_numerics(evidence: Evidence) -> CheckResult:
    """The first non-finite loss or applied inf/nan gradient, and a loss scaler (GradScaler
    or DeepSpeed's fp16 one) in trouble.

    Gradients with inf/nan on a step the scaler skipped are its normal overflow check; they
    count only through the scaler's history: more than 2 skips in a row (calibration at the
    start aside), more than half of any 20 steps skipped, a scale below 1, or DeepSpeed's
    scale at its floor (fp16.min_loss_scale) on 3 steps or more.
    """
    records = evidence.records
    lossless = {r for r, job in evidence.jobs.items() if not job.computes_loss}
    findings = _nonfinite_findings(records, evidence.step_columns.rows(), lossless)
    findings += _scaler_findings(evidence.per_rank, _scaler_name(evidence), _scalers(evidence))
    why = (
        "every loss was finite, no step applied inf/nan gradients, and the loss scaler (if "
        "any) skipped no more steps than calibration and an occasional overflow do"
    )
    looked = f"{shape_of(records)} of losses, non-finite gradient counts and loss scale"
    return CheckResult(
        "numerics",
        "Non-finite losses and gradients",
        tuple(findings),
        looked,
        "" if findings else why,
    )


def _nonfinite_findings(
    records: Records, rows: np.ndarray, lossless: Set[int] = frozenset()
) -> list[Finding]:
    """``rows``: the same records as columns (found there; told from the records).
    ``lossless``: ranks that compute no loss (their loss is nan by design)."""
    bad_loss = ~np.isfinite(rows["loss"])
    if lossless:
        bad_loss &= ~np.isin(rows["rank"], sorted(lossless))
    bad_rows = bad_loss | ((rows["num_nonfinite"] > 0) & ~rows["skipped"])
    if not bad_rows.any():
        return []
    step = int(rows["step"][bad_rows].min())
    at = {r: rec for r, recs in sorted(records.items()) for rec in recs if rec.step == step}

    def loss_bad(r: int) -> bool:
        return r not in lossless and not math.isfinite(at[r].loss)

    bad = tuple(
        r for r, rec in at.items() if loss_bad(r) or (rec.num_nonfinite > 0 and not rec.skipped)
    )
    # under DDP one rank's inf/nan reaches every rank through the gradient all-reduce: the
    # source is where the loss (or a watched module's output) went non-finite
    source = tuple(r for r in bad if loss_bad(r) or at[r].nonfinite_module)
    ranks = source or bad
    parts = []
    if losses := [at[r].loss for r in ranks if loss_bad(r)]:
        parts.append(f"loss {', '.join(map(str, sorted(set(losses), key=str)))}")
    if counts := [at[r].num_nonfinite for r in ranks if at[r].num_nonfinite]:
        parts.append(f"{sum(counts)} inf/nan gradient elements")
    summary = f"{label_ranks(ranks)} went non-finite at step {step}: {' and '.join(parts)}"
    received = tuple(r for r in bad if r not in ranks)
    if received:
        summary += (
            f"; {label_ranks(received)} only received inf/nan gradients (through the all-reduce)"
        )
    modules = {r: m for r in ranks if (m := at[r].nonfinite_module)}
    hows = {r: at[r].nonfinite_found for r in ranks if at[r].nonfinite_found}
    if modules:  # where the first inf/nan came from, per rank, and how dtlab knows
        first = ", ".join(f"{m} on rank {r}" for r, m in modules.items())
        ways = sorted({hows[r] for r in modules if r in hows})
        summary += f"; first non-finite output: {first}" + (f" ({'; '.join(ways)})" if ways else "")
    elif hows:  # looked, and could not name one: say why
        summary += f"; no module named: {'; '.join(sorted(set(hows.values())))}"
    fix = (
        f"look at what {', '.join(sorted(set(modules.values())))} computes at step {step} "
        "(its inputs and weights: %%dt on the rank, or dt.replay to the step); " + NONFINITE_REMEDY
        if modules
        else NONFINITE_FIX
    )
    evidence = {
        "loss": {r: rec.loss for r, rec in at.items()},
        "num_nonfinite": {r: rec.num_nonfinite for r, rec in at.items()},
        "module": modules,
        "found": hows,
    }
    return [Finding("numerics", ranks, summary, step, evidence, fix, "error")]


def _runs(steps: list[int]) -> list[list[int]]:
    """``[first, last]`` of each run of consecutive step numbers."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and runs[-1][1] == s - 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def _calibration_steps(first_scale: float | None, hysteresis: int) -> int:
    """The first steps, in which a healthy scaler may skip as it comes down from its first
    scale (see SCALER_WARMUP_STEPS)."""
    higher = 0
    if first_scale is not None and first_scale > DEFAULT_INITIAL_SCALE:
        higher = round(math.log2(first_scale / DEFAULT_INITIAL_SCALE))
    return SCALER_WARMUP_STEPS + higher + hysteresis - 1


def _fall_began(steps: list[int], scales: list[float], runs: list[list[int]], at: int) -> int:
    """The step where the fall that brought the scale to ``scales[at]`` began: the first
    skip before the earliest of the halvings that follow one another within SKIP_WINDOW
    steps up to it (a healthy plateau between them ends the fall); ``steps[at]`` if none."""
    halvings = [i for i in range(1, at + 1) if scales[i] < scales[i - 1]]
    if not halvings:
        return steps[at]
    start = len(halvings) - 1
    while start > 0 and steps[halvings[start]] - steps[halvings[start - 1]] <= SKIP_WINDOW:
        start -= 1
    dropped = steps[halvings[start]]  # the scale recorded is the one a step used: lower
    for a, b in runs:  # after the step that overflowed (and its hysteresis skips before)
        if a < dropped <= b + 1:
            return a
    return dropped


def _scaler_trouble(
    rows: np.ndarray, floor: float | None = None, hysteresis: int = 1
) -> dict | None:
    """One rank's loss-scaler history from its rows (ROW, in step order), or None when it
    is healthy. ``floor``: DeepSpeed's min_loss_scale (None: no floor, a GradScaler);
    ``hysteresis``: the overflows it takes before it halves (DeepSpeed's fp16.hysteresis)."""
    steps = rows["step"].tolist()
    skipped = rows["skipped"]
    has_scale = (rows["nulls"] & _SCALE_IS_NONE) == 0
    scaled_steps, scales = rows["step"][has_scale].tolist(), rows["scale"][has_scale].tolist()
    first_scale = scales[0] if scales else None
    calibration = _calibration_steps(first_scale, hysteresis)
    runs = _runs(rows["step"][skipped].tolist())
    calibrating = [(a, b) for a, b in runs if b <= calibration]
    began = [a for a, b in runs if b - a + 1 > MAX_SKIP_RUN and (a, b) not in calibrating]
    # more than half of any SKIP_WINDOW steps skipped, calibration's skips left out
    counted = skipped & ~np.isin(rows["step"], [s for a, b in calibrating for s in range(a, b + 1)])
    if len(counted) >= SKIP_WINDOW:
        in_window = np.convolve(counted.astype(np.int64), np.ones(SKIP_WINDOW, np.int64), "valid")
        if (over := np.flatnonzero(2 * in_window > SKIP_WINDOW)).size:
            window = slice(int(over[0]), int(over[0]) + SKIP_WINDOW)
            began.append(int(rows["step"][window][counted[window]][0]))
    low = [i for i, scale in enumerate(scales) if scale < MIN_SCALE]
    if low:
        began.append(_fall_began(scaled_steps, scales, runs, low[0]))
    at_floor = [i for i, scale in enumerate(scales) if floor is not None and scale <= floor]
    if len(at_floor) >= FLOOR_STEPS:
        began.append(_fall_began(scaled_steps, scales, runs, at_floor[0]))
    if not began:
        return None
    first = min(began)
    since = [(st, sc) for st, sc in zip(scaled_steps, scales, strict=True) if st >= first - 1]
    changes = [(st, sc) for i, (st, sc) in enumerate(since) if i == 0 or sc != since[i - 1][1]]
    later = [[max(a, first), b] for a, b in runs if b >= first]
    trouble = {
        "first_step": first,
        "num_skipped": int(sum(b - a + 1 for a, b in later)),
        "num_steps": sum(1 for st in steps if st >= first),
        "longest_run": max((b - a + 1 for a, b in later), default=0),
        "first_scale": first_scale,
        "min_scale": min(scales) if scales else None,
        "last_scale": scales[-1] if scales else None,
        # the history since it began: runs of skipped steps, and (step, scale) where it moved
        "skipped_runs": later[:HISTORY_ENTRIES],
        "scale_changes": changes[:HISTORY_ENTRIES],
    }
    if floor is not None:
        trouble.update(floor=floor, steps_at_floor=len(at_floor))
    return trouble


def _scaler_name(evidence: Evidence) -> str:
    """Whose loss scaler skips steps: DeepSpeed's own (fp16 in ds_config) or a GradScaler."""
    if any(info.deepspeed is not None for info in evidence.jobs.values()):
        return "DeepSpeed's fp16 loss scaler"
    return "GradScaler"


def _scalers(evidence: Evidence) -> dict[int, tuple[float | None, int]]:
    """``rank -> (floor, hysteresis)`` of DeepSpeed's fp16 loss scaler, from its ds_config."""
    return {
        r: fp16_scaler(job.deepspeed)
        for r, job in evidence.jobs.items()
        if job.deepspeed is not None
    }


def _scaler_findings(
    per_rank: dict, scaler: str = "GradScaler", scalers: Mapping | None = None
) -> list[Finding]:
    """``scalers``: ``rank -> (floor, hysteresis)`` where DeepSpeed's (``_scalers``)."""
    scalers = scalers or {}
    trouble = {
        r: t
        for r, rows in sorted(per_rank.items())
        if (t := _scaler_trouble(rows, *scalers.get(r, (None, 1))))
    }
    if not trouble:
        return []
    ranks = tuple(trouble)
    step = min(t["first_step"] for t in trouble.values())
    t = trouble[ranks[0]]
    scale = (
        ""
        if t["first_scale"] is None
        else (
            f"; scale {t['first_scale']:g} at first, {t['min_scale']:g} at least, "
            f"{t['last_scale']:g} now"
        )
    )
    if t.get("steps_at_floor"):
        scale += (
            f"; at its floor (fp16.min_loss_scale {t['floor']:g}) on {t['steps_at_floor']} steps"
        )
    share = (
        "every step since"
        if t["num_skipped"] == t["num_steps"]
        else f"{t['num_skipped']} of the {t['num_steps']} steps since"
    )
    summary = (
        f"{label_ranks(ranks)}: {scaler} skipped {t['num_skipped']} steps, up to "
        f"{t['longest_run']} in a row, from step {step} ({share}){scale}"
    )
    fix = DEEPSPEED_SCALER_FIX if scalers else SCALER_FIX
    return [Finding("numerics", ranks, summary, step, {"scaler": trouble}, fix)]


# --- learning rate ------------------------------------------------------------------------


@check("learning_rate", order=90, compares="ranks")
def check_learning_rate(evidence: Evidence) -> CheckResult:
    """Ranks whose LR differs from the others' at a step (relative tolerance 1e-12).

    Also reports, for information only, the global batch and what the current LR would be
    for the world size under linear and square-root scaling (in ``looked_at``).
    """
    steps, columns, rows = evidence.table
    lr = rows["lr"]  # steps x ranks, nan where a rank recorded none
    if not len(steps) or np.isnan(lr).all():
        return CheckResult(
            "learning_rate",
            "Learning rate across ranks",
            (),
            f"{len(steps)} steps",
            "not checked: no rank recorded a learning rate (no param_groups 'lr')",
            checked=False,
            needs="an optimizer whose param groups carry 'lr'",
        )

    def at(i: int) -> dict[int, float]:
        return {int(r): float(v) for r, v in zip(columns, lr[i], strict=True) if not math.isnan(v)}

    # all of a step's LRs within the tolerance of its largest: one group, nothing to compare
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step where no rank has an LR
        low, high = np.nanmin(lr, axis=1), np.nanmax(lr, axis=1)
        spread = high - low > LR_REL_TOL * np.maximum(np.abs(low), np.abs(high))
    differing = [(int(steps[i]), *_lr_outliers(at(int(i)))) for i in np.flatnonzero(spread)]
    differing = [d for d in differing if d[1]]
    findings = []
    if differing:
        step, ranks, reference, lrs = differing[0]
        summary = (
            f"the learning rate at step {step} is {', '.join(f'{lrs[r]:g}' for r in ranks)} on "
            f"{label_ranks(ranks)} but {reference:g} on the others (differs at "
            f"{len(differing)} of {len(steps)} steps)"
        )
        evidence_ = {"lr": lrs, "num_steps_differing": len(differing)}
        findings.append(Finding("learning_rate", ranks, summary, step, evidence_, LR_FIX, "error"))
    last_lr = _lr_outliers(at(len(steps) - 1))[1]
    looked = f"LR per rank at {len(steps)} steps; {_batch_table(evidence.per_rank, last_lr)}"
    why = "every rank used the same learning rate at every step"
    return CheckResult(
        "learning_rate",
        "Learning rate across ranks",
        tuple(findings),
        looked,
        "" if findings else why,
    )


def _lr_outliers(lrs: Mapping[int, float]) -> tuple[tuple[int, ...], float | None, dict]:
    """Ranks outside the largest group of equal LRs (ties: the group of the lowest rank),
    that group's LR, and every rank's LR (``{rank: lr}`` of those that recorded one)."""
    lrs = dict(sorted(lrs.items()))
    groups: list[list[int]] = []
    for r, lr in lrs.items():
        for g in groups:
            if math.isclose(lrs[g[0]], lr, rel_tol=LR_REL_TOL, abs_tol=0.0):
                g.append(r)
                break
        else:
            groups.append([r])
    if not groups:
        return (), None, lrs
    majority = max(groups, key=len)
    return tuple(r for r in lrs if r not in majority), lrs[majority[0]], lrs


def _most_common(values: np.ndarray) -> int:
    """The most frequent value (ties: the smallest)."""
    found, counts = np.unique(values, return_counts=True)
    return int(found[np.argmax(counts)])


def _batch_table(per_rank: Mapping[int, np.ndarray], lr: float | None) -> str:
    """``per_rank``: each rank's rows (``Evidence.per_rank``)."""
    unknown = "global batch unknown (sample indices not recorded)"
    sizes: list[int] = []
    for rows in per_rank.values():
        lengths = rows["num_indices"][rows["num_indices"] > 0]
        if not len(lengths):
            return unknown
        sizes.append(_most_common(lengths))
    if not sizes:
        return unknown
    total = sum(sizes)
    each = (
        f"{len(sizes)} ranks x {sizes[0]}" if len(set(sizes)) == 1 else " + ".join(map(str, sizes))
    )
    batch = f"global batch {each} = {total}"
    if lr is None:
        return f"{batch}; LR not recorded"
    micro_batches = _most_common(np.concatenate([r["micro_batches"] for r in per_rank.values()]))
    # the unit an LR is usually tuned for: one micro-batch on one rank
    factor = total / max(1, sizes[0] // micro_batches)
    linear, sqrt = lr * factor, lr * math.sqrt(factor)
    accumulated = f", {micro_batches} micro-batches a step" if micro_batches > 1 else ""
    return (
        f"{batch}{accumulated}; LR at the last step {lr:.3g}. Advice, not a verdict: if that "
        f"LR was tuned for one rank's micro-batch, the global batch is {factor:g}x that and "
        f"would call for {linear:.3g} (linear rule) or {sqrt:.3g} (square-root rule), with a "
        "warm-up; if it was tuned for the global batch, keep it"
    )


TRAINING_CHECKS = (check_data_order, check_numerics, check_learning_rate)

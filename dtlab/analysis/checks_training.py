"""``%dt_doctor`` checks of the training loop: data order, numerics, learning rate.

1. collect (each rank, agent/): a :class:`dtlab.records.StepRecord` summary every step
   (sample indices, epoch, loss, LR, GradScaler scale, phase times).
2. combine (notebook, here): each ``check_*(evidence) -> CheckResult`` compares the ranks'
   records and returns findings only for what a healthy DDP job never shows.
3. present (views/): ``%dt_doctor`` prints the findings, or with ``--explain`` why it passed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np

from dtlab.analysis.evidence import CheckResult, Evidence
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.trends import aligned_steps
from dtlab.records import Finding, StepRecord

Records = Mapping[int, Sequence[StepRecord]]

DATA_WAIT_FRACTION = 0.3  # median share of a step spent waiting for the next batch
DATA_WAIT_MIN_S = 0.001  # ... and at least this long (tiny steps make big fractions)
DATA_WAIT_SKIP = 2  # first steps start the loader's workers
DATA_WAIT_MIN_STEPS = 3
MIN_SAME_ORDER_STEPS = 2  # steps of two epochs that must match to call the order repeated
MIN_SAME_ORDER_SAMPLES = 8  # ... holding this many samples (tiny shuffles repeat by chance)
MAX_SKIP_RUN = 2  # GradScaler: more skipped steps in a row than this ...
SCALER_WARMUP_STEPS = 10  # ... unless the run ends while the scaler calibrates
MIN_SCALE = 1.0  # a scale under 1 shrinks gradients: the overflow is not the scaler's
LR_REL_TOL = 1e-12

OVERLAP_FIX = (
    "give every rank its own shard: DataLoader(dataset, sampler=DistributedSampler(dataset, "
    "num_replicas=world_size, rank=rank)), with each rank's own rank, and no shuffle= there"
)
PADDING_FIX = "harmless for training; for exact eval metrics use DistributedSampler(drop_last=True)"
SET_EPOCH_FIX = (
    "call sampler.set_epoch(epoch) at the start of every epoch, or let dtlab do it: "
    "dtlab.attach(on_epoch=sampler.set_epoch)"
)
DATA_WAIT_FIX = (
    "give the DataLoader more num_workers (pin_memory=True, persistent_workers=True), move "
    "decoding/augmentation off the critical path, check that rank's disk or network"
)
NONFINITE_FIX = (
    "find the module whose output turns inf/nan first: dt.watch_modules() or %dt_run --until "
    "nonfinite names it; with fp16 use torch.amp.GradScaler (it skips overflowing steps); "
    "else lower the LR (or add warm-up / clipping)"
)
SCALER_FIX = (
    "gradients overflow even at a small scale, so they are inf/nan before scaling: find the "
    "module that makes them and run it in fp32 (autocast(enabled=False)), or lower the LR"
)
LR_FIX = (
    "build the optimizer and scheduler alike on every rank: look for an LR that depends on the "
    "rank, a scheduler stepped on some ranks only, a checkpoint loaded on one rank"
)


def _shape(records: Records) -> str:
    return f"{len(records)} ranks x {max((len(r) for r in records.values()), default=0)} steps"


# --- data order ---------------------------------------------------------------------------


def check_data_order(evidence: Evidence) -> CheckResult:
    """Shards that overlap within an epoch, epochs in the same order, ranks that wait for data.

    Overlap: a sample index read by two ranks in one epoch is an error, unless exactly two
    ranks read it, one in its first batch of the epoch and one in its last, and fewer samples
    than there are ranks look like that in the epoch: DistributedSampler's padding (advice).
    """
    records = evidence.records
    has_indices = any(rec.indices for recs in records.values() for rec in recs)
    findings = []
    if has_indices:
        findings += _overlap_findings(records)
        findings += _same_order_findings(records)
    findings += _data_wait_findings(records)
    what = "sample indices by epoch and" if has_indices else "(sample indices not recorded)"
    why = "no rank waited for data over 30% of a step" + (
        "; no two ranks read a sample in one epoch; each epoch came in a new order"
        if has_indices
        else " (shard overlap and set_epoch not checked: sample indices were not recorded)"
    )
    looked = f"{_shape(records)} of {what} data time per step"
    return CheckResult("data_order", "Data sharding and input pipeline", tuple(findings),
                       looked, "" if findings else why)  # fmt: skip


_E, _I, _R, _S, _FIRST, _LAST = range(6)  # columns of the index table


def _index_table(records: Records) -> np.ndarray:
    """One row per sample read: epoch, index, rank, step, first batch of the epoch?, last?

    The epoch of each sample is dtlab's count, split inside a step where
    ``StepRecord.epoch_starts`` says a new one began. Where a rank reads again a sample it
    already read in the same epoch, dtlab missed an epoch's end (an endless iterator that
    reshuffles on its own): that epoch is compared only up to the first such step."""
    rows = []
    for rank, recs in records.items():
        for rec in recs:
            starts, epoch = set(rec.epoch_starts), rec.epoch
            for position, index in enumerate(rec.indices):
                epoch += position in starts
                rows.append((epoch, index, rank, rec.step, 0, 0))
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    table = _before_first_reread(table)
    for key in {(int(e), int(r)) for e, r in table[:, [_E, _R]]}:
        rows_of = (table[:, _E] == key[0]) & (table[:, _R] == key[1])
        steps = table[rows_of, _S]
        table[rows_of, _FIRST] = steps == steps.min()
        table[rows_of, _LAST] = steps == steps.max()
    return table


def _before_first_reread(table: np.ndarray) -> np.ndarray:
    order = np.lexsort((table[:, _S], table[:, _I], table[:, _R], table[:, _E]))
    t = table[order]
    again = np.zeros(len(t), dtype=bool)
    again[1:] = np.all(t[1:, :3] == t[:-1, :3], axis=1)  # same epoch, index, rank
    keep = np.ones(len(table), dtype=bool)
    for epoch in np.unique(t[again, _E]):
        cutoff = t[again & (t[:, _E] == epoch), _S].min()
        keep &= ~((table[:, _E] == epoch) & (table[:, _S] >= cutoff))
    return table[keep]


def _shared_groups(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of samples two or more ranks read in one epoch (each rank's first read only),
    sorted by epoch, index, step; and where each (epoch, index) group starts."""
    t = table[np.lexsort((table[:, _S], table[:, _R], table[:, _I], table[:, _E]))]
    keep = np.ones(len(t), dtype=bool)
    keep[1:] = np.any(t[1:, :3] != t[:-1, :3], axis=1)
    t = t[keep]
    t = t[np.lexsort((t[:, _R], t[:, _S], t[:, _I], t[:, _E]))]
    new = np.ones(len(t), dtype=bool)
    new[1:] = np.any(t[1:, :2] != t[:-1, :2], axis=1)
    group = np.cumsum(new) - 1
    t = t[np.bincount(group)[group] > 1]
    if not len(t):
        return t, np.zeros(0, dtype=np.int64)
    return t, np.flatnonzero(np.r_[True, np.any(t[1:, :2] != t[:-1, :2], axis=1)])


def _overlap_findings(records: Records) -> list[Finding]:
    t, starts = _shared_groups(_index_table(records))
    if not len(starts):
        return []
    sizes = np.diff(np.r_[starts, len(t)])
    first, second = t[starts], t[np.minimum(starts + 1, len(t) - 1)]
    pad_like = (sizes == 2) & (
        (first[:, _FIRST] & second[:, _LAST]) | (first[:, _LAST] & second[:, _FIRST])
    ).astype(bool)
    padding = pad_like.copy()
    for epoch in np.unique(first[:, _E]):
        in_epoch = first[:, _E] == epoch
        # DistributedSampler pads fewer samples than there are ranks
        if (pad_like & in_epoch).sum() >= len(records):
            padding &= ~in_epoch
    row_group = np.repeat(np.arange(len(starts)), sizes)
    found = []
    for is_padding in (False, True):
        chosen = padding == is_padding
        if chosen.any():
            rows = t[chosen[row_group]]
            found.append(_overlap_finding(rows, first[chosen], second[chosen], is_padding))
    return found


def _overlap_finding(rows, first, second, padding: bool) -> Finding:
    ranks = tuple(int(r) for r in np.unique(rows[:, _R]))
    step = int(second[:, _S].min())
    epochs = [int(e) for e in np.unique(first[:, _E])]
    examples = [int(i) for i in first[np.argsort(second[:, _S], kind="stable")[:5], _I]]
    evidence = {"num_shared": len(first), "example_indices": examples, "epochs": epochs}
    where = f"epoch{'s' if len(epochs) > 1 else ''} {', '.join(map(str, epochs))}"
    if padding:
        summary = (
            f"the last batch of {where} repeats {len(first)} samples from the epoch's start "
            f"({label_ranks(ranks)}, first at step {step}, e.g. index {examples[0]}): "
            "DistributedSampler pads each epoch to a multiple of the world size (drop_last=False)"
        )
        return Finding("data_order", ranks, summary, step, evidence, PADDING_FIX, "advice")
    summary = (
        f"{label_ranks(ranks)} read the same samples: {len(first)} sample indices seen by "
        f"more than one rank in {where}, first at step {step} (e.g. {examples})"
    )
    return Finding("data_order", ranks, summary, step, evidence, OVERLAP_FIX, "error")


def _same_order_findings(records: Records) -> list[Finding]:
    repeated = {}  # rank -> (epoch, its first step, steps compared)
    for rank, recs in sorted(records.items()):
        by_epoch: dict[int, list[StepRecord]] = {}
        for rec in recs:
            if rec.indices:
                by_epoch.setdefault(rec.epoch, []).append(rec)
        for epoch in sorted(by_epoch):
            before, now = by_epoch[epoch], by_epoch.get(epoch + 1, [])
            n = min(len(before), len(now))
            same = [r.indices for r in before[:n]] == [r.indices for r in now[:n]]
            enough = n >= MIN_SAME_ORDER_STEPS
            enough &= sum(len(r.indices) for r in now[:n]) >= MIN_SAME_ORDER_SAMPLES
            if enough and same and not _sequential(before[:n]):
                repeated[rank] = (epoch + 1, now[0].step, n)
                break
    if not repeated:
        return []
    ranks = tuple(repeated)
    epoch, step, n = min(repeated.values(), key=lambda v: v[1])
    summary = (
        f"{label_ranks(ranks)} read epoch {epoch} in the same order as epoch {epoch - 1} "
        f"(the first {n} batches match, from step {step}): the sampler's set_epoch is not called"
    )
    evidence = {"repeated": {r: {"epoch": e, "step": s, "num_steps": k}
                             for r, (e, s, k) in repeated.items()}}  # fmt: skip
    return [Finding("data_order", ranks, summary, step, evidence, SET_EPOCH_FIX, "warning")]


def _sequential(recs: Sequence[StepRecord]) -> bool:
    """In ascending order: shuffle=False, where set_epoch changes nothing. The last batch
    may wrap around to the start (DistributedSampler's padding), so it is left out."""
    recs = recs[:-1] if len(recs) > 2 else recs
    flat = np.fromiter(chain.from_iterable(r.indices for r in recs), dtype=np.int64)
    return bool(np.all(np.diff(flat) > 0))


def _data_wait_findings(records: Records) -> list[Finding]:
    slow = {}  # rank -> (median fraction, median data seconds, first slow step)
    for rank, recs in sorted(records.items()):
        recs = [r for r in recs[DATA_WAIT_SKIP:] if r.times.total > 0]
        if len(recs) < DATA_WAIT_MIN_STEPS:
            continue
        fractions = [r.times.data / r.times.total for r in recs]
        fraction = float(np.median(fractions))
        data_s = float(np.median([r.times.data for r in recs]))
        if fraction > DATA_WAIT_FRACTION and data_s >= DATA_WAIT_MIN_S:
            step = next(r.step for r in recs if r.times.data > DATA_WAIT_FRACTION * r.times.total)
            slow[rank] = (fraction, data_s, step)
    if not slow:
        return []
    ranks = tuple(slow)
    shares = ", ".join(f"rank {r} {f:.0%} ({d * 1e3:.1f} ms)" for r, (f, d, _) in slow.items())
    what = f"waiting for data takes a large share of each step (median): {shares}"
    if len(slow) == len(records):
        what += ": the input pipeline is the bottleneck"
    evidence = {"data_fraction": {r: v[0] for r, v in slow.items()},
                "data_seconds": {r: v[1] for r, v in slow.items()}}  # fmt: skip
    step = min(v[2] for v in slow.values())
    return [Finding("data_order", ranks, f"{what}, from step {step}", step, evidence,
                    DATA_WAIT_FIX, "warning")]  # fmt: skip


# --- numerics -----------------------------------------------------------------------------


def check_numerics(evidence: Evidence) -> CheckResult:
    """The first non-finite loss or applied inf/nan gradient, and a GradScaler in trouble.

    Gradients with inf/nan on a step the GradScaler skipped are its normal overflow check;
    they count only through the scaler's history: more than 2 skips in a row (after the
    first 10 steps of calibration) or a scale below 1.
    """
    records = evidence.records
    findings = _nonfinite_findings(records) + _scaler_findings(records)
    why = (
        "every loss was finite, no step applied inf/nan gradients, and GradScaler (if any) "
        "skipped no more steps than calibration does"
    )
    looked = f"{_shape(records)} of losses, non-finite gradient counts and GradScaler scale"
    return CheckResult("numerics", "Non-finite losses and gradients", tuple(findings), looked,
                       "" if findings else why)  # fmt: skip


def _bad(rec: StepRecord) -> bool:
    return not math.isfinite(rec.loss) or (rec.num_nonfinite > 0 and not rec.skipped)


def _nonfinite_findings(records: Records) -> list[Finding]:
    bad_steps = [rec.step for recs in records.values() for rec in recs if _bad(rec)]
    if not bad_steps:
        return []
    step = min(bad_steps)
    at = {r: rec for r, recs in sorted(records.items()) for rec in recs if rec.step == step}
    bad = tuple(r for r, rec in at.items() if _bad(rec))
    # under DDP one rank's inf/nan reaches every rank through the gradient all-reduce: the
    # source is where the loss (or a watched module's output) went non-finite
    source = tuple(r for r in bad if not math.isfinite(at[r].loss) or at[r].nonfinite_module)
    ranks = source or bad
    parts = []
    if losses := [at[r].loss for r in ranks if not math.isfinite(at[r].loss)]:
        parts.append(f"loss {', '.join(map(str, sorted(set(losses), key=str)))}")
    if counts := [at[r].num_nonfinite for r in ranks if at[r].num_nonfinite]:
        parts.append(f"{sum(counts)} inf/nan gradient elements")
    summary = f"{label_ranks(ranks)} went non-finite at step {step}: {' and '.join(parts)}"
    received = tuple(r for r in bad if r not in ranks)
    if received:
        summary += (f"; {label_ranks(received)} only received inf/nan gradients "
                    "(through the all-reduce)")  # fmt: skip
    modules = {r: at[r].nonfinite_module for r in ranks if at[r].nonfinite_module}
    if modules:  # modules were watched: where the first inf/nan came from, per rank
        first = ", ".join(f"{m} on rank {r}" for r, m in modules.items())
        summary += f"; first non-finite output: {first}"
    evidence = {"loss": {r: rec.loss for r, rec in at.items()},
                "num_nonfinite": {r: rec.num_nonfinite for r, rec in at.items()},
                "module": modules}  # fmt: skip
    return [Finding("numerics", ranks, summary, step, evidence, NONFINITE_FIX, "error")]


def _scaler_trouble(recs: Sequence[StepRecord]) -> dict | None:
    skipped = [r.step for r in recs if r.skipped]
    runs = []  # [first, last] step of each run of consecutive skips
    for s in skipped:
        if runs and runs[-1][1] == s - 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    long = [a for a, b in runs if b - a + 1 > MAX_SKIP_RUN and b > SCALER_WARMUP_STEPS]
    scaled = [r for r in recs if r.scale is not None]
    low = [r.step for r in scaled if r.scale < MIN_SCALE]
    if not long and not low:
        return None
    scales = [r.scale for r in scaled]
    return {
        "first_step": min(long + low[:1]),
        "num_skipped": len(skipped),
        "longest_run": max((b - a + 1 for a, b in runs), default=0),
        "first_scale": scales[0] if scales else None,
        "min_scale": min(scales) if scales else None,
        "last_scale": scales[-1] if scales else None,
    }


def _scaler_findings(records: Records) -> list[Finding]:
    trouble = {r: t for r, recs in sorted(records.items()) if (t := _scaler_trouble(recs))}
    if not trouble:
        return []
    ranks = tuple(trouble)
    step = min(t["first_step"] for t in trouble.values())
    t = trouble[ranks[0]]
    scale = "" if t["first_scale"] is None else (
        f"; scale {t['first_scale']:g} at first, {t['min_scale']:g} at least, "
        f"{t['last_scale']:g} now"
    )  # fmt: skip
    summary = (
        f"{label_ranks(ranks)}: GradScaler skipped {t['num_skipped']} steps, up to "
        f"{t['longest_run']} in a row, from step {step}{scale}"
    )
    return [Finding("numerics", ranks, summary, step, {"scaler": trouble}, SCALER_FIX)]


# --- learning rate ------------------------------------------------------------------------


def check_learning_rate(evidence: Evidence) -> CheckResult:
    """Ranks whose LR differs from the others' at a step (relative tolerance 1e-12).

    Also reports, for information only, the global batch and what the current LR would be
    for the world size under linear and square-root scaling (in ``looked_at``).
    """
    records = evidence.records
    steps = aligned_steps(records)
    differing = [(step, *_lr_outliers(at)) for step, at in steps]
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
    last_lr = _lr_outliers(steps[-1][1])[1] if steps else None
    looked = f"LR per rank at {len(steps)} steps; {_batch_table(records, last_lr)}"
    why = "every rank used the same learning rate at every step"
    return CheckResult("learning_rate", "Learning rate across ranks", tuple(findings), looked,
                       "" if findings else why)  # fmt: skip


def _lr_outliers(at: Mapping[int, StepRecord]) -> tuple[tuple[int, ...], float | None, dict]:
    """Ranks outside the largest group of equal LRs (ties: the group of the lowest rank),
    that group's LR, and every rank's LR."""
    lrs = {r: rec.lr for r, rec in sorted(at.items()) if rec.lr is not None}
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


def _batch_table(records: Records, lr: float | None) -> str:
    sizes = []
    for recs in records.values():
        lengths = Counter(len(r.indices) for r in recs if r.indices)
        sizes.append(lengths.most_common(1)[0][0] if lengths else None)
    if not sizes or None in sizes:
        return "global batch unknown (sample indices not recorded)"
    total = sum(sizes)
    each = (
        f"{len(sizes)} ranks x {sizes[0]}" if len(set(sizes)) == 1 else " + ".join(map(str, sizes))
    )
    batch = f"global batch {each} = {total}"
    if lr is None:
        return f"{batch}; LR not recorded"
    world = len(sizes)
    linear, sqrt = lr * world, lr * math.sqrt(world)
    return (
        f"{batch}; LR at the last step {lr:.3g}. Advice, not a verdict: if that LR was "
        f"tuned for one rank's batch, {world} ranks would call for {linear:.3g} (linear "
        f"rule) or {sqrt:.3g} (square-root rule), with a warm-up; if it was tuned for the "
        "global batch, keep it"
    )


TRAINING_CHECKS = (check_data_order, check_numerics, check_learning_rate)

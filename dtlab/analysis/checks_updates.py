"""``%dt_doctor`` check of the optimizer's updates: a rank whose optimizer step moves its
parameters much more, or much less, than the other ranks' do.

Under a sharded optimizer (FSDP2, ZeRO) each rank updates only the part of the parameters
it holds, with its own optimizer state: a rank whose LR, optimizer state (a checkpoint
loaded on some ranks only, a state reset) or settings (betas, eps, weight decay) differ
trains its shard differently, and the model stays in sync everywhere else. What shows it
is the size of the update each rank made (``StepRecord.update_rms``: the RMS of the change
of a fixed sample of the elements it holds, ``dtlab.agent.update_size``), divided by the LR
the rank recorded (so that a schedule, and an LR that differs, which ``learning_rate``
names, do not count), or raw where LRs are not known.

Healthy ranks agree closely: under DDP every rank applies the same update to the same
parameters (equal); under Adam on different shards each element moves by about the LR,
so ranks agree within ~20%. Under SGD on different shards (an update the size of each
shard's gradient, which differs by design: an embedding's rows) it does not look.

So a rank is named where its update stands ``UPDATE_RATIO`` (1.5x) or more away, either
way, from the median of the other ranks holding the same parameters, at most of the steps
compared (and at least ``MIN_APART_STEPS``). A 2x LR on one rank under Adam shows as ~2x
update.
"""

from __future__ import annotations

import warnings

import numpy as np

from dtlab.analysis.doctor import PIPELINE_WHY
from dtlab.analysis.evidence import shape_of
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding

UPDATE_RATIO = 1.5  # a rank's update this many times the others' median (or 1/that) ...
MIN_APART_STEPS = 2  # ... at more than half the steps compared, and at least this many
TITLE = "Update size alike on every rank"

UPDATE_FIX = (
    "look for what makes this rank's optimizer step differ from the others': its LR (a "
    "rank-dependent LR or scheduler, param groups built differently), its optimizer state "
    "(a checkpoint loaded, or state reset, on some ranks only: Adam restarts from step 0 "
    "with larger steps), its settings (betas, eps, weight decay, momentum), or a loss or "
    "gradient scaler that differs on the rank (a GradScaler or grad multiplier of its own)"
)


@check("update_size", order=95, compares="ranks", observes=("update size",))
def check_update_size(evidence: Evidence) -> CheckResult:
    """Ranks whose update RMS (per unit of LR) stands 1.5x or more from the other ranks'
    median at most steps (see the module's description)."""
    steps, ranks, rows = evidence.table
    looked = f"{shape_of(evidence.records)} of update sizes (RMS of each rank's change)"
    measured = rows["update_rms"] if len(steps) else np.zeros((0, len(ranks)))
    if not np.isfinite(measured).any():
        return CheckResult(
            "update_size",
            TITLE,
            (),
            looked,
            "not checked: no rank recorded the size of its updates",
            checked=False,
            needs="a job whose ranks record update sizes (dtlab.agent.update_size)",
        )
    if sgd := _sharded_sgd(evidence):
        return CheckResult(
            "update_size",
            TITLE,
            (),
            looked,
            f"not checked: {sgd} on sharded parameters moves each shard by its own "
            "gradient, so the ranks' update sizes differ by design",
            checked=False,
        )
    sizes, per_lr = _sizes(rows)
    groups = _groups(evidence, [int(r) for r in ranks])
    compared = [g for g in groups if len(g) > 1]
    if not compared:
        return CheckResult(
            "update_size",
            TITLE,
            (),
            looked,
            f"not checked: {PIPELINE_WHY}"  # as the checks of replicas say it
            if evidence.is_pipeline
            else "not checked: every rank holds parameters no other rank does, so no two "
            "updates are comparable",
            checked=False,
        )
    column = {int(r): j for j, r in enumerate(ranks)}
    findings = []
    for group in compared:
        at = [column[r] for r in group]
        found = _apart(steps, np.asarray(group), sizes[:, at])
        if found:
            findings.append(_finding(found, per_lr))
    unit = "per unit of LR" if per_lr.all() else "raw (LR not known at every step)"
    looked += f", {unit}, each rank against the median of the others holding its parameters"
    why = (
        f"no rank's update stood {UPDATE_RATIO:g}x or more from the other ranks' median at "
        "most steps"
    )
    return CheckResult("update_size", TITLE, tuple(findings), looked, "" if findings else why)


def _sharded_sgd(evidence: Evidence) -> str:
    """The optimizer, where it moves each element by its gradient's size (SGD) and the
    ranks hold different shards (a mesh, FSDP1, ZeRO); else ""."""
    for job in evidence.jobs.values():
        sharded = (
            job.mesh is not None
            or job.wrapper == "FullyShardedDataParallel"
            or (job.deepspeed is not None and job.deepspeed.zero_stage > 0)
        )
        if sharded and "SGD" in job.optimizer:
            return job.optimizer
    return ""


def _sizes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """steps x ranks of update RMS per unit of LR (raw at steps where some rank has no LR),
    nan where not measured or the step was skipped; and, per step, whether it was per LR."""
    sizes = rows["update_rms"].astype(np.float64)
    sizes[rows["skipped"] | ~np.isfinite(sizes)] = np.nan
    lr = rows["lr"]
    measured = np.isfinite(sizes)
    known = np.isfinite(lr) & (lr > 0)
    per_lr = np.all(known | ~measured, axis=1)  # every rank that measured has an LR
    with np.errstate(all="ignore"):
        sizes = np.where(per_lr[:, None], sizes / np.where(known, lr, 1.0), sizes)
    return sizes, per_lr


def _groups(evidence: Evidence, ranks: list[int]) -> list[list[int]]:
    """Ranks that hold the same parameters (a pipeline stage each; all ranks otherwise)."""
    if not all(r in evidence.jobs for r in ranks):
        return [ranks]
    by_params: dict[tuple, list[int]] = {}
    for r in ranks:
        by_params.setdefault(tuple(p.name for p in evidence.jobs[r].params), []).append(r)
    return list(by_params.values())


def others_median(values: np.ndarray) -> np.ndarray:
    """For each cell of a steps x ranks matrix, the median of the row's other finite cells
    (nan where there are none): one sort per row, not one median per rank."""
    n_steps, n = values.shape
    order = np.argsort(np.where(np.isnan(values), np.inf, values), axis=1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=1)  # finite first, nan last
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.arange(n)[None, :].repeat(n_steps, 0), axis=1)
    count = np.isfinite(values).sum(axis=1, keepdims=True)  # finite cells per row
    own = np.isfinite(values)
    left = count - own  # how many others are finite
    low = (left - 1) // 2
    high = left // 2
    # an index among the others, shifted past the cell's own position where it is counted

    def pick(k: np.ndarray) -> np.ndarray:
        k = np.clip(k, 0, n - 1)
        k = np.where(own & (k >= position), k + 1, k)
        return np.take_along_axis(ordered, np.clip(k, 0, n - 1), axis=1)

    median = (pick(low) + pick(high)) / 2
    return np.where(left >= 1, median, np.nan)


def _apart(steps: np.ndarray, ranks: np.ndarray, sizes: np.ndarray) -> dict | None:
    """The ranks of ``sizes`` (steps x these ranks) that stand apart, or None."""
    median = others_median(sizes)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ratio = sizes / median  # 0 / 0: nan, x / 0: inf
    valid = np.isfinite(sizes) & np.isfinite(median) & ~np.isnan(ratio)
    apart = valid & ((ratio >= UPDATE_RATIO) | (ratio <= 1 / UPDATE_RATIO))
    num_apart, num_valid = apart.sum(axis=0), valid.sum(axis=0)
    flagged = np.flatnonzero((num_apart >= MIN_APART_STEPS) & (2 * num_apart > num_valid))
    if not len(flagged):
        return None
    found = {}
    for j in flagged:
        at = apart[:, j]
        found[int(ranks[j])] = {
            "first_step": int(steps[np.argmax(at)]),
            "ratio": float(np.median(ratio[at, j])),
            "steps_apart": int(num_apart[j]),
            "steps_compared": int(num_valid[j]),
        }
    return found


def _finding(found: dict, per_lr: np.ndarray) -> Finding:
    ranks = tuple(sorted(found))
    first = min(f["first_step"] for f in found.values())

    def said(r: int) -> str:
        f = found[r]
        x = f["ratio"]
        if np.isinf(x):
            size = "moves where the others' median does not"
        elif x == 0:
            size = "does not move where the others do"
        else:
            size = f"{x:.2g}x the others' median" if x >= 1 else f"1/{1 / x:.2g} of theirs"
        return (
            f"rank {r}: {size} at {f['steps_apart']} of {f['steps_compared']} steps, "
            f"from step {f['first_step']}"
        )

    unit = "per unit of LR" if per_lr.all() else "(raw: the LR is not known at every step)"
    summary = (
        f"{label_ranks(ranks)}: the optimizer step moves the parameters "
        f"{'it holds' if len(ranks) == 1 else 'they hold'} by a different amount than on the "
        f"other ranks (update RMS {unit}): " + "; ".join(said(r) for r in ranks)
    )
    evidence = {
        r: {k: round(v, 3) if isinstance(v, float) else v for k, v in f.items()}
        for r, f in found.items()
    }
    return Finding("update_size", ranks, summary, first, {"ranks": evidence}, UPDATE_FIX)


__all__ = ["UPDATE_RATIO", "check_update_size", "others_median"]

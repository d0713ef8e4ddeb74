"""``%dt_doctor`` checks of resources: memory that keeps growing on some ranks or stands
out beyond what their model state explains, and ranks that are consistently slower."""

from __future__ import annotations

import statistics

import numpy as np

from dtlab.analysis.evidence import shape_of
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.analysis.trends import find_leaks, find_stragglers, timing_noise
from dtlab.records import CheckResult, Evidence, Finding

LEAK_MIN_RECORDS = 11  # find_leaks: 3 warm-up steps, then 8 points for a trend
STRAGGLER_MIN_STEPS = 7  # find_stragglers: 2 warm-up steps, then 5 to compare
NOISY_TIMINGS = 0.5  # a compute time whose interquartile range is half its median
IMBALANCE_SHARE = 0.25  # memory beyond the model state over the median by this share...
IMBALANCE_MIN_BYTES = 256 * 2**20  # ... and at least this many bytes


@check("memory", order=100, observes=("memory",))
def check_memory(evidence: Evidence) -> CheckResult:
    cuda = not np.isnan(evidence.step_columns.rows()["cuda_allocated"]).all()
    leaks = find_leaks(
        evidence.records, field="cuda_allocated" if cuda else "rss", per_rank=evidence.per_rank
    )
    findings = (*leaks, *_imbalance(evidence))
    counter = "CUDA allocated" if cuda else "process RSS (less dtlab's own record buffer)"
    looked = (
        f"{shape_of(evidence.records)} of {counter}, and the bytes of parameters, gradients "
        "and optimizer state"
    )
    enough = _num_steps(evidence) >= LEAK_MIN_RECORDS
    if findings:
        why = ""
    elif enough:
        why = (
            "no rank's memory grows steadily faster than the others', and none holds "
            "much more than its model state explains"
        )
    else:
        why = (
            f"leaks not checked: {LEAK_MIN_RECORDS} steps are needed to tell a trend from "
            "noise; no rank holds much more than its model state explains"
        )
    title = "no memory that keeps growing on some ranks, or stands out"
    needs = "" if enough else f"run at least {LEAK_MIN_RECORDS} steps"
    return CheckResult(
        "memory", title, findings, looked, why, checked=enough or bool(findings), needs=needs
    )


def _num_steps(evidence: Evidence) -> int:
    return len(evidence.table[0])


def _imbalance(evidence: Evidence) -> list[Finding]:
    """A rank holding far more than the others at the last common step, beyond what its
    own parameters, gradients and optimizer state explain (sharding, pipeline stages)."""
    steps, ranks, rows = evidence.table
    if len(evidence.records) < 2 or not len(steps):
        return []
    cuda = not np.isnan(rows["cuda_allocated"][-1]).any()
    held_all = rows["cuda_allocated"] if cuda else rows["rss"].astype(float)
    state_all = rows["param_bytes"] + rows["grad_bytes"] + rows["optimizer_bytes"]
    unexplained_all = held_all - state_all  # steps x ranks
    typical = float(np.median(unexplained_all[-1]))
    margin = max(IMBALANCE_SHARE * typical, IMBALANCE_MIN_BYTES)
    heavy_at = unexplained_all[-1] - typical > margin
    heavy = tuple(int(r) for r in ranks[heavy_at])
    if not heavy:
        return []
    # the first step at which the heavy ranks already stood out
    stood_out = (
        unexplained_all[:, heavy_at] - np.median(unexplained_all, axis=1, keepdims=True) > margin
    ).all(axis=1)
    step = int(steps[np.argmax(stood_out)] if stood_out.any() else steps[-1])
    held = {int(r): float(v) for r, v in zip(ranks, held_all[-1], strict=True)}
    state = {int(r): float(v) for r, v in zip(ranks, state_all[-1], strict=True)}
    mib = {r: round(held[r] / 2**20) for r in heavy}
    what = "CUDA allocated" if cuda else "RSS"
    return [
        Finding(
            "memory",
            heavy,
            f"{label_ranks(heavy)} hold{'s' if len(heavy) == 1 else ''} much more memory ({what} "
            f"{', '.join(f'{m} MiB' for m in mib.values())}) than the others "
            f"(median {round((typical + statistics.median(state.values())) / 2**20)} MiB) "
            f"from step {step}, beyond what their model state explains",
            step,
            {"held_mib": mib, "field": what},
            "look for what only these ranks keep: rank-0-only logging or evaluation, cached "
            "batches, a larger shard; %dt_plot memory shows when it began",
            "warning",
        )
    ]


@check(
    "stragglers", order=110, compares="replicas", observes=("forward", "backward", "data loader")
)
def check_stragglers(evidence: Evidence) -> CheckResult:
    doubtful: list[int] = []
    findings = tuple(find_stragglers(evidence.records, doubtful=doubtful, table=evidence.table))
    enough = _num_steps(evidence) >= STRAGGLER_MIN_STEPS and len(evidence.records) > 1
    noise = timing_noise(evidence.records, table=evidence.table)
    needs = ""
    if findings:
        why = ""
    elif enough and doubtful and noise > NOISY_TIMINGS:  # slower, or noise? cannot tell
        enough = False
        why = (
            f"not checked: timings too noisy to judge: {label_ranks(doubtful)} slower by "
            f"the median but not steadily, while a rank's compute time varies by "
            f"{noise:.0%} of its median from step to step (busy cores?)"
        )
        needs = "run more steps, or on a quieter machine"
    elif enough:
        why = "no rank's compute time is 1.3x the median in most steps"
    else:
        why = f"not checked: needs two ranks and {STRAGGLER_MIN_STEPS} steps"
        needs = f"run at least {STRAGGLER_MIN_STEPS} steps on two or more ranks"
    return CheckResult(
        "stragglers",
        "no rank consistently slower",
        findings,
        f"{shape_of(evidence.records)} of data + forward + optimizer time (under DDP "
        "backward holds the wait for the slowest rank)",
        why,
        checked=enough or bool(findings),
        needs=needs,
    )

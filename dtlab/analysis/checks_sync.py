"""``%dt_doctor`` checks of DDP's gradient synchronisation: replicas that must agree bitwise
after every step, parameters that some ranks' backward never reaches, and gradient
accumulation that all-reduces on every micro-batch."""

from __future__ import annotations

import numpy as np

from dtlab.analysis.divergence import (
    GRAD_FIX,
    PARAM_FIX,
    SUMMARY_FIELDS,
    divergence_findings,
    first_divergent_step,
)
from dtlab.analysis.evidence import shape_of
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding

ACCUMULATION_RATIO = 1.5  # bytes all-reduced per gradient byte above which syncs repeat
UNUSED_MIN_STEPS = 5  # steps all parameters must be used in before find_unused is needless


@check("gradient_sync", order=40, compares="replicas", observes=("gradients",))
def check_gradient_sync(evidence: Evidence) -> CheckResult:
    """Gradients after the all-reduce and parameters after the step must be bitwise equal
    on data-parallel ranks; a parameter must not lack a gradient on some ranks only."""
    findings = list(divergence_findings(evidence.details, evidence.names))
    findings += _divergence_without_details(evidence, findings)
    findings += _missing_gradients(evidence)
    rows = evidence.step_columns.rows()
    printed = bool(np.any(rows["grad_fingerprint"]) or np.any(rows["param_fingerprint"]))
    if not findings and not printed:
        return CheckResult(
            "gradient_sync",
            "gradients and parameters identical across ranks",
            (),
            f"{shape_of(evidence.records)}: no gradient or parameter fingerprints",
            "not checked: the steps were run with recording off, so there are no "
            "fingerprints to compare",
            checked=False,
            needs="run some steps with recording on (%dt_step without --no-record)",
        )
    return CheckResult(
        "gradient_sync",
        "gradients and parameters identical across ranks",
        tuple(findings),
        f"{shape_of(evidence.records)} of gradient and parameter fingerprints; which parameters "
        "had no gradient",
        ""
        if findings
        else "every step's fingerprints agree on every rank, and every "
        "parameter got a gradient on all ranks or on none" + unused_search_note(evidence),
    )


def _divergence_without_details(evidence: Evidence, found: list[Finding]) -> list[Finding]:
    """Ranks whose whole-step fingerprints differ at a step whose per-parameter record the
    doctor could not read (gone from the ranks' bounded buffers, or a trace read from disk):
    named from the step summaries alone, without the parameter, rather than passed over."""
    named = {f.evidence.get("fingerprints") for f in found if f.kind == "divergence"}
    findings = []
    for kind, what, fix in (("grad", "gradients", GRAD_FIX), ("param", "parameters", PARAM_FIX)):
        step = (
            None
            if kind in named
            else first_divergent_step(evidence.records, kind=kind, table=evidence.table)
        )
        if step is None:
            continue
        groups: dict[int, list[int]] = {}
        for rank, rows in sorted(evidence.per_rank.items()):  # the rows, not the records
            at = int(np.searchsorted(rows["step"], step))
            if at < len(rows) and rows["step"][at] == step:
                groups.setdefault(int(rows[SUMMARY_FIELDS[kind]][at]), []).append(rank)
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g))
        majority = ordered[0] if 2 * len(ordered[0]) > sum(map(len, ordered)) else None
        if majority is not None:
            others = sorted(r for g in ordered[1:] for r in g)
            verb = "differs" if len(others) == 1 else "differ"
            where = f"{label_ranks(others)} {verb} from the copy {label_ranks(majority)} hold"
        else:
            others = sorted(r for g in ordered for r in g)
            where = "the ranks split " + " | ".join(label_ranks(g) for g in ordered)
        summary = (
            f"{what} diverge from step {step} (whole-step fingerprints): {where}; which "
            "parameter is not known: the ranks no longer hold that step's per-parameter record"
        )
        findings.append(
            Finding(
                "divergence",
                tuple(others),
                summary,
                step,
                {"fingerprints": kind, "groups": [tuple(g) for g in ordered]},
                f"{fix}; to name the parameter, replay from a checkpoint before step {step} "
                "with %dt_run --until diverged",
                "error",
            )
        )
    return findings


def _missing_gradients(evidence: Evidence) -> list[Finding]:
    """A parameter that no step gave a gradient on some ranks but did on others: by the
    rank's own backward where that was watched (before DDP's all-reduce fills the gap in),
    else by the gradient after the step."""
    numbers, columns, rows = evidence.table
    if not len(numbers):
        return []
    never: dict[int, set[int]] = {}  # parameter index -> ranks where it never had one
    watched = bool((rows["num_unreached"] >= 0).all())
    counts = rows["num_unreached"] if watched else rows["num_missing"]
    # a rank with one step where every parameter had a gradient has none missing always
    candidates = {int(r) for r, least in zip(columns, counts.min(axis=0), strict=True) if least}
    steps = evidence.aligned if candidates else []
    for rank in sorted(candidates):
        per_step = [
            (at[rank].unreached or ()) if watched else at[rank].missing_grads  # watched: not None
            for _, at in steps
        ]
        for index in set.intersection(*(set(missing) for missing in per_step)):
            never.setdefault(index, set()).add(rank)
    findings = []
    for index, ranks in sorted(never.items()):
        if len(ranks) == len(evidence.records):
            continue  # frozen, or unused everywhere: the same on every rank
        findings.append(_missing_finding(evidence, index, ranks, len(steps), steps[0][0], watched))
    return findings


def unused_search_note(evidence: Evidence) -> str:
    """DDP's find_unused_parameters judged against what every rank's own backward reached
    (for ``--explain``: a setting that may be needed for steps not seen is no finding)."""
    asked = sorted(r for r, job in evidence.jobs.items() if job.find_unused_parameters)
    numbers, _, rows = evidence.table
    if not asked or len(numbers) < UNUSED_MIN_STEPS:
        return ""
    unreached = rows["num_unreached"]  # -1: not watched
    if np.any(unreached < 0):
        return ""
    steps = numbers  # for the counts below
    if np.any(unreached > 0):
        return (
            f"; DDP's find_unused_parameters=True is needed: some parameters were not reached "
            f"in some of the {len(steps)} steps"
        )
    return (
        f"; DDP's find_unused_parameters=True, yet every rank's own backward reached every "
        f"parameter in all {len(steps)} steps: unless some step can skip one (routing, "
        "data-dependent branches), False saves a pass over the autograd graph each step"
    )


def _missing_finding(evidence, index, ranks, num_steps, step, watched) -> Finding:
    name = evidence.names[index] if index < len(evidence.names) else f"#{index}"
    if watched:
        summary = (
            f"{name} was never reached by the backward of {label_ranks(ranks)} in "
            f"{num_steps} steps, but was on the other ranks: a rank-dependent branch "
            "(its gradient there is only the other ranks' average)"
        )
        fix = (
            "the forward takes another path on these ranks (an `if rank ...`, a "
            "rank-dependent config): make every rank run the same code; DDP's "
            "find_unused_parameters=True hides this by averaging in the other ranks'"
        )
    else:
        summary = (
            f"{name} never got a gradient on {label_ranks(ranks)} in {num_steps} "
            "steps, but did on the other ranks"
        )
        fix = (
            "the forward differs across ranks (a branch, unused experts): with DDP use "
            "find_unused_parameters=True, or make every rank use the parameter"
        )
    return Finding(
        kind="gradient_sync",
        ranks=tuple(sorted(ranks)),
        step=step,
        summary=summary,
        evidence={"param": name, "steps": num_steps, "local": watched},
        fix=fix,
        severity="error",
    )


@check("accumulation", order=60, observes=("backward", "forward"))
def check_accumulation(evidence: Evidence) -> CheckResult:
    """With gradient accumulation, DDP should all-reduce once per step (the last
    micro-batch), not once per micro-batch: compare the bytes sent with the gradients'."""
    ratios: dict[int, np.ndarray] = {}
    micro = 1
    for rank, rows in evidence.per_rank.items():
        counted = (rows["micro_batches"] > 1) & (rows["comm_bytes"] >= 0)  # -1: not counted
        counted &= rows["param_bytes"] > 0
        if counted.any():
            ratios[rank] = rows["comm_bytes"][counted] / rows["param_bytes"][counted]
            micro = int(rows["micro_batches"][counted][-1])
    looked = (
        "gradient bytes all-reduced per step against the gradients' size "
        f"({micro} micro-batch{'es' if micro != 1 else ''})"
    )
    if not ratios:
        accumulates = bool(np.any(evidence.step_columns.rows()["micro_batches"] > 1))
        why = (
            (
                "not checked: DDP's communication was not counted (the model is not DDP, or "
                "has a comm hook of its own)"
            )
            if accumulates
            else "the job does not accumulate"
        )
        return CheckResult(
            "accumulation", "One gradient sync per step", (), looked, why, checked=not accumulates
        )
    median = {rank: float(np.median(values)) for rank, values in ratios.items()}
    chatty = tuple(sorted(r for r, x in median.items() if x > ACCUMULATION_RATIO))
    findings: tuple[Finding, ...] = ()
    if chatty:
        first = min(
            int(rows["step"][rows["micro_batches"] > 1].min())
            for r, rows in evidence.per_rank.items()
            if r in chatty
        )
        x = max(median[r] for r in chatty)
        findings = (
            Finding(
                "accumulation",
                chatty,
                f"{label_ranks(chatty)} all-reduce gradients on every micro-batch: {x:.1f}x the "
                f"communication of one sync per step ({micro} micro-batches per step)",
                first,
                {"bytes_per_gradient_byte": {r: round(median[r], 2) for r in chatty}},
                "run all but the last micro-batch inside `with model.no_sync():` "
                "(dtlab.attach(..., accumulate=k) does this unless no_sync=False)",
                "warning",
            ),
        )
    why = "" if findings else "DDP sent about one copy of the gradients per step"
    return CheckResult("accumulation", "One gradient sync per step", findings, looked, why)

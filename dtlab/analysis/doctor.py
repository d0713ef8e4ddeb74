"""``%dt_doctor``: every check, run over one body of evidence, findings ranked.

1. control/ collects an :class:`Evidence` (launch facts, the trace's summaries, and the
   per-parameter records of the steps where ranks' fingerprints differ);
2. each check here is a pure function ``Evidence -> CheckResult``;
3. views/ print the ranked findings, or with ``--explain`` what each check read and why
   it passed.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from dtlab.analysis.checks_environment import check_environment
from dtlab.analysis.checks_learning import check_learning
from dtlab.analysis.checks_state import check_buffers, check_initial_state
from dtlab.analysis.checks_training import check_data_order, check_learning_rate, check_numerics
from dtlab.analysis.divergence import divergence_findings
from dtlab.analysis.evidence import CheckResult, Evidence, ranked, shape_of
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.trends import aligned_steps, find_leaks, find_stragglers, timing_noise
from dtlab.records import Finding

Check = Callable[[Evidence], CheckResult]
ACCUMULATION_RATIO = 1.5  # bytes all-reduced per gradient byte above which syncs repeat
LEAK_MIN_RECORDS = 11  # find_leaks: 3 warm-up steps, then 8 points for a trend
STRAGGLER_MIN_STEPS = 7  # find_stragglers: 2 warm-up steps, then 5 to compare
NOISY_TIMINGS = 0.5  # a compute time whose interquartile range is half its median
IMBALANCE_SHARE = 0.25  # memory beyond the model state over the median by this share...
IMBALANCE_MIN_BYTES = 256 * 2**20  # ... and at least this many bytes


def check_gradient_sync(evidence: Evidence) -> CheckResult:
    """Gradients after the all-reduce and parameters after the step must be bitwise equal
    on data-parallel ranks; a parameter must not lack a gradient on some ranks only."""
    findings = list(divergence_findings(evidence.details, evidence.names))
    findings += _missing_gradients(evidence)
    printed = any(
        rec.grad_fingerprint or rec.param_fingerprint
        for recs in evidence.records.values()
        for rec in recs
    )
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
        "parameter got a gradient on all ranks or on none",
    )


def _missing_gradients(evidence: Evidence) -> list[Finding]:
    """A parameter that no step gave a gradient on some ranks but did on others: by the
    rank's own backward where that was watched (before DDP's all-reduce fills the gap in),
    else by the gradient after the step."""
    steps = aligned_steps(evidence.records)
    if not steps:
        return []
    never: dict[int, set[int]] = {}  # parameter index -> ranks where it never had one
    watched = all(at[rank].unreached is not None for _, at in steps for rank in at)
    for rank in evidence.records:
        per_step = [at[rank].unreached if watched else at[rank].missing_grads for _, at in steps]
        for index in set.intersection(*(set(missing) for missing in per_step)):
            never.setdefault(index, set()).add(rank)
    findings = []
    for index, ranks in sorted(never.items()):
        if len(ranks) == len(evidence.records):
            continue  # frozen, or unused everywhere: the same on every rank
        findings.append(_missing_finding(evidence, index, ranks, len(steps), steps[0][0], watched))
    return findings


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


def check_accumulation(evidence: Evidence) -> CheckResult:
    """With gradient accumulation, DDP should all-reduce once per step (the last
    micro-batch), not once per micro-batch: compare the bytes sent with the gradients'."""
    ratios: dict[int, list[float]] = {}
    micro = 1
    for rank, recs in evidence.records.items():
        for rec in recs:
            if rec.micro_batches > 1 and rec.comm_bytes is not None and rec.memory.param_bytes:
                ratios.setdefault(rank, []).append(rec.comm_bytes / rec.memory.param_bytes)
                micro = rec.micro_batches
    looked = (
        f"gradient bytes all-reduced per step against the gradients' size ({micro} micro-batches)"
    )
    if not ratios:
        accumulates = any(r.micro_batches > 1 for recs in evidence.records.values() for r in recs)
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
    median = {rank: statistics.median(values) for rank, values in ratios.items()}
    chatty = tuple(sorted(r for r, x in median.items() if x > ACCUMULATION_RATIO))
    findings = ()
    if chatty:
        first = min(
            rec.step for r in chatty for rec in evidence.records[r] if rec.micro_batches > 1
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


def check_memory(evidence: Evidence) -> CheckResult:
    cuda = any(
        r.memory.cuda_allocated is not None for recs in evidence.records.values() for r in recs
    )
    leaks = find_leaks(evidence.records, field="cuda_allocated" if cuda else "rss")
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
    return len(aligned_steps(evidence.records))


def _first_heavy_step(steps, heavy, cuda: bool, margin: float) -> int:
    """The first step at which the heavy ranks already stood out."""
    for step, at in steps:
        unexplained = {
            r: (rec.memory.cuda_allocated if cuda else rec.memory.rss)
            - rec.memory.param_bytes
            - rec.memory.grad_bytes
            - rec.memory.optimizer_bytes
            for r, rec in at.items()
        }
        typical = statistics.median(unexplained.values())
        if all(unexplained[r] - typical > margin for r in heavy):
            return step
    return steps[-1][0]


def _imbalance(evidence: Evidence) -> list[Finding]:
    """A rank holding far more than the others at the last common step, beyond what its
    own parameters, gradients and optimizer state explain (sharding, pipeline stages)."""
    steps = aligned_steps(evidence.records)
    if len(evidence.records) < 2 or not steps:
        return []
    step, at = steps[-1]
    cuda = all(rec.memory.cuda_allocated is not None for rec in at.values())
    held = {r: rec.memory.cuda_allocated if cuda else rec.memory.rss for r, rec in at.items()}
    state = {
        r: rec.memory.param_bytes + rec.memory.grad_bytes + rec.memory.optimizer_bytes
        for r, rec in at.items()
    }
    unexplained = {r: held[r] - state[r] for r in at}
    typical = statistics.median(unexplained.values())
    margin = max(IMBALANCE_SHARE * typical, IMBALANCE_MIN_BYTES)
    heavy = tuple(sorted(r for r, extra in unexplained.items() if extra - typical > margin))
    if not heavy:
        return []
    step = _first_heavy_step(steps, heavy, cuda, margin)
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


def check_stragglers(evidence: Evidence) -> CheckResult:
    doubtful: list[int] = []
    findings = tuple(find_stragglers(evidence.records, doubtful=doubtful))
    enough = _num_steps(evidence) >= STRAGGLER_MIN_STEPS and len(evidence.records) > 1
    noise = timing_noise(evidence.records)
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


CHECKS: tuple[Check, ...] = (
    check_environment,
    check_learning,
    check_initial_state,
    check_gradient_sync,
    check_buffers,
    check_accumulation,
    check_numerics,
    check_data_order,
    check_learning_rate,
    check_memory,
    check_stragglers,
)


# Checks that compare ranks as data-parallel replicas (same parameters, different samples)
REPLICA_CHECKS = (
    check_initial_state,
    check_gradient_sync,
    check_buffers,
    check_data_order,
    check_stragglers,
)
# Checks that compare ranks with each other: with one rank there is nothing to compare
CROSS_RANK_CHECKS = (*REPLICA_CHECKS, check_learning_rate)
PIPELINE_WHY = (
    "a pipeline with one stage per rank: each parameter lives on one rank, every "
    "stage reads the same batches and waits for its neighbours, so there is no "
    "replica to compare; %dt_partition shows the stages' balance"
)


def run_checks(evidence: Evidence, checks: Sequence[Check] = CHECKS) -> list[CheckResult]:
    """Every check; one that fails is reported as not run, the others still run."""
    results = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        if evidence.is_pipeline and check in REPLICA_CHECKS:
            results.append(
                CheckResult(name, name, (), "", f"not checked: {PIPELINE_WHY}", checked=False)
            )
            continue
        if len(evidence.records) < 2 and check in CROSS_RANK_CHECKS:
            results.append(
                CheckResult(
                    name,
                    name,
                    (),
                    "",
                    "not checked: one rank, nothing to compare it with",
                    checked=False,
                    needs="launch two or more ranks",
                )
            )
            continue
        try:
            results.append(check(evidence))
        except Exception as e:  # a bug or odd input in one check must not hide the rest
            results.append(
                CheckResult(
                    name, name, (), "", f"not checked: {type(e).__name__}: {e}", checked=False
                )
            )
    return results


def all_findings(results: Sequence[CheckResult]) -> list[Finding]:
    """The findings of every check, most severe first."""
    return ranked([f for result in results for f in result.findings])

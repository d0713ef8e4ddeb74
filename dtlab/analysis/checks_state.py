"""Doctor check: do data-parallel ranks start from the same weights and buffers?

Each rank fingerprints its parameters and buffers just before its first step
(:class:`dtlab.records.InitialState`); here they are compared across ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dtlab.analysis.divergence import first_divergent_step
from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding

INIT_FIX = (
    "build the model from the same seed on every rank and broadcast it from rank 0 before "
    "training (DistributedDataParallel does both at construction; a model changed or "
    "re-initialised after wrapping is not broadcast again)"
)
BUFFER_FIX = (
    "buffers (BatchNorm running statistics, ...) must start equal too: broadcast them "
    "from rank 0, or keep DDP's broadcast_buffers=True"
)


def _first_difference(
    prints: Mapping[int, Sequence[int]], names: Sequence[str]
) -> tuple[str, list, int] | None:
    """(name of the first differing tensor, its rank groups, how many differ), or None."""
    count = len(next(iter(prints.values()), ()))
    differing = [i for i in range(count) if len({p[i] for p in prints.values()}) > 1]
    if not differing:
        return None
    first = differing[0]
    groups = group_by_value({rank: p[first] for rank, p in prints.items()})
    groups.sort(key=lambda g: (-len(g[0]), g[0]))  # the largest group is the reference
    name = names[first] if first < len(names) else f"#{first}"
    return name, groups, len(differing)


def _finding(what: str, found, total: int, fix: str) -> Finding:
    name, groups, count = found
    head = f"{what} differ across ranks before the first step: {name}"
    if 2 * len(groups[0][0]) > sum(len(ranks) for ranks, _ in groups):  # a majority
        outliers = tuple(sorted(r for ranks, _ in groups[1:] for r in ranks))
        where = f"differs on {label_ranks(outliers)} from the copy {label_ranks(groups[0][0])} hold"
    else:  # none is right by number: every rank is named, every group listed
        outliers = tuple(sorted(r for ranks, _ in groups for r in ranks))
        split = " | ".join(label_ranks(ranks) for ranks, _ in groups)
        where = f"splits {split}, with no majority to tell which is right"
    summary = f"{head} {where}; {count} of {total} differ"
    groups_text = {label_ranks(ranks): str(fp) for ranks, fp in groups}
    evidence = {"first": name, "groups": groups_text, "differing": count}
    return Finding("initial_state", outliers, summary, 1, evidence, fix, "error")


@check("initial_state", order=30, compares="replicas")
def check_initial_state(evidence: Evidence) -> CheckResult:
    initial = evidence.initial
    looked = f"{len(initial)} ranks' parameter and buffer fingerprints before step 1"
    title = "Same weights and buffers on every rank at start"
    # FSDP1's records, like FSDP2's (wrapper None), fingerprint each parameter whole
    compared = (None, "DistributedDataParallel", "FullyShardedDataParallel")
    if any(job.wrapper not in compared for job in evidence.jobs.values()):
        why = "not checked: the model is sharded or wrapped, so ranks hold different tensors"
        return CheckResult("initial_state", title, (), looked, why, checked=False)
    if len(initial) < 2:
        why = "not checked: fewer than two ranks recorded their start"
        return CheckResult("initial_state", title, (), looked, why, checked=False)
    findings = []
    params = {rank: state.param_fingerprints for rank, state in initial.items()}
    found = _first_difference(params, evidence.names)
    if found:
        findings.append(_finding("parameters", found, len(evidence.names), INIT_FIX))
    buffers = {rank: state.buffer_fingerprints for rank, state in initial.items()}
    names = next(iter(initial.values())).buffer_names
    found = _first_difference(buffers, names)
    if found and not _buffers_agree_at_step_1(evidence):
        # (a forward before step 1 changes buffers per rank; DDP's broadcast then evens them)
        findings.append(_finding("buffers", found, len(names), BUFFER_FIX))
    why = "" if findings else "every rank started from bitwise-identical parameters and buffers"
    return CheckResult(
        "initial_state",
        "Same weights and buffers on every rank at start",
        tuple(findings),
        looked,
        why,
    )


def _buffers_agree_at_step_1(evidence: Evidence) -> bool:
    first = [recs[0] for recs in evidence.records.values() if recs and recs[0].step == 1]
    prints = {rec.buffer_fingerprint for rec in first}
    return len(first) == len(evidence.records) and len(prints) == 1 and 0 not in prints


@check("buffers", order=50, compares="replicas", observes=("parameters",))
def check_buffers(evidence: Evidence) -> CheckResult:
    """Buffers (BatchNorm running statistics...) must stay equal on data-parallel ranks:
    without SyncBatchNorm or DDP's buffer broadcast each rank's statistics follow its own
    data and drift apart."""
    names = next(iter(evidence.jobs.values())).buffers if evidence.jobs else ()
    looked = f"fingerprints of {len(names)} buffers as each step's forward saw them"
    step = first_divergent_step(evidence.records, kind="buffer", table=evidence.table)
    details = {rank: [r for r in recs if r.step == step] for rank, recs in evidence.details.items()}
    if step is None or not all(details.values()):
        why = "no buffers" if not names else "every rank's buffers stayed bitwise equal"
        return CheckResult("buffers", "Buffers equal across ranks", (), looked, why)
    prints = {rank: recs[0].buffer_fingerprints for rank, recs in details.items()}
    found = _first_difference(prints, names)
    if found is None:  # the fingerprints agree as far as the first rank's go: it has fewer
        why = "the ranks hold different numbers of buffers (different models), not a drift"
        return CheckResult("buffers", "Buffers equal across ranks", (), looked, why)
    name, groups, count = found
    outliers = tuple(sorted(r for ranks, _ in groups[1:] for r in ranks))
    summary = (
        f"buffers drift apart from step {step}: {name} on {label_ranks(outliers)} differs "
        f"from {label_ranks(groups[0][0])}; {count} of {len(names)} buffers differ"
    )
    fix = (
        "keep DDP's broadcast_buffers=True (rank 0's buffers are sent before every "
        "forward), or on GPUs use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)"
    )
    evidence_ = {"first": name, "differing": count}
    finding = Finding("buffers", outliers, summary, step, evidence_, fix, "warning")
    return CheckResult("buffers", "Buffers equal across ranks", (finding,), looked, "")

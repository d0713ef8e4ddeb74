"""``%dt_doctor``: every registered check, run over one body of evidence, findings ranked.

1. control/ collects an :class:`dtlab.records.Evidence` (launch facts, the trace's
   summaries, and the per-parameter records of the steps where ranks' fingerprints differ);
2. each check (``analysis/checks_*.py``, registered with ``@check``: see
   :mod:`dtlab.analysis.registry`) is a pure function ``Evidence -> CheckResult``;
3. views/ print the ranked findings, or with ``--explain`` what each check read and why
   it passed.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtlab.analysis.evidence import ranked
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.registry import RegisteredCheck, registered
from dtlab.records import CheckResult, Evidence, Finding

# why a check of replicas cannot look at a pipeline (said once for all of them)
PIPELINE_WHY = (
    "a pipeline with one stage per rank has no replica to compare: each parameter lives "
    "on one rank, and every stage reads the same batches and waits for its neighbours; "
    "%dt_partition shows the stages' balance"
)


def run_checks(
    evidence: Evidence, checks: Sequence[RegisteredCheck] | None = None
) -> list[CheckResult]:
    """Every check (default: all registered); one that fails is reported as not run, the
    others still run."""
    results = []
    for entry in registered() if checks is None else checks:
        name, check = entry.name, entry.run
        if entry.applies is not None and not entry.applies(evidence):
            continue
        if evidence.is_pipeline and entry.compares == "replicas":
            results.append(
                CheckResult(name, name, (), "", f"not checked: {PIPELINE_WHY}", checked=False)
            )
            continue
        if unobserved := _unobserved(evidence, entry.observes):
            results.append(
                CheckResult(
                    name,
                    name,
                    (),
                    "",
                    f"not checked: {unobserved}",
                    checked=False,
                    needs="dtlab's observations on, which the script's notes say failed",
                )
            )
            continue
        if len(evidence.records) < 2 and entry.compares != "nothing":
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


def _unobserved(evidence: Evidence, observes: Sequence[str]) -> str:
    """Why a check cannot look: what it reads was not observed on some rank (an
    observation of dtlab's switched off after it failed), else ""."""
    off: dict[tuple[str, int], list[int]] = {}
    for rank, job in sorted(evidence.jobs.items()):
        for name, step in job.unobserved:
            if name in observes:
                off.setdefault((name, step), []).append(rank)
    return "; ".join(
        f"dtlab's {name} observation was switched off on {label_ranks(ranks)} from step "
        f"{step}, after it failed (the script's notes say how)"
        for (name, step), ranks in off.items()
    )


def all_findings(results: Sequence[CheckResult]) -> list[Finding]:
    """The findings of every check, most severe first."""
    return ranked([f for result in results for f in result.findings])

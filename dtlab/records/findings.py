"""What ``%dt_doctor`` reads and says: the evidence, each check's verdict, its findings.

Evidence is collected in control/ (from the launch, the trace and, for the steps that need
it, the ranks' per-parameter records) and handed to the pure checks of analysis/:
``check(evidence) -> CheckResult``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dtlab.records.columns import StepColumns
from dtlab.records.ranks import RankInfo
from dtlab.records.steps import InitialState, JobInfo, StepRecord, aligned_steps


@dataclass(frozen=True)
class Finding:
    """Something wrong that an analysis found: what, where, since when, why we think so."""

    kind: str  # "divergence", "leak", "straggler", ...
    ranks: tuple[int, ...]
    summary: str
    step: int | None = None
    evidence: dict[str, object] = field(default_factory=dict)
    fix: str = ""
    severity: str = "warning"  # "error" (training is wrong), "warning" (slow/fragile), "advice"


@dataclass(frozen=True)
class Evidence:
    """Everything known about the job, keyed by rank."""

    records: Mapping[int, Sequence[StepRecord]]  # whole-step summaries, in step order
    names: tuple[str, ...]  # parameter names in module order
    jobs: Mapping[int, JobInfo] = field(default_factory=dict)
    ranks: Mapping[int, RankInfo] = field(default_factory=dict)  # from the launch
    cores_by_host: Mapping[str, int] = field(default_factory=dict)
    # per-parameter records of the steps some check asked for (e.g. where ranks differ)
    details: Mapping[int, Sequence[StepRecord]] = field(default_factory=dict)
    initial: Mapping[int, InitialState] = field(default_factory=dict)  # before step 1
    # the records' numbers as columns (a Trace keeps them as records arrive); built from
    # ``records`` when not given
    columns: StepColumns | None = field(default=None, compare=False)
    # one SUMMARY row (records/summaries.py) per step the trace's window left behind: the
    # steps before those in ``records`` (None or empty: every step is in ``records``)
    history: Any = field(default=None, compare=False)

    @cached_property
    def step_columns(self) -> StepColumns:
        """The records as columns: a Trace's own, else built from ``records`` (once)."""
        return self.columns if self.columns is not None else StepColumns.from_records(self.records)

    @cached_property
    def per_rank(self) -> dict:
        """``{rank: its rows (ROW) in step order}`` (:meth:`StepColumns.by_rank`)."""
        return self.step_columns.by_rank()

    @cached_property
    def table(self):
        """``(steps, ranks, rows)``: the steps every rank recorded, and a steps x ranks
        structured array of their numbers (:meth:`StepColumns.aligned`)."""
        return self.step_columns.aligned(tuple(self.records))

    @cached_property
    def aligned(self) -> list[tuple[int, dict[int, StepRecord]]]:
        """``[(step, {rank: record})]`` for the steps every rank recorded (made once)."""
        return aligned_steps(self.records)

    @cached_property
    def is_pipeline(self) -> bool:
        """Ranks hold different parameters: one pipeline stage each, not replicas."""
        return len({tuple(p.name for p in job.params) for job in self.jobs.values()}) > 1


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: its findings, or why it passed (for ``--explain``)."""

    check: str  # short name, e.g. "environment"
    title: str  # what it checks, in a few words
    findings: tuple[Finding, ...]
    looked_at: str  # what it read, e.g. "4 ranks x 40 steps of sample indices"
    passed_because: str = ""  # when there is no finding: why that means healthy
    checked: bool = True  # False: it could not look (recording off, too few steps, ...)
    needs: str = ""  # when not checked: what would let it look

    @property
    def passed(self) -> bool:
        return not self.findings

    @property
    def outcome(self) -> str:
        """One of three, never two: "found", "passed" (it looked) or "not checked"."""
        if self.findings:
            return "found"
        return "passed" if self.checked else "not checked"

    @property
    def verdict(self) -> str:
        if self.findings:
            return f"{len(self.findings)} finding(s)"
        return self.outcome

"""Helpers every doctor check shares: what it looked at, and findings in the order shown.

The evidence a check reads and the verdict it returns are records
(:mod:`dtlab.records.findings`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dtlab.records import Finding, StepRecord

SEVERITY_ORDER = {"error": 0, "warning": 1, "advice": 2}


def shape_of(records: Mapping[int, Sequence[StepRecord]]) -> str:
    """E.g. "4 ranks x 40 steps", for what a check looked at."""
    return f"{len(records)} ranks x {max((len(r) for r in records.values()), default=0)} steps"


def ranked(findings: Sequence[Finding]) -> list[Finding]:
    """Most severe first, then earliest step, then lowest rank."""
    return sorted(
        findings,
        key=lambda f: (SEVERITY_ORDER.get(f.severity, 3), f.step or 0, f.ranks[:1] or (0,)),
    )

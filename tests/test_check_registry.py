"""The doctor's check registry: every ``checks_*`` module's checks are found, in report
order, and what a check compares decides when the doctor says it could not look."""

from __future__ import annotations

import pytest

from dtlab.analysis import registry
from dtlab.analysis.doctor import run_checks
from dtlab.analysis.registry import check, registered
from dtlab.records import CheckResult, Evidence


def test_every_check_module_registers_its_checks_in_report_order():
    names = [c.name for c in registered()]
    assert names == [
        "environment",
        "earlier_steps",  # only when a long run's window has moved (tests/test_window.py)
        "learning",
        "initial_state",
        "gradient_sync",
        "buffers",
        "accumulation",
        "deepspeed",
        "numerics",
        "data_order",
        "learning_rate",
        "update_size",
        "memory",
        "stragglers",
    ]
    replicas = {c.name for c in registered() if c.compares == "replicas"}
    assert replicas == {"initial_state", "gradient_sync", "buffers", "data_order", "stragglers"}


def test_a_check_that_cannot_compare_is_not_called_and_says_why(monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "_REGISTRY", {})

    @check("probe_ranks", order=1, compares="ranks")
    def probe_ranks(evidence: Evidence) -> CheckResult:
        calls.append("ranks")
        return CheckResult("probe_ranks", "probe", (), "everything")

    @check("probe_self", order=2)
    def probe_self(evidence: Evidence) -> CheckResult:
        calls.append("self")
        return CheckResult("probe_self", "probe", (), "everything")

    entries = [c for c in registry._REGISTRY.values()]
    one_rank = Evidence(records={0: ()}, names=())
    results = run_checks(one_rank, entries)
    assert calls == ["self"]
    assert [(r.check, r.outcome) for r in results] == [
        ("probe_ranks", "not checked"),
        ("probe_self", "passed"),
    ]
    assert results[0].needs == "launch two or more ranks"


def test_two_checks_cannot_share_a_name_and_compares_is_checked(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})

    @check("twin", order=1)
    def first(evidence):
        raise AssertionError("not run")

    with pytest.raises(ValueError, match="two doctor checks are named 'twin'"):

        @check("twin", order=2)
        def second(evidence):
            raise AssertionError("not run")

    with pytest.raises(ValueError, match="compares must be one of"):
        check("odd", order=3, compares="everything")

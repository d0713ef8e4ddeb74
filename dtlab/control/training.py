"""The attached training job, as the notebook drives it: ``dt.step``, ``dt.run_until``,
``dt.grads``, ``dt.doctor`` (the ``dt.training`` feature of a Session).

Each feature is collect (ranks record every step, see :mod:`dtlab.agent.job`) -> combine
(pure functions in :mod:`dtlab.analysis`) -> present (views).
"""

from __future__ import annotations

from collections.abc import Callable

from dtlab.agent import api
from dtlab.analysis.conditions import parse_condition
from dtlab.analysis.divergence import (
    find_divergence,
    first_divergent_step,
    tensor_diff,
)
from dtlab.analysis.doctor import all_findings, run_checks
from dtlab.control.errors import DtlabError, OptionError
from dtlab.control.rescue import Recovery
from dtlab.control.stepper import Stepper
from dtlab.control.world import World
from dtlab.records import CheckResult, Condition, Evidence, Finding, RunResult

DEFAULT_MAX_STEPS = 100_000
EVIDENCE_TIMEOUT_S = 60.0


class Training:
    """Stepping the attached job and reading what it did (``dt.training``; ``dt.step`` is
    ``dt.training.step``)."""

    def __init__(self, world: World, stepper: Stepper, recovery: Recovery) -> None:
        self.world = world
        self.stepper = stepper
        self.recovery = recovery

    def step(
        self,
        num_steps: int = 1,
        *,
        record: bool | None = None,
        timeout: float | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RunResult:
        """Run ``num_steps`` optimizer steps on every rank; returns when all are done.

        Ctrl-C pauses every rank after the same step, then raises StepInterrupted (a
        KeyboardInterrupt, so a loop of calls stops; its ``result`` is this run's); a
        second Ctrl-C sends SIGINT. ``record`` overrides the job's per-parameter
        recording for these steps.
        """
        return self.recovery.resilient(
            num_steps,
            lambda steps: self.stepper.run(
                steps, None, record=record, timeout=timeout, progress=progress
            ),
        )

    def run_until(
        self,
        condition: str | Condition,
        *,
        max_steps: int = DEFAULT_MAX_STEPS,
        record: bool | None = None,
        timeout: float | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RunResult:
        """Step until ``condition`` (e.g. ``"loss>5"``, ``"nonfinite"``, ``"diverged"``)
        holds on any rank, or ``max_steps``; every rank pauses after the same step.
        Ctrl-C: as for :meth:`step`."""
        cond = parse_condition(condition) if isinstance(condition, str) else condition
        if cond.kind == "diverged":
            self.stepper.sync_job()  # the attached job's trace, made now if need be
        trace = self.stepper.trace
        if (
            cond.kind == "diverged"
            and trace is not None
            and len({info.params for info in trace.jobs.values()}) > 1
        ):
            raise DtlabError(
                "'diverged' compares replicas, and this job's ranks hold different parameters "
                "(pipeline stages): there is nothing for them to agree on"
            )
        return self.recovery.resilient(
            max_steps,
            lambda steps: self.stepper.run(
                steps, cond, record=record, timeout=timeout, progress=progress
            ),
        )

    def pause(self) -> None:
        """Ask a run in progress (the dashboard's) to stop at the next step boundary."""
        self.stepper.pause()

    def collectives_may_hang(self) -> bool:
        """A run was ended by SIGINT: a collective it issued may never complete, and
        tearing the process group down would wait for it (relaunch must replace engines)."""
        return self.stepper.interrupted

    def watch_modules(self, on: bool = True) -> None:
        """While on, every rank checks each module's forward output for inf/nan (~20% of a
        step here) and the records name the first module that produced one. Always on
        during ``run_until("nonfinite")``."""
        self.stepper.watch_modules = bool(on)

    # --- tensors, on request only ------------------------------------------------------
    def grads(self, name: str, ranks=None, step: int | None = None) -> dict:
        """``{rank: numpy array}``: the gradient of parameter ``name`` after the last step.

        Ranks keep only the latest gradients, so ``step`` must be that step (or None).
        """
        return self._tensors(name, "grad", ranks, step)

    def params(self, name: str, ranks=None, step: int | None = None) -> dict:
        """``{rank: numpy array}``: the value of parameter ``name`` after the last step."""
        return self._tensors(name, "param", ranks, step)

    def _tensors(self, name: str, what: str, ranks, step: int | None) -> dict:
        last = self.stepper.trace.last_step if self.stepper.trace is not None else 0
        if step is not None and step != last:
            raise OptionError(
                f"ranks keep only the tensors of the latest step ({last}), not step {step}; "
                f"use %dt_run --until step>={step} to stop there and look"
            )
        return self.stepper.tensors(name, what, self.world.select(ranks))

    def step_details(self, step: int, ranks=None) -> dict:
        """``{rank: StepRecord}`` of one step with its per-parameter norms and fingerprints,
        fetched from the ranks' buffers (the trace keeps whole-step summaries only)."""
        return self.stepper.details(step, self.world.select(ranks))

    # --- findings ----------------------------------------------------------------------
    def divergence(self, kind: str = "param"):
        """The first (step, parameter) where ranks' fingerprints differ, or None.

        The summaries say at which step; that step's per-parameter records say which
        parameter (fetched from the ranks)."""
        trace = self.stepper.require_trace()
        step = first_divergent_step(trace.records, kind=kind)
        if step is None:
            return None
        details = {rank: [rec] for rank, rec in self.step_details(step).items()}
        return find_divergence(details, trace.param_names, kind=kind)

    def divergence_detail(self, kind: str = "param") -> dict:
        """For the first divergence: ``{rank: TensorDiff}`` of each outlier rank's tensor
        against the first majority rank, fetched now (the latest step, not the first bad
        one)."""
        found = self.divergence(kind)
        if found is None:
            return {}
        reference = found.majority[0]
        tensors = self._tensors(found.param, kind, [reference, *found.outliers], None)
        return {r: tensor_diff(tensors[reference], tensors[r]) for r in found.outliers}

    def evidence(self) -> Evidence:
        """What the doctor's checks read: the launch, the trace's summaries, and the
        per-parameter records of the steps where ranks' fingerprints first differ."""
        trace = self.stepper.require_trace()
        kinds = ("grad", "param", "buffer")
        pipeline = len({info.params for info in trace.jobs.values()}) > 1
        # stages hold different parameters: their fingerprints differ by design
        steps = (
            set()
            if pipeline
            else {
                first_divergent_step(
                    trace.records, kind=kind, table=trace.columns.aligned(trace.ranks)
                )
                for kind in kinds
            }
        )
        details: dict[int, list] = {rank: [] for rank in trace.ranks}
        for step in sorted(s for s in steps if s is not None):
            try:
                found = self.step_details(step)
            except DtlabError:  # evicted from a rank's buffer: the summaries still tell
                continue
            for rank, rec in found.items():
                details[rank].append(rec)
        cores: dict[str, int] = {}
        for facts in self.world.facts.values():  # engines of a host may see different cores
            cores[facts.host] = max(cores.get(facts.host, 0), facts.num_cpus)
        now = self.world.run(api.rank_now, timeout=EVIDENCE_TIMEOUT_S)  # env may have changed
        return Evidence(
            records=trace.records,
            columns=trace.columns,
            history=trace.history.rows(),
            names=trace.param_names,
            jobs={**trace.jobs, **{rank: job for rank, (_, _, job) in now.items()}},
            ranks={rank: info for rank, (info, _, _) in now.items()},
            cores_by_host=cores,
            details=details,
            initial={rank: start for rank, (_, start, _) in now.items() if start is not None},
        )

    def checks(self) -> list[CheckResult]:
        """Every doctor check on the records so far (kept with the trace)."""
        results = run_checks(self.evidence())
        self.stepper.require_trace().keep_checks(results)
        return results

    def doctor(self) -> list[Finding]:
        """The findings of every check, most severe first (empty on a healthy job)."""
        return all_findings(self.checks())

    findings = doctor  # the name the stepping API had first

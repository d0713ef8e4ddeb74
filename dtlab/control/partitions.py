"""Pipeline partitions of the attached job, as the notebook drives them (``dt.pipeline``).

``dt.partition()`` the current plan, ``dt.balance()`` how it balances (measured on the
last step), ``dt.profile_blocks()`` each block's measured cost, ``dt.predict(plan)`` a
plan's balance before applying it, ``dt.repartition(plan)`` moves the boundaries of the
running job (:mod:`dtlab.agent.repartition`), ``dt.partition_editor()`` the widget.

Each is collect (``StageReport`` / ``BlockCost`` from every rank) -> combine
(:mod:`dtlab.analysis.balance`, :mod:`dtlab.analysis.partition`) -> present (views).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtlab.agent import api
from dtlab.analysis import timing
from dtlab.analysis.balance import Balance, compare, measured_balance, predict_balance
from dtlab.analysis.partition import parse_plan
from dtlab.control.checkpointing import Checkpointing
from dtlab.control.errors import DtlabError, RankError
from dtlab.control.stepper import Stepper
from dtlab.control.training import Training
from dtlab.control.world import World
from dtlab.records import Plan, PlanError
from dtlab.records.stages import BlockCost, StageReport

MOVE_TIMEOUT_S = 120.0
TRIAL_ROUNDS = 3  # alternating rounds of old and new plan in dt.try_plan ...
TRIAL_STEPS = 4  # ... each this many timed steps (after one untimed step per move)


class NotAPipeline(DtlabError):
    """The attached job is not a pipeline, so it has no partition to show or move."""


class RepartitionFailed(DtlabError):
    """A live re-partition did not happen; the message says whether the job is intact."""


# --- on the ranks ---------------------------------------------------------------------
class Pipeline:
    """Pipeline partitions: balance, plans, profiles and live moves (``dt.pipeline``)."""

    def __init__(
        self, world: World, stepper: Stepper, checkpointing: Checkpointing, training: Training
    ) -> None:
        self.world = world
        self.stepper = stepper
        self.checkpointing = checkpointing
        self.training = training
        self.block_costs: dict[str, BlockCost] | None = None  # measured, by block name

    def stage_reports(self) -> dict[int, StageReport]:
        """{rank: what its stage holds and its last step's schedule}."""
        return self._on_stages(api.stage_report)

    def _on_stages(self, fn, *args) -> dict:
        """``fn`` on every rank's stage; a job that is no pipeline is one NotAPipeline,
        not a traceback from every rank."""
        try:
            return self.world.run(fn, *args)
        except RankError as e:
            said = {f.evalue for f in e.failures.values()}
            if len(said) == 1 and "not a pipeline" in next(iter(said)) and not e.stuck:
                raise NotAPipeline(next(iter(said))) from None
            raise

    def partition(self) -> Plan:
        """The plan the running pipeline uses (as its ranks report it)."""
        return self.partition_from(self.stage_reports())

    def profile_blocks(self, repeats: int = 3) -> dict[str, BlockCost]:
        """Measure every block's forward, backward and activations on its rank, on the
        last step's first micro-batch (run a step first). Kept for ``measured`` plans."""
        costs = {
            c.name: c
            for per_rank in self._on_stages(api.profile_blocks, repeats).values()
            for c in per_rank
        }
        self.block_costs = costs
        return dict(costs)

    def balance(self) -> Balance:
        """The running plan's balance, measured on its last step (and block profile)."""
        reports = self.stage_reports()
        return measured_balance(self.partition_from(reports), reports)

    def partition_from(self, reports) -> Plan:
        order = sorted(reports, key=lambda r: reports[r].stage)
        blocks = tuple(b for r in order for b in reports[r].blocks)
        bounds = [0]
        for rank in order:
            bounds.append(bounds[-1] + len(reports[rank].blocks))
        return Plan(blocks, tuple(bounds))

    def plan(self, spec: Any) -> Plan:
        """Read ``spec`` (any form :func:`~dtlab.analysis.partition.parse_plan` reads)
        for this job; PlanError says what is wrong with it."""
        return self._read(spec, self.stage_reports())[1]

    def predict(self, spec: Any) -> Balance:
        """How ``spec`` would balance, from the blocks' measured costs (profile first)."""
        reports = self.stage_reports()
        _, plan, costs = self._read(spec, reports)
        first = next(iter(reports.values()))
        return predict_balance(
            plan, costs, microbatches=first.microbatches, schedule=first.schedule
        )

    def _read(self, spec: Any, reports) -> tuple[Plan, Plan, dict[str, BlockCost]]:
        """(the running plan, ``spec`` read for this job, the block costs), from one
        round of reports."""
        current, costs = self.partition_from(reports), self.costs(reports)
        return current, parse_plan(spec, current.blocks, current.num_stages, costs=costs), costs

    def costs(self, reports=None) -> dict[str, BlockCost]:
        """Each block's cost: measured where profiled, else its size from the reports."""
        reports = self.stage_reports() if reports is None else reports
        sizes = {c.name: c for r in reports.values() for c in r.costs}
        return {**sizes, **(self.block_costs or {})}

    def repartition(self, spec: Any, *, timeout: float = MOVE_TIMEOUT_S) -> dict:
        """Move the running pipeline's boundaries to ``spec``: blocks that change stage
        travel with their weights and optimizer state; nothing restarts.

        A bad plan raises PlanError before anything moves. If the move fails, no rank
        changed (each rank commits only after all said they are ready); if a rank died
        in it, RepartitionFailed says so and names the last checkpoint to restart from."""
        old, new, _ = self._read(spec, self.stage_reports())
        if new == old:
            return {"moved": {}, "plan": new, "seconds": 0.0}
        move_id = secrets.token_hex(8)  # names the commit-or-abort decision in the store
        try:
            done = self.world.run(
                api.move_blocks, new.blocks, new.bounds, timeout, move_id, timeout=timeout + 30
            )
        except RankError as e:
            self.stepper.regroup_next()  # an agreement may be left pending in the group
            raise RepartitionFailed(self._move_failure(e)) from None
        self.checkpointing.rebuild_with_plan(list(new.bounds))
        self.stepper.new_trace(describe=True, repartitioned=new.describe())  # new stages
        first = next(iter(done.values()))
        return {
            "moved": first["moved"],
            "plan": new,
            "seconds": max(d["seconds"] for d in done.values()),
            "bytes": sum(d["bytes_sent"] for d in done.values()),
        }

    def try_plan(
        self,
        spec: Any,
        *,
        rounds: int = TRIAL_ROUNDS,
        steps: int = TRIAL_STEPS,
        progress: Callable[[str], None] | None = None,
    ) -> PlanTrial:
        """Move to ``spec`` and time it against the running plan in alternating rounds
        (old, new, old, new, ...), ending on ``spec``: each round runs one untimed step
        after its move, then ``steps`` timed ones. Every move is a live re-partition that
        carries weights and optimizer state, so the job trains on as if nothing moved; the
        alternation makes the verdict immune to a machine whose load drifts while it is
        measured (:func:`dtlab.analysis.timing.interleaved_change`)."""
        if rounds < 1 or steps < 1:
            raise DtlabError(f"rounds and steps must be >= 1, got {rounds}, {steps}")
        old, new, _ = self._read(spec, self.stage_reports())
        if new == old:
            raise DtlabError("that plan is the one running: nothing to compare it with")
        say = progress or (lambda text: None)
        samples: list[tuple[list[float], list[float]]] = []
        first_move: dict | None = None
        move_s: list[float] = []
        before = after = None
        for r in range(rounds):
            say(f"round {r + 1}/{rounds}: {steps} steps of the running plan...")
            a = self._timed(steps, warmup=r > 0)
            before = self.balance()
            say(f"round {r + 1}/{rounds}: moving, then {steps} steps of the new plan...")
            moved = self.repartition(new)
            first_move, move_s = first_move or moved, [*move_s, moved["seconds"]]
            b = self._timed(steps, warmup=True)
            samples.append((a, b))
            after = self.balance()
            if r + 1 < rounds:
                self.repartition(old)
        assert first_move is not None and before is not None and after is not None
        judged = timing.interleaved_change(samples)
        return PlanTrial(old, new, before, after, judged, first_move, move_s, samples)

    def _timed(self, steps: int, *, warmup: bool) -> list[float]:
        """Run (one untimed step, then) ``steps`` steps; each one's time as the slowest
        stage saw it."""
        if warmup:  # the first step after a move allocates what the new stage needs
            self.training.step(1)
        self.training.step(steps)
        trace = self.stepper.require_trace()
        last = trace.last_step
        return timing.step_times(trace.records, range(last - steps + 1, last + 1))

    def _move_failure(self, error: RankError) -> str:
        dead = [r for r, f in error.failures.items() if f.ename == "EngineError"]
        text = str(error)
        if not dead:
            return f"the re-partition was called off; every rank kept its stage.\n{text}"
        saved = [c for c in self.checkpointing.checkpoints() if c.status == "complete"]
        offer = (
            (
                f"restart from the last checkpoint (step {saved[-1].step}): "
                "%dt_restart --from-checkpoint"
            )
            if saved
            else "no checkpoint to restart from: %dt_restart and attach the job again"
        )
        return (
            f"rank(s) {dead} died during the re-partition; the survivors kept their "
            f"stages but the pipeline cannot run without them. {offer}.\n{text}"
        )


@dataclass(frozen=True)
class PlanTrial:
    """``dt.try_plan``: the new plan against the old, timed in alternating rounds."""

    old: Plan
    new: Plan
    before: Balance  # the old plan's, measured on its last round
    after: Balance  # the new plan's, measured on its last round
    change: timing.Change  # the step time, judged round against round
    moved: dict  # the first move: blocks moved, seconds, bytes
    move_seconds: list[float]  # each move to the new plan
    rounds: list[tuple[list[float], list[float]]]  # step times (s): old's, new's per round

    def summary(self) -> str:
        took = f"moved {len(self.moved['moved'])} block(s) in {self.moved['seconds'] * 1e3:.0f} ms"
        return f"{took}; {compare(self.before, self.after, self.change)}"


__all__ = ["NotAPipeline", "Pipeline", "PlanError", "PlanTrial", "RepartitionFailed"]

"""The session: what ``%dt_launch`` binds to ``dt``, built from control/'s floors.

- core: :class:`~dtlab.control.world.World` (the ranks, their engines, calls on them) and
  :class:`~dtlab.control.hangs.Hangs` (sidecars: what a stuck rank is doing);
- stepping: :class:`~dtlab.control.stepper.Stepper` (the channel, the trace, the current
  step, when a run counts as hung);
- features, each told in its constructor which others it uses (the edges form a DAG,
  checked by ``tests/test_layers.py``): checkpointing, scripts, recovery, training,
  replays, pipeline, comm.

This module only builds them, wires what the core must hear of (a failed call to explain,
a run in flight, engines replaced or stopped), and forwards the short names users know
(``dt.step`` is ``dt.training.step``) from one table, :data:`FORWARDS`.
"""

from __future__ import annotations

from dtlab.control.checkpointing import Checkpointing
from dtlab.control.comm_bench import Comm
from dtlab.control.hangs import Hangs
from dtlab.control.partitions import Pipeline
from dtlab.control.replays import Replays
from dtlab.control.rescue import Recovery
from dtlab.control.scripts import Scripts
from dtlab.control.stepper import Stepper
from dtlab.control.training import Training
from dtlab.control.world import World
from dtlab.records.trace import Trace

# dt.<name> is dt.<part>.<name>: a part's method or setting under the name users know
FORWARDS: dict[str, tuple[str, ...]] = {
    "world": (
        "config", "engines", "rank_map", "facts", "infos", "closed", "activity", "calls",
        "world_size", "ranks", "backend", "inconsistencies", "pids", "select", "client",
        "check_controller", "dead_ranks", "submit", "run", "run_each", "execute", "push",
        "pull", "status", "renew",
    ),
    "hangs": ("hang_report",),
    "stepper": ("hang_timeout", "current_step", "require_trace", "run_async"),
    "training": (
        "step", "run_until", "pause", "collectives_may_hang", "watch_modules", "grads",
        "params", "step_details", "divergence", "divergence_detail", "evidence", "checks",
        "doctor", "findings",
    ),
    "checkpointing": (
        "checkpoint_root", "checkpoint_mirror", "mirror", "checkpoint", "checkpoint_every",
        "checkpoints",
        "load_checkpoint", "set_job_setup",
    ),
    "replays": ("record_outputs", "resume_check", "replay", "bisect"),
    "recovery": ("restart", "auto_restart", "restarts"),
    "pipeline": (
        "stage_reports", "partition", "profile_blocks", "balance", "plan", "predict",
        "costs", "repartition", "try_plan", "block_costs", "partition_from",
    ),
    "comm": ("bandwidth_sweep", "sweeps"),
}  # fmt: skip


class _Forward:
    def __init__(self, part: str, name: str):
        self.part, self.name = part, name
        self.__doc__ = f"dt.{name} is dt.{part}.{name}"

    def __get__(self, session, owner=None):
        if session is None:
            return self
        return getattr(getattr(session, self.part), self.name)

    def __set__(self, session, value) -> None:
        setattr(getattr(session, self.part), self.name, value)


class Session:
    """N torch.distributed ranks living in ipyparallel engines, and what dtlab does with
    them. Use ``run``/``execute``/``pull``/``push`` to work on the ranks and ``shutdown``
    (or a ``with`` block) to stop every process it started; the features' methods users
    call are forwarded under short names (``dt.step``, ``dt.checkpoint``)."""

    def __init__(self, world: World):
        self.world = world
        self.hangs = Hangs(world)
        self.stepper = Stepper(world, self.hangs)
        self.checkpointing = Checkpointing(world, self.stepper)
        self.scripts = Scripts(world, self.stepper, self.checkpointing)
        self.recovery = Recovery(world, self.stepper, self.checkpointing, self.scripts)
        self.training = Training(world, self.stepper, self.recovery)
        self.replays = Replays(world, self.stepper, self.checkpointing, self.scripts, self.training)
        self.pipeline = Pipeline(world, self.stepper, self.checkpointing, self.training)
        self.comm = Comm(world)
        # what the core hears of, from the floors above it
        world.run_in_flight = self.stepper.run_in_flight
        world.explain = self.hangs.explain_failure
        world.ask_hang = self.hangs.hang_report
        self.hangs.advice = self.recovery.advice  # what a dead rank's error says to do
        world.closing += [self.stepper.reset, self.hangs.stop_sidecars]
        world.renewed.append(self.hangs.restart_sidecars)

    @property
    def trace(self) -> Trace | None:
        """The step records of the attached job (a :class:`dtlab.Trace`), None before the
        first step."""
        return self.stepper.trace

    def run_script(self, path: str, argv=(), cwd: str | None = None, **options):
        """Run an unchanged torchrun script on every rank, paused at step 0 (see
        :meth:`dtlab.control.scripts.Scripts.run`)."""
        return self.scripts.run(path, argv, cwd, **options)

    def continue_script(self, **options):
        """Let the paused script run to its end (``dt.pause()`` / Ctrl-C pause it again)."""
        return self.scripts.continue_(**options)

    def shutdown(self) -> None:
        """Stop every engine, nanny and the controller; leaves no process behind."""
        self.world.stop()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        world = self.world
        state = (
            "shut down" if world.closed else f"{world.backend}, {world.config.launcher} launcher"
        )
        return f"<dtlab Session: {world.world_size} ranks, {state}>"


for _part, _names in FORWARDS.items():
    for _name in _names:
        setattr(Session, _name, _Forward(_part, _name))

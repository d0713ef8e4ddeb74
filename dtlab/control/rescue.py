"""Restarts (``dt.recovery``): ``dt.restart()`` / ``%dt_restart`` replaces every engine,
rebuilds the group at the same world size, attaches the job again and loads a checkpoint;
``dt.auto_restart(n)`` does it by itself when a run loses a rank or hangs, up to n times,
noted in the trace. What the ranks are doing and how the dead died is
:mod:`dtlab.control.hangs`.
"""

from __future__ import annotations

import time

from dtlab.analysis.ranks import label_ranks
from dtlab.control.checkpointing import Checkpointing
from dtlab.control.errors import DtlabError, OptionError, RankError, RankTimeoutError
from dtlab.control.scripts import Scripts
from dtlab.control.stepper import Stepper
from dtlab.control.world import World


class Recovery:
    """Restarts and their log, and automatic restarts (``dt.recovery``)."""

    def __init__(
        self, world: World, stepper: Stepper, checkpointing: Checkpointing, scripts: Scripts
    ) -> None:
        self.world = world
        self.stepper = stepper
        self.checkpointing = checkpointing
        self.scripts = scripts
        self._auto: tuple[int, object] | None = None  # (restarts left, from_checkpoint)
        self.restarts: list[dict] = []  # dt.restart() events, oldest first

    # --- restart ------------------------------------------------------------------------
    def restart(self, from_checkpoint="latest", *, reason: str = "asked", progress=None) -> dict:
        """Replace every engine (dead, hung or not), rejoin at the same world size, build
        the job again (``dt.set_job_setup``; ``%dt_demo`` sets it) and load a checkpoint
        (``"latest"``: the last complete one; a step; None: start the job afresh)."""
        t0 = time.monotonic()
        if self.stepper.active is not None:
            raise DtlabError("a dashboard run is in progress: pause it before restarting")
        if self.checkpointing.job_setup is None and self.scripts.is_current():
            event = self.scripts.restart(reason=reason, progress=progress)  # run again
            self.restarts.append({k: v for k, v in event.items() if k != "loaded"})
            return event
        self.checkpointing.refuse_unbuildable_job()
        chosen = (
            self.checkpointing.find_checkpoint(from_checkpoint)
            if from_checkpoint is not None
            else None
        )
        kept = (self.stepper.record_outputs, self.stepper.watch_modules)  # renew resets them
        if self.checkpointing.job_setup is None and chosen is not None:
            self.checkpointing.set_up_job()  # raises, saying how to give the job setup
        self.world.renew(progress)
        loaded: dict = {}
        if self.checkpointing.job_setup is not None:  # else the fresh ranks are all
            self.checkpointing.set_up_job()
            self.stepper.record_outputs, self.stepper.watch_modules = kept
            loaded = self.checkpointing.load_into_job(chosen) if chosen is not None else {}
            self.checkpointing.apply_autosave(True)
        event = {
            "time": time.time(),
            "reason": reason,
            "seconds": time.monotonic() - t0,
            "checkpoint": str(chosen.path) if chosen else None,
            "step": chosen.step if chosen else 0,
        }
        self.restarts.append(event)
        if self.checkpointing.job_setup is not None:  # the new timeline's trace: its origin
            self.stepper.new_trace(
                resumed_from=event["checkpoint"], step=event["step"], restarts=list(self.restarts)
            )
        return event | {"loaded": loaded}

    def advice(self) -> str:
        """What brings dead ranks back in the session's state now, in words (an error
        reporting a dead rank says it: ``Hangs.advice``): the restart that works here, or
        ``%dt_launch`` only where the session cannot be restored."""
        n = self.world.world_size
        if self.world.closed or not self.world.renewable:
            return f"this session cannot replace its engines: run %dt_launch {n} for a new one"
        if self.world.engines.controller_exited():
            return f"the ipyparallel controller is gone too: run %dt_launch {n} --restart"
        if self.checkpointing.job_setup is None and self.scripts.is_current():
            return (
                "dead ranks cannot be reused: dt.restart() (%dt_restart) starts fresh engines "
                "and runs the script again to the step it was at"
            )
        if self.checkpointing.job_setup is not None:
            done = [c for c in self.checkpointing.checkpoints() if c.ok]
            if done:
                latest = max(done, key=lambda c: c.created)
                return (
                    "dead ranks cannot be reused: dt.restart() (%dt_restart) starts fresh "
                    f"engines, builds the job again and loads the latest checkpoint (step "
                    f"{latest.step}); dt.restart(None) starts the job afresh"
                )
            return (
                "dead ranks cannot be reused: dt.restart(None) (%dt_restart --from-checkpoint "
                "none) starts fresh engines and builds the job afresh (no checkpoint yet)"
            )
        lost = (
            "the job attached goes with them: attach it again, or give dt.set_job_setup(fn) "
            "so that dt.restart() rebuilds it"
            if self.stepper.trace is not None
            else "what the ranks held goes with them"
        )
        return (
            "dead ranks cannot be reused: dt.restart(None) (%dt_restart --from-checkpoint none) "
            f"starts fresh engines at the same world size; {lost}"
        )

    def auto_restart(self, max_restarts: int, from_checkpoint="latest") -> None:
        """From now on, when ``dt.step`` / ``dt.run_until`` loses a rank or hangs, restart
        (``dt.restart(from_checkpoint)``) and go on to the step it was asked to reach, up
        to ``max_restarts`` times (0: off). Each restart is kept in the trace's meta."""
        if max_restarts < 0:
            raise OptionError(f"max_restarts must be >= 0, got {max_restarts}")
        if max_restarts and from_checkpoint not in (None, "latest"):
            self.checkpointing.find_checkpoint(from_checkpoint)  # said now, not at a death
        scripted = self.scripts.is_current()  # restarted by running it again
        if max_restarts and self.checkpointing.job_setup is None and not scripted:
            self.checkpointing.set_up_job()  # raises, saying how to give the job setup
        self._auto = (max_restarts, from_checkpoint) if max_restarts else None

    def resilient(self, num_steps: int, run):
        """``run(steps)`` until the job reaches ``num_steps`` more steps, restarting on a
        dead rank or a hang while automatic restarts are on."""
        end = self.stepper.current_step() + num_steps
        left = num_steps  # the first time as asked (run() says what is wrong with it)
        while True:
            try:
                return run(left)
            except RankError as e:
                auto = self._auto
                hung = isinstance(e, RankTimeoutError) and e.hang is not None
                interrupted = isinstance(e, RankTimeoutError) and "interrupted" in e.reason
                if auto is None or interrupted or not (e.dead_ranks or hung):
                    raise
                self._auto = (auto[0] - 1, auto[1]) if auto[0] > 1 else None
                try:
                    self.restart(auto[1], reason=_reason(e))
                except Exception as failed:
                    raise DtlabError(f"the automatic restart failed ({failed}) after: {e}") from e
            left = end - self.stepper.current_step()
            if left < 1:
                now = self.stepper.current_step()
                raise DtlabError(
                    f"after the restart the job is at step {now}, at or past "
                    f"step {end} asked for: nothing left to run"
                )


def _reason(error) -> str:
    """One line for the restart log: who died and how, or why it hung."""
    if error.dead_ranks:
        causes = {error.failures[r].evalue for r in error.dead_ranks}
        return f"{label_ranks(error.dead_ranks)} died ({'; '.join(sorted(causes))})"
    return f"hung: {error.report}" if error.report else str(error).splitlines()[0]

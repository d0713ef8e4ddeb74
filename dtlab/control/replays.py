"""Is a checkpoint enough to go on exactly? ``dt.resume_check``, ``dt.replay``,
``dt.bisect`` (the ``dt.replays`` feature of a Session).

Each is the same three steps: run steps twice (the run that never stopped and a resumed
one, or the original and a replay), collect both sets of per-rank step records, and
compare them with :func:`dtlab.analysis.resume.compare_runs`, which names the first step
and the state that differs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from dtlab.agent import api
from dtlab.analysis.ranks import label_ranks
from dtlab.analysis.resume import Comparison, compare_runs, first_module_difference
from dtlab.control.checkpointing import Checkpointing
from dtlab.control.errors import DtlabError, OptionError
from dtlab.control.scripts import ScriptResumeReport, Scripts
from dtlab.control.stepper import Stepper
from dtlab.control.training import Training
from dtlab.control.world import World
from dtlab.records.checkpoints import CheckpointInfo
from dtlab.records.trace import Trace


@dataclass(frozen=True)
class ResumeReport:
    """``dt.resume_check``: the run that never stopped vs. one resumed at ``checkpoint``."""

    checkpoint: CheckpointInfo
    steps: int
    fresh: bool  # resumed on fresh engines (else: the same engines, state replaced)
    comparison: Comparison
    param: str | None = None  # the first parameter whose gradient/value differs, if any
    loaded: dict = field(default_factory=dict)  # what the load restored and missed
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return self.comparison.identical

    def summary(self) -> str:
        where = "fresh engines" if self.fresh else "the same engines"
        head = f"resume at step {self.checkpoint.step} on {where}, {self.steps} steps: "
        text = head + ("identical" if self.identical else self.comparison.summary())
        if self.param:
            text += f" (first parameter that differs: {self.param})"
        missing = self.loaded.get("missing")
        if missing:
            lacks = ", ".join(f"{part} ({label_ranks(ranks)})" for part, ranks in missing.items())
            text += f"; the checkpoint lacks {lacks}"
        return text


@dataclass(frozen=True)
class ReplayResult:
    """``dt.replay``: steps re-run from a checkpoint, compared with the original run."""

    checkpoint: CheckpointInfo
    first_step: int
    last_step: int
    trace: Trace  # the replayed steps' records (summaries)
    comparison: Comparison
    details: dict  # {rank: full record} of the first differing step, replayed
    original_step_s: float | None
    replay_step_s: float | None

    @property
    def identical(self) -> bool:
        return self.comparison.identical


@dataclass(frozen=True)
class BisectResult:
    """``dt.bisect``: the first step whose outcome differs, and within it the module."""

    step: int | None
    ranks: tuple[int, ...] = ()
    module: str | None = None
    nondeterministic: bool = False
    verdict: str = ""
    replay: ReplayResult | None = None


def _step_s(records: dict, first: int, last: int) -> float | None:
    times = [r.times.total for recs in records.values() for r in recs if first <= r.step <= last]
    return statistics.median(times) if times else None


class Replays:
    """Resume checks, replays and bisection (``dt.replays``), built on the checkpointing
    feature (save, load, rebuild) and the stepper."""

    def __init__(
        self,
        world: World,
        stepper: Stepper,
        checkpointing: Checkpointing,
        scripts: Scripts,
        training: Training,
    ) -> None:
        self.world = world
        self.stepper = stepper
        self.checkpointing = checkpointing
        self.scripts = scripts
        self.training = training

    def record_outputs(self, on: bool = True) -> None:
        """While on, every step's record keeps a fingerprint of each module's forward
        output, so ``dt.bisect`` can name the module whose output first differed."""
        self.stepper.record_outputs = bool(on)

    # --- resume check ------------------------------------------------------------------
    def resume_check(
        self, steps: int = 10, *, fresh: bool = True, progress=None
    ) -> ResumeReport | ScriptResumeReport:
        """Save now (step k), run ``steps`` more, then restore step k into fresh engines
        (``fresh=False``: the live ones), run the same steps and compare every step's loss,
        fingerprints, LR, scale, data and RNG state with the run that never stopped."""
        if steps < 1:
            raise OptionError(f"steps must be at least 1, got {steps}")
        if self.checkpointing.job_setup is None and self.scripts.is_current():
            return self.scripts.resume_check(steps, fresh=fresh, progress=progress)
        if fresh and self.checkpointing.job_setup is None:
            self.checkpointing.set_up_job()  # raises, saying how to give the job setup
        t0 = time.perf_counter()
        start = self.checkpointing.checkpoint(tag="resume-check")
        k = start.step
        self.stepper.run(steps, None, record=True)  # no automatic restart inside a check
        reference = self.stepper.full_records(k + 1, k + steps)
        if fresh:
            self.world.renew(progress)
            self.checkpointing.set_up_job()
        elif self.checkpointing.job_setup is not None:
            self.checkpointing.set_up_job()
        loaded = self.checkpointing.load_checkpoint(start.path)
        # fresh engines do not know the job saved periodically
        self.checkpointing.apply_autosave(True)
        self.stepper.run(steps, None, record=True)  # no automatic restart inside a check
        resumed = self.stepper.full_records(k + 1, k + steps)
        comparison = compare_runs(reference, resumed, steps=range(k + 1, k + steps + 1))
        return ResumeReport(
            start,
            steps,
            fresh,
            comparison,
            _first_param(self.stepper, comparison, reference, resumed),
            loaded,
            time.perf_counter() - t0,
        )

    # --- replay ------------------------------------------------------------------------
    def replay(
        self,
        from_step: int,
        to_step: int | None = None,
        *,
        outputs: bool = False,
        keep_step: int | None = None,
    ) -> ReplayResult:
        """Re-run steps ``from_step..to_step`` from the newest checkpoint before them,
        record them as the original was recorded, and compare. The job then returns to
        where it was (a checkpoint taken first, loaded after). ``outputs`` records every
        module's output; ``details`` holds the full records of ``keep_step`` (default: the
        first step that differs)."""
        trace = self.stepper.require_trace()
        now = trace.last_step
        to_step = now if to_step is None else to_step
        if not 1 <= from_step <= to_step <= now:
            raise OptionError(
                f"replay needs 1 <= from_step <= to_step <= {now} (the last "
                f"step run), got {from_step}..{to_step}"
            )
        start = self._checkpoint_before(from_step)
        back = self.checkpointing.checkpoint(tag="before-replay")
        replayed = Trace(trace.jobs, meta={"replay_of": str(trace.folder), "from": start.step})
        self.world.run(api.stash_records, True)
        self.checkpointing.apply_autosave(False)
        saved_outputs = self.stepper.record_outputs
        try:
            self.checkpointing.load_into_job(start)
            self.stepper.record_outputs = outputs
            with self.stepper.tracing(replayed):
                self.stepper.run(to_step - start.step, None, record=True)
            comparison = compare_runs(
                trace.records,
                replayed.records,
                steps=range(start.step + 1, to_step + 1),
                reference_name="the original run",
                other_name="the replay",
            )
            keep = keep_step or (comparison.first.step if comparison.first else None)
            details = self.training.step_details(keep) if keep else {}
        finally:
            self.stepper.record_outputs = saved_outputs
            self._return_from_replay(back)
        return ReplayResult(
            start,
            start.step + 1,
            to_step,
            replayed,
            comparison,
            details,
            _step_s(trace.records, start.step + 1, to_step),
            _step_s(replayed.records, start.step + 1, to_step),
        )

    def _return_from_replay(self, back: CheckpointInfo) -> None:
        """Put the job back where the replay found it; if that fails, say where it is."""
        try:
            self.checkpointing.load_into_job(back)
        except Exception as e:
            raise DtlabError(
                f"the replay could not put the job back ({e}); it is at the "
                f"replay's last step; {back.path} holds where it was: "
                f"dt.load_checkpoint('{back.path}')"
            ) from e
        finally:
            self.world.run(api.stash_records, False)
            self.checkpointing.apply_autosave(True)
        self.checkpointing.remove_checkpoint(back)

    def _checkpoint_before(self, step: int) -> CheckpointInfo:
        """The newest complete checkpoint of this job's timeline (written since its trace
        began, or the one it resumed from) at or before ``step - 1``."""
        trace = self.stepper.require_trace()
        resumed_from = trace.meta.get("resumed_from")
        good = [
            c
            for c in self.checkpointing.checkpoints()
            if c.ok
            and c.step <= step - 1
            and c.tag != "before-replay"
            and (c.created >= trace.created or str(c.path) == resumed_from)
        ]
        if not good:
            raise DtlabError(
                f"no complete checkpoint at or before step {step - 1} to replay "
                "from: take them with dt.checkpoint_every(k) before the steps "
                "you may want to replay"
            )
        return max(good, key=lambda c: (c.step, c.created))

    # --- bisection ---------------------------------------------------------------------
    def bisect(self, good_step: int, bad_step: int, *, against="replay") -> BisectResult:
        """The first step after ``good_step`` whose outcome differs, up to ``bad_step``:
        between the run and its replay (``against="replay"``), between ranks
        (``"ranks"``), or against another :class:`Trace`; for a replay, then the first
        module whose output differs within that step.

        Every step's fingerprints are recorded, so one replay finds the step (no repeated
        halving is needed); the step is then replayed again to tell a non-deterministic
        step from state the checkpoint did not hold.
        """
        if not good_step < bad_step:
            raise OptionError(f"good_step must be before bad_step, got {good_step}, {bad_step}")
        if against == "ranks":
            return self._bisect_ranks(good_step, bad_step)
        if isinstance(against, Trace):
            comparison = compare_runs(
                self.stepper.require_trace().records,
                against.records,
                steps=range(good_step + 1, bad_step + 1),
                reference_name="this run",
                other_name="the other run",
            )
            first = comparison.first
            return BisectResult(
                first.step if first else None,
                first.ranks if first else (),
                verdict=comparison.summary(),
            )
        if against != "replay":
            raise OptionError(f"against must be 'replay', 'ranks' or a Trace, got {against!r}")
        return self._bisect_replay(good_step, bad_step)

    def _bisect_ranks(self, good_step: int, bad_step: int) -> BisectResult:
        found = self.training.divergence()
        if found is None or not good_step < found.step <= bad_step:
            return BisectResult(None, verdict=f"ranks agree over steps {good_step + 1}-{bad_step}")
        verdict = (
            f"ranks {list(found.outliers)} first differ from {list(found.majority)} at "
            f"step {found.step}, in the {found.kind} of {found.param}"
        )
        return BisectResult(found.step, tuple(found.outliers), verdict=verdict)

    def _bisect_replay(self, good_step: int, bad_step: int) -> BisectResult:
        first_replay = self.replay(good_step + 1, bad_step, outputs=True)
        first = first_replay.comparison.first
        if first is None:
            return BisectResult(
                None, verdict=first_replay.comparison.summary(), replay=first_replay
            )
        step = first.step
        second = self.replay(step, step, outputs=True, keep_step=step)
        again = {r: rec.module_outputs for r, rec in second.details.items()}
        once = {r: rec.module_outputs for r, rec in first_replay.details.items()}
        noise = first_module_difference(
            once, again, reference_name="the first replay", other_name="the second"
        )
        if noise is not None:
            return BisectResult(
                step,
                noise.ranks,
                noise.module,
                True,
                f"step {step} is non-deterministic: replayed twice, "
                f"{noise.explanation}; not the checkpoint's fault",
                first_replay,
            )
        return self._blame_module(step, first, once, first_replay)

    def _blame_module(self, step, first, replayed_outputs, replay) -> BisectResult:
        try:
            original = {
                r: rec.module_outputs for r, rec in self.training.step_details(step).items()
            }
        except DtlabError:
            original = {}
        if not any(original.values()):
            return BisectResult(
                step,
                first.ranks,
                verdict=(
                    f"{first.explanation}. The replay of step {step} is deterministic, so the run "
                    "met something the checkpoint does not hold; to name the module, record "
                    "module outputs during the run (dt.record_outputs()) and reproduce"
                ),
                replay=replay,
            )
        found = first_module_difference(
            original, replayed_outputs, reference_name="the original run", other_name="the replay"
        )
        module = found.module if found else None
        ranks = found.ranks if found else first.ranks
        verdict = f"{first.explanation}; " + (
            found.explanation if found else "every module's output matched the replay"
        )
        return BisectResult(step, ranks, module, False, verdict, replay)


def _first_param(
    stepper: Stepper, comparison: Comparison, reference: dict, resumed: dict
) -> str | None:
    """The first parameter whose gradient (else value) fingerprint differs at the first
    differing step, from the per-parameter tuples both runs kept."""
    first = comparison.first
    if first is None:
        return None
    names = stepper.require_trace().param_names
    for rank in first.ranks:
        a = next((r for r in reference.get(rank, ()) if r.step == first.step), None)
        b = next((r for r in resumed.get(rank, ()) if r.step == first.step), None)
        if a is None or b is None:
            continue
        for kind in ("grad_fingerprints", "param_fingerprints"):
            for name, x, y in zip(names, getattr(a, kind), getattr(b, kind), strict=False):
                if x != y:
                    return name
    return None

"""The user's own training script on the live ranks: ``dt.scripts`` (``%dt_script``,
``%dt_continue``).

``run(path, argv, cwd)`` stages:
1. the stepping channel is connected first: the paused script is stepped through it;
2. :func:`dtlab.agent.script.start` on every rank at once; while it runs, what rank 0
   prints is passed to ``on_output`` as it arrives (ipyparallel streams engine output);
3. every rank reports where it stopped: all paused at step 0 (checked to be the same
   step everywhere), or ended (exit code or error per rank, grouped); a ScriptStatus.

Then the script job is the attached job: ``dt.step`` / ``dt.run_until`` / the dashboard
run it to its next optimizer steps; ``continue_(...)`` lets it run to its end.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dtlab.agent import api
from dtlab.analysis.ranks import label_ranks
from dtlab.control.checkpointing import Checkpointing
from dtlab.control.errors import DtlabError, OptionError, RankError
from dtlab.control.stepper import Stepper
from dtlab.control.world import World
from dtlab.records import RemoteFailure, RunResult, ScriptStatus
from dtlab.records.trace import Trace

if TYPE_CHECKING:
    from dtlab.analysis.resume import Comparison

OUTPUT_WAIT_S = 2.0
DEEPSPEED_RESUME_FOLDER = "deepspeed_resume"
TO_THE_END = 10**12  # steps of a run that only the script's end (or a pause) stops


class Scripts:
    """Scripts run on the session's ranks (``dt.scripts``)."""

    def __init__(self, world: World, stepper: Stepper, checkpointing: Checkpointing) -> None:
        self.world = world
        self.stepper = stepper
        self.checkpointing = checkpointing
        self.last: ScriptStatus | None = None
        self.output: dict[int, str] = {}  # what each rank's script printed, this run
        self.attach_counts: dict[int, int] = {}  # the ranks' attach counts once it paused
        self.cwd: str | None = None
        self.record = True
        self.on_output: Callable[[str], None] | None = None  # rank 0's, as it comes
        self._shown: dict[int, int] = {}  # characters of each rank's output handed out
        # held by the call of ``run`` that is starting a script, and what it is starting
        self._starting = threading.Lock()
        self._starting_what: tuple[str, float] | None = None  # (path, when it began)

    def unshown(self, skip: tuple[int, ...] = (0,)) -> dict[int, str]:
        """What each rank (but ``skip``, whose output went out live) printed since the
        last call: ``{rank: text}``."""
        new = {}
        for rank, text in sorted(self.output.items()):
            if rank not in skip and len(text) > self._shown.get(rank, 0):
                new[rank] = text[self._shown.get(rank, 0) :]
            self._shown[rank] = len(text)
        return new

    def _printed(self, rank: int, text: str) -> None:
        self.output[rank] = self.output.get(rank, "") + text
        if rank == 0 and self.on_output is not None:
            self.on_output(text)

    def run(
        self,
        path: str,
        argv: Sequence[str] = (),
        cwd: str | None = None,
        *,
        record: bool = True,
        timeout: float | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> ScriptStatus:
        """Run ``path`` as torchrun would on every rank, until each is paused at step 0
        (set-up done, about to make the first optimizer step) or the script ended.

        A script paused from before is ended first and replaced (on each rank, by
        :func:`dtlab.agent.script.start`). A call made while another is still starting a
        script (another thread of the notebook, or a callback of that call) is refused:
        each rank would run the two starts one after the other, the second ending the
        first, and both calls would report their script paused."""
        if not isinstance(path, str) or not path:
            raise OptionError(f"the script's path must be a non-empty string, got {path!r}")
        argv = [str(a) for a in argv]
        if not self._starting.acquire(blocking=False):
            raise DtlabError(self._busy(path))
        try:
            self._starting_what = (path, time.monotonic())
            return self._run(path, argv, cwd, record, timeout, on_output)
        finally:
            self._starting_what = None
            self._starting.release()

    def _busy(self, path: str) -> str:
        """Why a second ``run`` may not start ``path`` now."""
        what = self._starting_what
        running, since = what if what is not None else ("a script", time.monotonic())
        return (
            f"cannot start {path}: another call is starting {running} on these ranks "
            f"(started {time.monotonic() - since:.1f} s ago; it returns once every rank is "
            "paused at step 0 or the script ended). Wait for that call to return: then "
            "dt.run_script again replaces the paused script, and dt.scripts.stop() ends it"
        )

    def _run(
        self,
        path: str,
        argv: list[str],
        cwd: str | None,
        record: bool,
        timeout: float | None,
        on_output: Callable[[str], None] | None,
    ) -> ScriptStatus:
        self.stepper.connect()
        self.output, self.on_output, self._shown = {}, on_output, {}
        self.stepper.on_output = self._printed  # steps bring it in their replies
        sent: dict = {}
        shown = [0, 0]  # characters of rank 0's stdout, stderr passed on

        def request(view, rank):
            sent[rank] = view.apply_async(api.start_script, path, argv, cwd, record)
            return sent[rank]

        def progress(done, total):
            if 0 in sent:  # ipyparallel streams the engine's output while it runs
                for i, text in enumerate((sent[0].stdout or "", sent[0].stderr or "")):
                    if len(text) > shown[i]:
                        self._printed(0, text[shown[i] :])
                        shown[i] = len(text)

        t0 = time.monotonic()
        try:
            states = self.world.submit(
                request, None, what=f"script {path}", timeout=timeout, progress=progress
            )
        finally:
            for ar in sent.values():  # output travels apart from the reply: let it land
                if ar.done():
                    ar.wait_for_output(OUTPUT_WAIT_S)
            progress(0, 0)
            for rank, ar in sent.items():
                if rank != 0:
                    self.output[rank] = (ar.stdout or "") + (ar.stderr or "")
        status = ScriptStatus.from_ranks(path, argv, states, time.monotonic() - t0)
        self.last, self.cwd, self.record = status, cwd, record
        _raise_failures(status)
        if status.paused:  # which job the ranks hold now: a later attach replaces it
            self.stepper.sync_job()
            self.attach_counts = dict(self.stepper.attach_counts)
            self.checkpointing.forget_job_setup()  # how to rebuild the job before: not this
        return status

    def is_current(self) -> bool:
        """Is the job on the ranks the script this object last ran (not attached since)?"""
        return bool(self.attach_counts) and self.stepper.attach_counts == self.attach_counts

    def resume_check(self, steps: int, *, fresh: bool = True, progress=None) -> ScriptResumeReport:
        """Does the script, run again to this step, go on as it goes on now? Run ``steps``
        more (the reference), then run it again from its start to the step it was at
        (fresh engines unless ``fresh=False``) and the same steps, and compare every step
        as ``%dt_resume_check`` does for attached jobs."""
        from dtlab.analysis.resume import compare_runs, without_rng

        t0 = time.monotonic()
        if self._is_deepspeed():  # through DeepSpeed's checkpoint
            k, comparison, path = self._deepspeed_resume_check(steps, fresh, progress)
            return ScriptResumeReport(
                k, steps, fresh, comparison, time.monotonic() - t0, checkpoint=path
            )
        k = self.stepper.current_step()
        self.stepper.run(steps, None, record=True)
        reference = self.stepper.full_records(k + 1, k + steps)
        self._run_to(k, fresh=fresh, progress=progress)
        self.stepper.run(steps, None, record=True)
        again = self.stepper.full_records(k + 1, k + steps)
        span = range(k + 1, k + steps + 1)
        comparison = compare_runs(without_rng(reference), without_rng(again), steps=span)
        if not comparison.identical:  # then a generator that differs may be why: name it
            comparison = compare_runs(reference, again, steps=span)
        return ScriptResumeReport(k, steps, fresh, comparison, time.monotonic() - t0)

    def _run_to(self, step: int, *, fresh: bool, progress=None) -> int:
        """The script from its start again (on fresh engines when ``fresh``), stepped to
        ``step``: recording off but for the last one. Returns the step it started at: 0,
        or where the checkpoint it loaded itself left it (a DeepSpeed script's)."""
        assert self.last is not None  # only for the current script (is_current): it ran
        path, argv = self.last.path, self.last.argv
        if fresh:
            self.world.renew(progress)
        status = self.run(path, argv, self.cwd, record=self.record, on_output=self.on_output)
        # a script that loads its own latest checkpoint (DeepSpeed's) starts past step 0
        now = max(status.steps.values(), default=0)
        if step - now > 1:
            self.stepper.run(step - now - 1, None, record=False)
        if step > now:
            self.stepper.run(1, None, record=True)
        return now

    def restart(self, *, reason: str = "asked", progress=None) -> dict:
        """Fresh engines; the script run again from its start and stepped to the step it
        was at (recording off but for the last step), whose parameter fingerprints are
        compared with the first run's: dtlab cannot load a script's own loop and data
        position into it, but a deterministic script gets back there exactly. A script
        that loads its own latest checkpoint at its start (DeepSpeed's load_checkpoint)
        goes on from there (``resumed_at`` in the event)."""
        t0 = time.monotonic()
        target = self.stepper.current_step()
        before = self._trace().at(target) if target else {}
        resumed_at = self._run_to(target, fresh=True, progress=progress)
        # only a step the run again made itself compares: one that resumed at or past the
        # target (its checkpoint is newer than what the notebook had heard) has none
        reached = resumed_at < target
        after = self._trace().at(target) if reached else {}
        differ = sorted(
            r
            for r, rec in before.items()
            if rec.param_fingerprint
            and after.get(r) is not None
            and after[r].param_fingerprint != rec.param_fingerprint
        )
        compared = (
            bool(before)
            and all(r.param_fingerprint for r in before.values())
            and all(after.get(r) is not None for r in before)
        )
        event = {
            "time": time.time(),
            "reason": reason,
            "seconds": time.monotonic() - t0,
            "checkpoint": None,
            "step": target,
            "rerun": True,
            "resumed_at": resumed_at,
            "compared": compared,
            "differ": differ,
            "why": _why_differ(before, after, target) if differ else "",
        }
        return event | {"loaded": {}}

    def continue_(self, *, timeout: float | None = None, progress=None) -> RunResult:
        """Let the paused script run free to its end (a pause, Ctrl-C or ``until`` stops
        it again at a step boundary)."""
        self._require_paused()
        return self.stepper.run(TO_THE_END, None, timeout=timeout, progress=progress)

    def refresh(self) -> ScriptStatus | None:
        """Ask the ranks where their script stands now (after a run that ended it)."""
        if self.last is None:
            return None
        states = self.world.run(api.script_status)
        if any(s is None for s in states.values()):
            return self.last
        self.last = ScriptStatus.from_ranks(self.last.path, self.last.argv, states, 0.0)
        return self.last

    def stop(self) -> dict:
        """End a paused script on every rank now (its ``finally`` blocks run)."""
        return self.world.run(api.stop_script)

    def _trace(self) -> Trace:
        assert self.stepper.trace is not None  # a script paused: its trace was started
        return self.stepper.trace

    # --- DeepSpeed: checked through its own checkpoint --------------------------------
    def _is_deepspeed(self) -> bool:
        trace = self.stepper.trace
        return trace is not None and any(j.deepspeed is not None for j in trace.jobs.values())

    def _deepspeed_resume_check(
        self, steps: int, fresh: bool, progress
    ) -> tuple[int, Comparison, str]:
        """``resume_check`` of a script that steps a DeepSpeed engine, which is restarted
        from what ``engine.save_checkpoint`` wrote (:mod:`dtlab.agent.deepspeed_checkpoint`):
        at the paused step ``k`` every rank's engine saves ``global_step<k>`` under the run
        folder's ``deepspeed_resume/``; the script goes on ``steps`` steps (the reference);
        then, on fresh engines (or the same), it runs again from its start and the engine
        ``deepspeed.initialize`` returns loads that checkpoint before the script's code
        goes on (as a script resuming from its latest checkpoint does); the same steps are
        compared, which names what DeepSpeed's checkpoint did not bring back. Returns (the
        step it resumed at, the comparison, the checkpoint's folder)."""
        from dtlab.analysis.resume import compare_runs, without_rng

        k = self.stepper.current_step()
        folder, tag = self._deepspeed_folder(), f"global_step{k}"
        try:
            saved = self.world.run(api.deepspeed_save, str(folder), tag)
        except RankError as e:
            raise DtlabError(f"DeepSpeed could not save its checkpoint at step {k}: {e}") from None
        self.stepper.run(steps, None, record=True)
        reference = self.stepper.full_records(k + 1, k + steps)
        last = self.last
        assert last is not None  # a script job is current: it ran
        if fresh:
            self.world.renew(progress)
        self.world.run(api.deepspeed_load_next, str(folder), tag)
        status = self.run(
            last.path, last.argv, self.cwd, record=self.record, on_output=self.on_output
        )
        resumed = {status.steps[r] for r in status.states}
        if resumed != {k}:
            raise DtlabError(
                f"the script resumed from {folder / tag} at step(s) {sorted(resumed)}, not {k}: "
                "does it call deepspeed.initialize once, before its training loop?"
            )
        self.stepper.run(steps, None, record=True)
        again = self.stepper.full_records(k + 1, k + steps)
        span = range(k + 1, k + steps + 1)
        names = {"other_name": "the run resumed from DeepSpeed's checkpoint"}
        comparison = compare_runs(without_rng(reference), without_rng(again), steps=span, **names)
        if not comparison.identical:
            comparison = compare_runs(reference, again, steps=span, **names)
        return k, comparison, next(iter(saved.values()))["path"]

    def _deepspeed_folder(self) -> Path:
        """Where the checks' DeepSpeed checkpoints go: the run folder, else a temporary one."""
        trace = self.stepper.trace
        base = trace.folder if trace is not None and trace.folder is not None else None
        if base is None:
            base = Path(tempfile.mkdtemp(prefix="dtlab-deepspeed-"))
        return Path(base).absolute() / DEEPSPEED_RESUME_FOLDER

    def _require_paused(self) -> None:
        if self.last is None:
            raise DtlabError("no script is running: start one with %dt_script PATH [ARGS ...]")


@dataclass(frozen=True)
class ScriptResumeReport:
    """``dt.resume_check`` of a script job: going on vs. running it again to ``step``."""

    step: int
    steps: int
    fresh: bool
    comparison: Comparison
    seconds: float = 0.0
    # what the run again started from: None, the script from its start; else the folder
    # of the checkpoint it loaded (a DeepSpeed script's own: Scripts._deepspeed_resume_check)
    checkpoint: str | None = None

    @property
    def identical(self) -> bool:
        return self.comparison.identical

    def summary(self) -> str:
        where = "fresh engines" if self.fresh else "the same engines"
        if self.checkpoint is None:
            head = f"the script run again to step {self.step} on {where}, then {self.steps} steps: "
        else:
            head = (
                f"the script resumed at step {self.step} on {where} from DeepSpeed's "
                f"checkpoint {self.checkpoint}, "
                f"then {self.steps} steps: "
            )
        if self.identical or self.checkpoint is None:
            return head + ("identical" if self.identical else self.comparison.summary())
        from dtlab.analysis.resume import CAUSES

        first = self.comparison.first
        causes = [d for d in self.comparison.at_first_step if d.field in CAUSES]
        if any(d.field == "indices" for d in causes):  # says which samples: enough
            causes = [d for d in causes if d.field != "input_fingerprints"]
        if first is None or not causes:
            return head + self.comparison.summary()
        return head + (
            f"first difference at step {first.step}, from what the checkpoint did not "
            "restore: " + "; ".join(d.explanation for d in causes)
        )


def _why_differ(before: dict, after: dict, step: int) -> str:
    """What the first run and the run again already differed in at ``step`` (the samples,
    an RNG, the LR...), from the two step summaries."""
    from dtlab.analysis.resume import compare_runs

    ranks = before.keys() & after.keys()
    found = compare_runs(
        {r: [before[r]] for r in ranks},
        {r: [after[r]] for r in ranks},
        steps=[step],
        reference_name="the first run",
        other_name="the run again",
    )
    return found.first.explanation if found.first is not None else ""


def _raise_failures(status: ScriptStatus) -> None:
    """A script that failed on some ranks is one error naming them (the ranks stay)."""
    failed = {r: o for r, o in status.outcomes.items() if o and o["kind"] == "failed"}
    if failed:
        failures = {
            r: RemoteFailure(o["ename"], f"{o['evalue']} ({status.where(r)})", o["traceback"])
            for r, o in failed.items()
        }
        finished = [r for r in status.states if r not in failed]
        raise RankError(f"script {status.path}", failures, finished=finished)
    steps = {status.steps[r] for r, s in status.states.items() if s == "paused"}
    if len(steps) > 1:
        raise DtlabError(
            f"ranks paused at different steps {sorted(steps)}: "
            f"{label_ranks(status.states)} should agree"
        )

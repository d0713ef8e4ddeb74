"""What a notebook connected to a ``dtlab.run`` job does with it: :class:`ConnectedJob`
(made by :func:`dtlab.control.connect.connect`, which finds the job and claims it).

- ``pause()`` holds every rank after the same optimizer step: each rank is asked where it
  is (its engine answers on a thread of its own, even mid-step), told to hold after one
  step past the furthest, and asked again if one had already gone past it;
- ``step(n)`` lets them run n steps and hold again; ``run_until(cond)`` one step at a
  time until ``cond`` holds on a rank (its record of the step read from its engine);
  ``continue_()`` lets them run on;
- ``run_code(code)`` / ``execute(code)`` run ``%%dt`` code on held ranks with
  ``script_locals`` (the script's variables where it holds) and ``script`` (its module);
  ``stacks()`` every thread's stack, at any time, a held script's first;
- ``trace``/``checks()``/``doctor()`` read every step recorded since the job began, from
  its folder;
- ``disconnect()`` continues a held job first; the job runs on with nothing lost.

A hold and a claim are leased (:mod:`dtlab.agent.batch_engine`): a thread renews them; a
notebook that dies stops renewing, and the job goes on by itself ``lease_s`` later.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab.agent import api
from dtlab.analysis.conditions import condition_holds, parse_condition
from dtlab.analysis.ranks import label_ranks, parse_rank_spec
from dtlab.control.errors import DtlabError, OptionError
from dtlab.control.training import DEFAULT_MAX_STEPS
from dtlab.records import CellOutput, Condition, RunResult
from dtlab.records import job_folder as jf
from dtlab.records.trace import Trace
from dtlab.records.wire import Stop

LEASE_S = 60.0
PAUSE_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
POLL_S = 0.02


class ConnectError(DtlabError):
    """The job cannot be connected to (said why, and what to do)."""


def outcome_of(folder: Path, rank: int) -> Path:
    """Where ``rank`` of the job in ``folder`` says how it ended."""
    return jf.rank_folder(folder, rank) / jf.OUTCOME_FILE


class ConnectedJob:
    """This notebook's connection to a ``dtlab.run`` job (see the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        world_size: int,
        client: Any,
        engines: dict[int, int],
        *,
        lease_s: float = LEASE_S,
        read_only: bool = False,
    ):
        self.folder = folder
        self.world_size = world_size
        self.read_only = read_only
        self.lease_s = lease_s
        self._client = client
        self._engines = engines
        self._token = uuid.uuid4().hex
        self._held: int | None = None  # the step every rank holds after, while paused
        self._closed = read_only
        self._renewer: threading.Thread | None = None
        self._stop_renewing = threading.Event()
        self._running = False  # a run_async in progress (the dashboard's)
        self._stop_run = False  # pause() asked it to end after its step

    def __repr__(self) -> str:
        state = (
            "ended, read-only"
            if self.read_only
            else "disconnected"
            if self._closed
            else f"paused after step {self._held}"
            if self._held is not None
            else "running"
        )
        return f"<dtlab ConnectedJob: {self.world_size} ranks, {state}, {self.folder}>"

    def __enter__(self) -> ConnectedJob:
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()

    # --- where the job is --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Disconnected (a read-only view of an ended job is never closed)."""
        return self._closed and not self.read_only

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    def current_step(self) -> int:
        """The step every rank holds after, else the furthest any rank has recorded."""
        if self._held is not None:
            return self._held
        return self.trace.last_step

    @property
    def paused_at(self) -> int | None:
        """The step every rank holds after (None: running)."""
        return self._held

    def where(self) -> dict[int, Any]:
        """{rank: Where} (its last step, the step it holds after, if it does)."""
        return self._call(api.job_where)

    def stacks(self) -> dict[int, str]:
        """Every thread's Python stack on each rank, now (running, held or hung)."""
        return self._call(api.job_stacks)

    # --- holding -----------------------------------------------------------------------
    def pause(self, timeout: float = PAUSE_TIMEOUT_S) -> int | None:
        """Hold every rank after the same optimizer step; -> that step. While a
        :meth:`run_async` is in progress (the dashboard's), end it after the step it is in
        instead (-> None: the run's result says where it held)."""
        self._live()
        if self._running:
            self._stop_run = True
            return None
        return self._hold(timeout)

    def _hold(self, timeout: float) -> int:
        if self._held is not None:
            return self._held
        deadline = time.monotonic() + timeout
        target = max(w.step for w in self.where().values()) + 1
        for _ in range(20):
            said = self._call(api.job_hold_at, self._token, target, self.lease_s)
            ahead = max(w.step for w in said.values())
            if ahead < target:
                break
            target = ahead + 1  # a rank went past it before hearing: one step later
        self._held = self._waited(target, deadline)
        return self._held

    def step(self, n: int = 1, timeout: float = PAUSE_TIMEOUT_S) -> RunResult:
        """Let every rank make ``n`` more steps and hold again (pausing it first if it
        runs); -> the RunResult, as ``Session.step`` gives it (``.last_step``: held at)."""
        self._idle()
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise OptionError(f"step(n={n!r}): give a whole number of steps >= 1")
        began = time.monotonic()
        start = self._advance(n, timeout)
        return RunResult(start, self._held or start, "steps", time.monotonic() - began)

    def run_until(
        self,
        condition: Condition | str,
        max_steps: int = DEFAULT_MAX_STEPS,
        timeout: float = PAUSE_TIMEOUT_S,
        progress: Any = None,
    ) -> RunResult:
        """Step until ``condition`` (a Condition, or text as ``%dt_run --until`` takes it:
        ``loss>4``, ``nonfinite``, ``diverged``, ``step>=N``) holds on some rank, at most
        ``max_steps`` steps; every rank holds after the step where it first held. One step
        at a time, each rank's record of it read from its engine (a few ms a step)."""
        cond = self._run_checked(condition, max_steps)
        began = time.monotonic()
        first = self._held if self._held is not None else self._hold(timeout)
        for done in range(1, max_steps + 1):
            hit = self._one_step(cond, timeout)
            if progress is not None:
                progress("run", done, max_steps)
            if hit:
                return self._ran(first, began, Stop.UNTIL, cond, hit)
        return self._ran(first, began, Stop.STEPS, cond)

    async def run_async(
        self,
        steps: int,
        until: Condition | str | None = None,
        *,
        timeout: float = PAUSE_TIMEOUT_S,
        on_progress: Callable[[], None] | None = None,
    ) -> RunResult:
        """:meth:`run_until` (or ``steps`` steps) for code on the kernel's event loop (the
        dashboard): each step waited for on a worker thread, ``on_progress()`` called on
        the loop after each; :meth:`pause` meanwhile ends the run after its step."""
        checked = self._run_checked(until or "step>=1", steps)
        cond = None if until is None else checked
        self._running, self._stop_run = True, False
        try:
            began = time.monotonic()
            first = self._held
            if first is None:
                first = await asyncio.to_thread(self._hold, timeout)
            for _ in range(steps):
                hit = await asyncio.to_thread(self._one_step, cond, timeout)
                if on_progress is not None:
                    on_progress()
                if hit:
                    return self._ran(first, began, Stop.UNTIL, cond, hit)
                if self._stop_run:
                    return self._ran(first, began, Stop.PAUSE, cond)
            return self._ran(first, began, Stop.STEPS, cond)
        finally:
            self._running = False

    def _run_checked(self, condition: Condition | str, max_steps: int) -> Condition:
        self._idle()
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise OptionError(f"max_steps={max_steps!r}: give a whole number of steps >= 1")
        return parse_condition(condition) if isinstance(condition, str) else condition

    def _one_step(self, cond: Condition | None, timeout: float) -> tuple[int, ...]:
        """One more step, held after; -> the ranks where ``cond`` holds on it."""
        self._advance(1, timeout)
        return () if cond is None else self._hit(cond, self._call(api.job_last_record))

    def _ran(
        self,
        first: int,
        began: float,
        stopped: str,
        cond: Condition | None,
        hit: tuple[int, ...] = (),
    ) -> RunResult:
        held = self._held if self._held is not None else first
        return RunResult(first, held, stopped, time.monotonic() - began, cond, hit)

    @staticmethod
    def _hit(cond: Condition, records: dict[int, Any]) -> tuple[int, ...]:
        """The ranks where ``cond`` holds on their last step ("diverged": every rank once
        their gradient or parameter fingerprints differ)."""
        recs = {r: rec for r, rec in records.items() if rec is not None}
        if cond.kind == "diverged":
            prints = {(rec.grad_fingerprint, rec.param_fingerprint) for rec in recs.values()}
            return tuple(sorted(recs)) if len(prints) > 1 else ()
        return tuple(sorted(r for r, rec in recs.items() if condition_holds(cond, rec)))

    def _advance(self, n: int, timeout: float) -> int:
        """Hold after ``n`` more steps; -> the step it started from."""
        start = self._held if self._held is not None else self._hold(timeout)
        deadline = time.monotonic() + timeout
        self._held = None
        self._call(api.job_hold_at, self._token, start + n, self.lease_s)
        self._held = self._waited(start + n, deadline)
        return start

    def records_now(self) -> dict[int, Any]:
        """{rank: the StepRecord of its last step} from the ranks themselves (the folder
        lags by up to a second while the job runs)."""
        self._live()
        return self._call(api.job_last_record)

    def continue_(self) -> None:
        """Let the job run on (still connected)."""
        self._idle()
        self._call(api.job_hold_at, self._token, None, self.lease_s)
        self._held = None

    resume = continue_

    def run_code(self, code: str, ranks: list[int] | None = None) -> dict[int, tuple[str, str]]:
        """``%%dt`` on held ranks: ``code`` with the script's variables as
        ``script_locals`` and its module as ``script``; -> {rank: (stdout, stderr)}."""
        return {r: (o.stdout, o.stderr) for r, o in self.execute(code, ranks).items()}

    def execute(
        self, code: str, ranks: str | list[int] | None = None, timeout: float = CALL_TIMEOUT_S
    ) -> dict[int, CellOutput]:
        """:meth:`run_code` as ``Session.execute`` gives a cell: {rank: CellOutput}, with
        the value of a last-line expression; ``ranks`` also as text (``0-3``, ``even``)."""
        self._idle()
        chosen = self._held_ranks(ranks)
        said = self._call(api.job_run_code, self._token, code, ranks=chosen, timeout=timeout)
        return {r: CellOutput(out, err, result) for r, (out, err, result) in said.items()}

    def pull(self, name: str, ranks: str | list[int] | None = None) -> dict[int, Any]:
        """``%dt_pull NAME`` on held ranks: {rank: the value of ``name``} (a name a ``%%dt``
        cell or :meth:`push` bound, else the script's variable where it holds)."""
        self._idle()
        return self._call(api.job_pull, self._token, name, ranks=self._held_ranks(ranks))

    def push(self, values: dict[str, Any], ranks: str | list[int] | None = None) -> None:
        """``%dt_push``: bind ``values`` (name -> object) for the ``%%dt`` cells of this
        connection on held ranks (the script's own variables are left alone)."""
        self._idle()
        self._call(api.job_push, self._token, dict(values), ranks=self._held_ranks(ranks))

    def step_details(self, step: int, ranks: str | list[int] | None = None) -> dict:
        """``{rank: StepRecord}`` of one step with its per-parameter norms and
        fingerprints, from the ranks' buffers (the folder keeps whole-step summaries)."""
        self._live()
        found = self._call(api.record_at, step, ranks=self._rank_list(ranks))
        gone = {rank: kept for rank, (rec, kept) in found.items() if rec is None}
        if gone:
            rank, (first, last) = min(gone.items())
            raise DtlabError(
                f"rank {rank} does not hold step {step} in memory (it keeps steps "
                f"{first}-{last}): pause the job and look at a step it keeps"
            )
        return {rank: rec for rank, (rec, _) in found.items()}

    def _rank_list(self, ranks: str | list[int] | None) -> list[int] | None:
        if isinstance(ranks, str):
            return list(parse_rank_spec(ranks, self.world_size))
        return ranks

    def _held_ranks(self, ranks: str | list[int] | None) -> list[int] | None:
        if self._held is None:
            raise DtlabError("the job is running: pause it first (dt.pause() or %dt_pause)")
        return self._rank_list(ranks)

    def _waited(self, step: int, deadline: float) -> int:
        """Every rank held after ``step``; else the hold is called off (a rank that gets
        there later runs on) and the error says why."""
        try:
            return self._wait_held(step, deadline)
        except BaseException:
            try:
                self._call(api.job_hold_at, self._token, None, self.lease_s, timeout=5.0)
            except DtlabError:
                pass
            raise

    def _wait_held(self, step: int, deadline: float) -> int:
        while True:
            where = self.where()
            if all(w.held == step for w in where.values()):
                return step
            past = {r: w.step for r, w in where.items() if w.step > step}
            if past:
                raise DtlabError(f"{label_ranks(sorted(past))} went past step {step}: {past}")
            ended = [r for r in where if outcome_of(self.folder, r).exists()]
            if ended:
                raise DtlabError(
                    f"{label_ranks(ended)} ended before step {step}: the job is over "
                    "(dt.trace and dt.doctor() read its folder)"
                )
            if time.monotonic() > deadline:
                behind = {r: w.step for r, w in where.items() if w.held != step}
                raise DtlabError(
                    f"not every rank reached step {step} in time: {label_ranks(sorted(behind))} "
                    f"at steps {behind}. A rank inside a step that long may be hung: "
                    "dt.stacks() shows where each rank is; dt.continue_() lets the others on"
                )
            time.sleep(POLL_S)

    # --- records -----------------------------------------------------------------------
    @property
    def trace(self) -> Trace:
        """Every step recorded so far on every rank, read from the job folder now."""
        return Trace.load(self.folder)

    def checks(self) -> list:
        """The doctor's checks (each with its findings or why it could not look) over every
        step recorded since the job began, read from the folder now."""
        from dtlab.analysis.doctor import run_checks

        trace = self.trace
        if not len(trace):
            return []
        return run_checks(jf.read_job(self.folder).evidence(trace))

    def doctor(self) -> list:
        """The doctor's findings over every step recorded since the job began."""
        from dtlab.analysis.doctor import all_findings

        return all_findings(self.checks())

    # --- leaving -----------------------------------------------------------------------
    def disconnect(self) -> None:
        """Continue the job if it is held, release it, close the connection."""
        if self._closed:
            return
        self._closed = True
        self._stop_renewing.set()
        try:
            self._call(api.job_release, self._token, timeout=10.0)
        except DtlabError as e:
            warnings.warn(f"dtlab: disconnecting: {e}", stacklevel=2)
        finally:
            self._held = None
            self._client.close()

    # --- calls ---------------------------------------------------------------------------
    def _claim(self) -> None:
        try:
            self._call(api.job_claim, self._token, self.lease_s)
        except DtlabError as e:
            if "PermissionError" in str(e):
                self._call(api.job_release, self._token)
                raise ConnectError(
                    f"another notebook is connected to the job in {self.folder}: disconnect "
                    f"it (dt.disconnect()), or wait {self.lease_s:g} s if it died"
                ) from None
            raise
        self._renewer = threading.Thread(target=self._renew, name="dtlab-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop_renewing.wait(self.lease_s / 4):
            try:
                self._call(api.job_renew, self._token, self.lease_s, timeout=self.lease_s / 4)
            except Exception:  # noqa: BLE001 - the next call says what is wrong
                pass

    def _live(self) -> None:
        if self.read_only:
            raise DtlabError(
                f"the job in {self.folder} has ended: its records are read-only "
                "(dt.trace, dt.doctor())"
            )
        if self._closed:
            raise DtlabError("disconnected from the job: dtlab.connect(run_dir) again")

    def _idle(self) -> None:
        """Connected, and no dashboard run in progress (its steps would interleave)."""
        self._live()
        if self._running:
            raise DtlabError(
                "the dashboard is running the job: press its Pause (or dt.pause()) first"
            )

    def _call(self, fn, *args, ranks: list[int] | None = None, timeout: float = CALL_TIMEOUT_S):
        """``fn(*args)`` on each rank's engine -> {rank: value}; a rank's failure is a
        DtlabError naming it."""
        if self._client is None:
            raise DtlabError(f"the job in {self.folder} has ended: nothing runs there now")
        chosen = sorted(self._engines) if ranks is None else sorted(set(ranks))
        bad = [r for r in chosen if r not in self._engines]
        if bad:
            raise OptionError(f"{label_ranks(bad)} not in this job (0-{self.world_size - 1})")
        pending = {r: self._client[self._engines[r]].apply_async(fn, *args) for r in chosen}
        results, failed = {}, {}
        for r, ar in pending.items():
            try:
                results[r] = ar.get(timeout=timeout)
            except TimeoutError:
                failed[r] = f"no answer within {timeout:g} s"
            except Exception as e:  # noqa: BLE001 - a RemoteError says the rank's own
                failed[r] = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
        if failed:
            said = "; ".join(f"rank {r}: {text}" for r, text in sorted(failed.items()))
            raise DtlabError(f"{fn.__name__}: {said}")
        return results

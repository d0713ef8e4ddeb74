"""A live set of ranks, and the calls the notebook makes on them. Everything is keyed by rank.

Each call is the same three steps: submit one request per rank (to the engine the rank
map names), wait with :func:`dtlab.control.calls.gather`, return ``{rank: value}``.
Launching, reuse and the process group live in :mod:`dtlab.control.lifecycle`.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dtlab.analysis.consistency import Inconsistency, find_inconsistencies
from dtlab.analysis.ranks import label_ranks, parse_rank_spec
from dtlab.control.activity import RankActivity
from dtlab.control.calls import gather
from dtlab.control.checkpointing import Checkpointing
from dtlab.control.cluster import EngineCluster
from dtlab.control.comm_bench import Comm
from dtlab.control.config import LaunchConfig, checked_timeout, keeping_threads
from dtlab.control.errors import DtlabError, OptionError, RankError
from dtlab.control.partitions import Pipeline
from dtlab.control.rankmap import RankMap
from dtlab.control.replays import Replays
from dtlab.control.rescue import Recovery
from dtlab.control.scripts import Scripts
from dtlab.control.stepper import Stepper
from dtlab.control.training import Training
from dtlab.records import CellOutput, EngineFacts, HangReport, RankInfo, RemoteFailure
from dtlab.records.trace import Trace

Ranks = Iterable[int] | str | None
OUTPUT_WAIT_S = 2.0  # engine output travels apart from the reply; let it catch up
INTERRUPT_REPLY_S = 2.0
INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long to wait before calling a rank stuck
STATUS_SETTLE_TRIES = 4
STATUS_SETTLE_S = 0.05


def _quiet(phase: str, done: int, total: int) -> None:
    pass


class _Forward:
    """``dt.<name>`` is ``dt.<feature>.<name>``: a feature's method or setting under the
    short name users know (``dt.step`` is ``dt.training.step``)."""

    def __init__(self, feature: str):
        self.feature = feature

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        self.__doc__ = f"dt.{name} is dt.{self.feature}.{name}"

    def __get__(self, session, owner=None):
        if session is None:
            return self
        return getattr(getattr(session, self.feature), self.name)

    def __set__(self, session, value) -> None:
        setattr(getattr(session, self.feature), self.name, value)


class Session:
    """N torch.distributed ranks living in ipyparallel engines.

    Use ``run``/``execute``/``pull``/``push`` to work on the ranks and ``shutdown`` (or a
    ``with`` block) to stop every process it started. What dtlab does with the ranks is in
    feature objects that receive the session and own their state: ``training``,
    ``checkpointing``, ``replays``, ``recovery``, ``pipeline``, ``comm``, ``scripts``; their
    methods users call are forwarded under short names (``dt.step``, ``dt.checkpoint``).
    """

    def __init__(
        self,
        config: LaunchConfig,
        engines: EngineCluster,
        rank_map: RankMap,
        facts: Mapping[int, EngineFacts],
        *,
        start: Callable[[LaunchConfig, Callable], Session] | None = None,
    ):
        self.config = config
        self._start = start  # makes a fresh Session of new engines (lifecycle.start)
        self.engines = engines
        self.rank_map = rank_map
        self.facts = dict(facts)  # by engine id
        self.infos: dict[int, RankInfo] = {}  # by rank, filled when the ranks join
        self.closed = False
        self.activity = RankActivity()  # what each rank is doing: may a request go now?
        self.calls = 0  # ipyparallel requests so far (any of them may have re-attached a job)
        self._stepper: Stepper | None = None  # the stepping channel, made on first use
        self.last_hang: HangReport | None = None  # asked of the ranks before a SIGINT
        self.training = Training(self)
        self.checkpointing = Checkpointing(self)
        self.replays = Replays(self)
        self.recovery = Recovery(self)
        self.pipeline = Pipeline(self)
        self.comm = Comm(self)
        self.scripts = Scripts(self)

    # dt.training
    step = _Forward("training")
    run_until = _Forward("training")
    pause = _Forward("training")
    collectives_may_hang = _Forward("training")
    watch_modules = _Forward("training")
    grads = _Forward("training")
    params = _Forward("training")
    step_details = _Forward("training")
    divergence = _Forward("training")
    divergence_detail = _Forward("training")
    evidence = _Forward("training")
    checks = _Forward("training")
    doctor = _Forward("training")
    findings = _Forward("training")
    # dt.checkpointing
    checkpoint_root = _Forward("checkpointing")
    checkpoint = _Forward("checkpointing")
    checkpoint_every = _Forward("checkpointing")
    checkpoints = _Forward("checkpointing")
    load_checkpoint = _Forward("checkpointing")
    set_job_setup = _Forward("checkpointing")
    # dt.replays
    record_outputs = _Forward("replays")
    resume_check = _Forward("replays")
    replay = _Forward("replays")
    bisect = _Forward("replays")
    # dt.recovery
    hang_report = _Forward("recovery")
    restart = _Forward("recovery")
    auto_restart = _Forward("recovery")
    hang_timeout = _Forward("recovery")
    restarts = _Forward("recovery")
    current_step = _Forward("recovery")
    # dt.pipeline
    stage_reports = _Forward("pipeline")
    partition = _Forward("pipeline")
    profile_blocks = _Forward("pipeline")
    balance = _Forward("pipeline")
    plan = _Forward("pipeline")
    predict = _Forward("pipeline")
    costs = _Forward("pipeline")
    repartition = _Forward("pipeline")
    try_plan = _Forward("pipeline")
    block_costs = _Forward("pipeline")
    partition_from = _Forward("pipeline")
    # dt.comm
    bandwidth_sweep = _Forward("comm")
    sweeps = _Forward("comm")

    def run_script(self, path: str, argv=(), cwd: str | None = None, **options):
        """Run an unchanged torchrun script on every rank, paused at step 0 (see
        :meth:`dtlab.control.scripts.Scripts.run`)."""
        return self.scripts.run(path, argv, cwd, **options)

    def continue_script(self, **options):
        """Let the paused script run to its end (``dt.pause()`` / Ctrl-C pause it again)."""
        return self.scripts.continue_(**options)

    # --- stepping ---------------------------------------------------------------------
    @property
    def connected_stepper(self) -> Stepper | None:
        """The stepper if stepping was ever used, else None (``stepper`` would connect it)."""
        return self._stepper

    @property
    def stepper(self) -> Stepper:
        if self._stepper is None:
            self._stepper = Stepper(self)
        return self._stepper

    @property
    def trace(self) -> Trace | None:
        """The step records of the attached job (a :class:`dtlab.Trace`), None before the
        first step."""
        return self._stepper.trace if self._stepper is not None else None

    def require_trace(self):
        if self.trace is None or self.trace.last_step == 0:
            since = self.trace.meta.get("step") if self.trace is not None else None
            if since is not None:
                raise DtlabError(
                    f"no steps recorded since the job was rewound to step {since} "
                    "(a checkpoint was loaded): run %dt_step"
                )
            raise DtlabError("no steps recorded yet: attach a job (%dt_demo) and run %dt_step")
        return self.trace

    # --- what it is -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.rank_map.world_size

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    @property
    def backend(self) -> str:
        return self.infos[0].backend if self.infos else "none"

    def inconsistencies(self) -> list[Inconsistency]:
        return find_inconsistencies(self.infos)

    def pids(self) -> list[int]:
        """Every local process of this session: controller, launchers, engines, nannies."""
        return self.engines.local_pids()

    def select(self, ranks: Ranks) -> list[int]:
        """``None`` / ``"all"`` / ``"0-3"`` / ``[0, 3]`` -> validated list of ranks."""
        if ranks is None:
            return list(self.ranks)
        if isinstance(ranks, str):
            return list(parse_rank_spec(ranks, self.world_size))
        chosen = sorted(set(ranks))
        bad = [r for r in chosen if not 0 <= r < self.world_size]
        if bad:
            raise OptionError(
                f"{label_ranks(bad)} not in this session: valid ranks are 0-{self.world_size - 1}"
            )
        return chosen

    # --- calls on ranks ---------------------------------------------------------------
    def client(self):
        """The ipyparallel client (DtlabError when the session or its controller is gone)."""
        if self.closed or self.engines.client is None:
            raise DtlabError("this session is shut down; run %dt_launch N to start a new one")
        self.check_controller()
        return self.engines.client

    def check_controller(self) -> None:
        """Raise instead of waiting for replies that a dead controller will never route."""
        if self.engines.controller_exited():
            raise DtlabError(
                "the ipyparallel controller has exited, so no rank can be reached; "
                f"run %dt_launch {self.world_size} --restart"
            )

    def check_ready(self, client, ranks: list[int], what: str) -> None:
        """Refuse ranks that are dead, or still stuck in an earlier call (a new request
        would queue behind it, and its collectives could pair with the stale ones)."""
        registered = set(client.ids)
        dead = [r for r in ranks if self.rank_map.engine_ids[r] not in registered]
        if dead:
            failures = {
                r: RemoteFailure(
                    "EngineError", f"engine {self.rank_map.engine_ids[r]} is no longer registered"
                )
                for r in dead
            }
            raise RankError(what, failures)
        if self._stepper is not None:
            self._stepper.read_late_replies()  # a run that ended meanwhile frees its ranks
        refusal = self.activity.refusal(
            ranks,
            what,
            run_in_flight=self._stepper is not None and self._stepper.active is not None,
            world_size=self.world_size,
        )
        if refusal:
            raise DtlabError(refusal)

    def dead_ranks(self, ranks: Iterable[int]) -> list[int]:
        """The ranks among ``ranks`` whose engine is gone (its nanny told the controller)."""
        registered = set(self.client().ids)
        return [r for r in ranks if self.rank_map.engine_ids[r] not in registered]

    def interrupt_and_wait(self, ranks: list[int], poll: Callable[[], list[int]]) -> list[int]:
        """SIGINT ``ranks``, then call ``poll`` (-> ranks still busy) for a grace period;
        returns the ranks that did not stop."""
        if not ranks:
            return []
        try:
            self._interrupt(ranks)
        except Exception:  # a dead engine cannot be signalled; it is reported as stuck
            pass
        remaining, deadline = list(ranks), time.monotonic() + INTERRUPT_GRACE_S
        while remaining and time.monotonic() < deadline:
            remaining = poll()
        return remaining

    def _interrupt_after_report(self, ranks: list[int]) -> None:
        """Ask every rank what it is doing before SIGINT moves any of them."""
        try:
            self.last_hang = self.recovery.hang_report()
        except Exception:  # the error must still come: it just says less
            self.last_hang = None
        self._interrupt(ranks)

    def _interrupt(self, ranks: list[int]) -> None:
        engines = self.rank_map.engines(ranks)
        reply = self.client().send_signal(signal.SIGINT, targets=engines, block=False)
        # the nannies confirm; never wait on them forever
        concurrent.futures.wait([reply], timeout=INTERRUPT_REPLY_S)

    def submit(
        self,
        request: Callable[[Any, int], Any],
        ranks: Ranks = None,
        *,
        what: str,
        timeout: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[int, Any]:
        """Send ``request(view, rank)`` to each rank's engine and gather the results."""
        timeout = checked_timeout(timeout)
        chosen = self.select(ranks)
        client = self.client()
        self.calls += 1
        self.check_ready(client, chosen, what)
        self.last_hang = None
        sent: dict[int, Any] = {}

        def send(batch: list[int]):
            sent.update({r: request(client[self.rank_map.engine_ids[r]], r) for r in batch})
            return {r: sent[r] for r in batch}

        try:
            return gather(
                send,
                chosen,
                what=what,
                timeout=timeout,
                interrupt=self._interrupt_after_report,
                progress=progress,
                check=self.check_controller,
            )
        except RankError as e:
            self.activity.mark_stuck({r: sent[r] for r in e.stuck})
            self.recovery.explain_failure(e)
            raise

    def run(
        self, fn: Callable, *args, ranks: Ranks = None, timeout: float | None = None, **kwargs
    ) -> dict[int, Any]:
        """``fn(*args, **kwargs)`` on each rank -> ``{rank: result}``."""
        name = getattr(fn, "__name__", "function")
        return self.submit(
            lambda view, r: view.apply_async(fn, *args, **kwargs),
            ranks,
            what=f"{name}()",
            timeout=timeout,
        )

    def run_each(
        self,
        fn: Callable,
        args_by_rank: Mapping[int, tuple],
        *,
        what: str,
        timeout=None,
        progress=None,
    ) -> dict[int, Any]:
        """``fn(*args_by_rank[r])`` on each rank r named in ``args_by_rank``."""
        return self.submit(
            lambda view, r: view.apply_async(fn, *args_by_rank[r]),
            list(args_by_rank),
            what=what,
            timeout=timeout,
            progress=progress,
        )

    def execute(
        self, code: str, *, ranks: Ranks = None, timeout: float | None = None
    ) -> dict[int, CellOutput]:
        """Run notebook code in each rank's namespace -> its output per rank.

        Raises RankError (with ``.outputs``, everything the ranks printed) when ranks fail.
        """
        results: dict[int, Any] = {}

        def request(view, r):
            results[r] = view.execute(code, silent=False, block=False)
            return results[r]

        try:
            self.submit(request, ranks, what="cell", timeout=timeout)
        except RankError as e:
            e.outputs = _cell_outputs(results, e.failures)
            raise
        return _cell_outputs(results, {})

    def push(
        self, values: Mapping[str, Any], ranks: Ranks = None, timeout: float | None = None
    ) -> None:
        """Bind ``values`` (name -> object) in each rank's namespace."""
        self.submit(
            lambda view, r: view.push(dict(values), block=False),
            ranks,
            what="push",
            timeout=timeout,
        )

    def pull(self, name: str, ranks: Ranks = None, timeout: float | None = None) -> dict[int, Any]:
        """The value bound to ``name`` on each rank."""
        return self.submit(
            lambda view, r: view.pull(name, block=False),
            ranks,
            what=f"pull {name}",
            timeout=timeout,
        )

    def status(self) -> dict[int, str]:
        """``{rank: "idle" | "busy" | "dead"}``, asked of the controller (ranks may be busy).

        The controller learns that a request finished a moment after the notebook does, so
        a rank that looks busy is asked about again a few times before it is called busy.
        """
        for _ in range(STATUS_SETTLE_TRIES):
            states = self._status_once()
            if "busy" not in states.values():
                break
            time.sleep(STATUS_SETTLE_S)
        return states

    def _status_once(self) -> dict[int, str]:
        client = self.client()
        registered = set(client.ids)
        queues = self.engines.queue_status() if registered else {}
        states = {}
        for rank, eid in enumerate(self.rank_map.engine_ids):
            if eid not in registered:
                states[rank] = "dead"
            else:
                q = queues.get(eid, {})
                states[rank] = "busy" if q.get("queue", 0) or q.get("tasks", 0) else "idle"
        return states

    # --- lifetime ---------------------------------------------------------------------
    def renew(self, progress=None) -> Session:
        """Replace every engine with a fresh process (same config and world size, at the
        thread count the ranks ran at) and rejoin them; this Session stays the one the user
        holds. The job attached before is gone: the caller builds it again."""
        if self._start is None:
            raise DtlabError("this session was not launched by dtlab: it cannot renew its ranks")
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None
        self.recovery.stop_sidecars()
        if not self.closed:
            self.engines.stop()
            self.closed = True  # until the new engines stand: a failed start leaves it shut
        threads = {rank: info.num_threads for rank, info in self.infos.items()}
        fresh = self._start(keeping_threads(self.config, threads), progress or _quiet)
        self.engines, self.rank_map, self.facts = fresh.engines, fresh.rank_map, fresh.facts
        self.infos = fresh.infos
        self.activity.reset()
        self.recovery.sidecars = fresh.recovery.sidecars  # joined with the fresh engines
        self.recovery.sidecar_problem = fresh.recovery.sidecar_problem
        self.closed = False
        self.calls += 1  # the job attached before lives no more
        return self

    def shutdown(self) -> None:
        """Stop every engine, nanny and the controller; leaves no process behind."""
        if self._stepper is not None:
            self._stepper.close()
        self.recovery.stop_sidecars()
        if not self.closed:
            self.engines.stop()  # if this is interrupted, a second shutdown() tries again
            self.closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self.closed else f"{self.backend}, {self.config.launcher} launcher"
        return f"<dtlab Session: {self.world_size} ranks, {state}>"


def _cell_outputs(
    results: Mapping[int, Any], failures: Mapping[int, RemoteFailure]
) -> dict[int, CellOutput]:
    outputs = {}
    for rank, ar in sorted(results.items()):
        if not ar.done():  # still running after a failure elsewhere: nothing final to show
            outputs[rank] = CellOutput(ar.stdout or "", ar.stderr or "")
            continue
        ar.wait_for_output(OUTPUT_WAIT_S)
        result = None
        if ar.exception() is None:
            data = (ar.result().execute_result or {}).get("data", {})
            result = data.get("text/plain")
        displays = [o.get("data", {}).get("text/plain", "") for o in (ar.outputs or [])]
        stdout = (ar.stdout or "") + "".join(d + "\n" for d in displays if d)
        outputs[rank] = CellOutput(stdout, ar.stderr or "", result, failures.get(rank))
    return outputs

"""The world: every rank of a session, the engines behind them, and the calls the
notebook makes on them (the core of control/: it knows no stepping and no feature).

Each call is the same three steps: submit one request per rank (to the engine the rank
map names), wait with :func:`dtlab.control.calls.gather`, return ``{rank: value}``.
Launching, reuse and the process group live in :mod:`dtlab.control.lifecycle`; what the
floors above must hear of (a failed call to explain, a run in flight, the engines
replaced) they register here as plain callables, so this module imports none of them.
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
from dtlab.control.cluster import EngineCluster
from dtlab.control.config import LaunchConfig, checked_timeout, keeping_threads
from dtlab.control.errors import DtlabError, OptionError, RankError
from dtlab.control.rankmap import RankMap
from dtlab.records import CellOutput, EngineFacts, HangReport, RankInfo, RemoteFailure
from dtlab.records.words import Word

Ranks = Iterable[int] | str | None
Progress = Callable[[str, int, int], None]
OUTPUT_WAIT_S = 2.0  # engine output travels apart from the reply; let it catch up
INTERRUPT_REPLY_S = 2.0
INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long to wait before calling a rank stuck
STATUS_SETTLE_TRIES = 4
STATUS_SETTLE_S = 0.05


class EngineStatus(Word):
    """A rank's engine as the ipyparallel controller sees it (``dt.status()``)."""

    IDLE = "idle"
    BUSY = "busy"  # a request queued or running
    DEAD = "dead"  # unregistered


def _quiet(phase: str, done: int, total: int) -> None:
    pass


def _nothing() -> None:
    pass


class World:
    """N torch.distributed ranks living in ipyparallel engines, and calls on them.

    ``run``/``run_each``/``execute``/``push``/``pull`` work on the ranks, ``status`` asks
    the controller, ``renew`` replaces every engine, ``stop`` stops every process.
    """

    def __init__(
        self,
        config: LaunchConfig,
        engines: EngineCluster,
        rank_map: RankMap,
        facts: Mapping[int, EngineFacts],
        *,
        start: Callable[[LaunchConfig, Progress], World] | None = None,
    ):
        self.config = config
        self._start = start  # a fresh World of new engines, joined (lifecycle.start_world)
        self.engines = engines
        self.rank_map = rank_map
        self.facts = dict(facts)  # by engine id
        self.infos: dict[int, RankInfo] = {}  # by rank, filled when the ranks join
        self.closed = False
        self.activity = RankActivity()  # what each rank is doing: may a request go now?
        self.calls = 0  # ipyparallel requests so far (any of them may have re-attached a job)
        self.last_hang: HangReport | None = None  # asked of the ranks before a SIGINT
        # what the floors above register (control/session.py wires them):
        self.run_in_flight: Callable[[], bool] = lambda: False  # stepping: a run is on
        self.explain: Callable[[RankError], None] = lambda error: None  # hangs: say why
        self.ask_hang: Callable[[], HangReport | None] = lambda: None  # hangs: before SIGINT
        self.closing: list[Callable[[], None]] = []  # before the engines stop
        self.renewed: list[Callable[[], None]] = []  # once fresh engines stand

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

    def listening(self) -> tuple[str, str, dict[int, RankInfo]]:
        """What :func:`dtlab.control.network.channel_hosts` needs to choose where the
        notebook's channels listen."""
        return self.config.listen, self.config.launcher, self.infos

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
            error = RankError(what, failures)
            self.last_hang = None  # (an earlier call's)
            self.explain(error)  # how they died, what the others do, what brings them back
            raise error
        refusal = self.activity.refusal(
            ranks,
            what,
            run_in_flight=self.run_in_flight(),  # (reads late replies: frees ranks)
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
            self.last_hang = self.ask_hang()
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
            self.explain(e)
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

    def status(self) -> dict[int, EngineStatus]:
        """``{rank: "idle" | "busy" | "dead"}``, asked of the controller (ranks may be busy).

        The controller learns that a request finished a moment after the notebook does, so
        a rank that looks busy is asked about again a few times before it is called busy.
        """
        for _ in range(STATUS_SETTLE_TRIES):
            states = self._status_once()
            if EngineStatus.BUSY not in states.values():
                break
            time.sleep(STATUS_SETTLE_S)
        return states

    def _status_once(self) -> dict[int, EngineStatus]:
        client = self.client()
        registered = set(client.ids)
        queues = self.engines.queue_status() if registered else {}
        states = {}
        for rank, eid in enumerate(self.rank_map.engine_ids):
            if eid not in registered:
                states[rank] = EngineStatus.DEAD
            else:
                q = queues.get(eid, {})
                busy = q.get("queue", 0) or q.get("tasks", 0)
                states[rank] = EngineStatus.BUSY if busy else EngineStatus.IDLE
        return states

    # --- lifetime ---------------------------------------------------------------------
    @property
    def renewable(self) -> bool:
        """Can ``renew`` replace the engines (a session dtlab launched)?"""
        return self._start is not None

    def renew(self, progress: Progress | None = None) -> None:
        """Replace every engine with a fresh process (same config and world size, at the
        thread count the ranks ran at) and rejoin them; this World stays the one the
        session holds. The job attached before is gone: the caller builds it again."""
        if self._start is None:
            raise DtlabError("this session was not launched by dtlab: it cannot renew its ranks")
        self._close()
        threads = {rank: info.num_threads for rank, info in self.infos.items()}
        fresh = self._start(keeping_threads(self.config, threads), progress or _quiet)
        self.engines, self.rank_map, self.facts = fresh.engines, fresh.rank_map, fresh.facts
        self.infos = fresh.infos
        self.activity.reset()
        self.closed = False
        self.calls += 1  # the job attached before lives no more
        for hear in self.renewed:
            hear()

    def stop(self) -> None:
        """Stop every engine, nanny and the controller; leaves no process behind."""
        self._close()

    def _close(self) -> None:
        for hear in self.closing:
            hear()
        if not self.closed:
            self.engines.stop()  # if this is interrupted, a second stop() tries again
            self.closed = True  # (renew: until the new engines stand)


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

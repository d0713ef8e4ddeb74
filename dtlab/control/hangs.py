"""What every rank is doing, asked out of band, and how the dead died (the core of
control/, beside the world: it knows no stepping and no feature).

- every rank runs a sidecar thread (:mod:`dtlab.agent.sidecar`) on a channel of its own,
  started at launch, so a rank stuck in a collective still says where it is;
- ``dt.hang_report()`` / ``%dt_stacks`` asks them all (bounded) and diagnoses
  (:func:`dtlab.analysis.hangs.diagnose`); runs and cells that time out attach it to
  their error; a dead rank's error says how it died (the fork server notes exit statuses).
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace

from dtlab.agent import api
from dtlab.analysis.hangs import diagnose
from dtlab.analysis.ranks import label_ranks
from dtlab.control.channel import Channel
from dtlab.control.errors import DtlabError, RankError, RankTimeoutError
from dtlab.control.network import channel_hosts
from dtlab.control.world import World
from dtlab.records import HangReport, RankReport, RemoteFailure
from dtlab.records.wire import ReportRequest, report_from

REPORT_TIMEOUT_S = 2.0  # a sidecar answers in ms; one that does not in 2 s will not
CONNECT_TIMEOUT_S = 30.0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "the engine process exited (cause unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        hint = ": kill -9 or the OOM killer" if -code == signal.SIGKILL else ""
        return f"killed by signal {-code} ({name}{hint})"
    return f"exited with code {code}"


class Hangs:
    """Hang reports and death causes (``dt.hangs``). Owns each rank's sidecar channel,
    which answers while the rank's main thread is stuck."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sidecars: Channel | None = None
        self.sidecar_problem: str | None = None  # why the sidecars could not be started
        self._report_id = 0  # numbers the questions asked of the sidecars

    def stop_sidecars(self) -> None:
        if self.sidecars is not None:
            self.sidecars.close()
            self.sidecars = None

    def start_sidecars(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Start each rank's sidecar (at launch: a stuck rank can no longer be asked to)."""
        if self.sidecars is not None:
            self.sidecars.close()
        channel = Channel(*channel_hosts(*self.world.listening()))
        try:
            where = {r: (channel.address, channel.key, r) for r in self.world.ranks}
            deadline = time.monotonic() + timeout
            self.world.run_each(
                api.start_sidecar, where, what="start the sidecars", timeout=timeout
            )
            missing = channel.wait_connected(
                self.world.ranks, max(0.1, deadline - time.monotonic())
            )
        except BaseException:
            channel.close()
            raise
        if missing:
            channel.close()
            raise DtlabError(
                f"{label_ranks(missing)} did not connect their sidecar to "
                f"{channel.address} (a firewall between the hosts?)"
            )
        self.sidecars, self.sidecar_problem = channel, None

    def restart_sidecars(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Start the sidecars on the ranks as they are now (launched, renewed, regrouped);
        one that cannot start is noted, not raised: without it, less is said of hangs."""
        try:
            self.start_sidecars(timeout=timeout)
        except DtlabError as e:
            self.sidecar_problem = str(e)

    def death_causes(self, ranks) -> dict[int, str]:
        """How each of ``ranks`` died, as far as the launcher knows."""
        exits = self.world.engines.exits()
        engine_rank = {eid: r for r, eid in enumerate(self.world.rank_map.engine_ids)}
        pids = {
            engine_rank[eid]: f.pid for eid, f in self.world.facts.items() if eid in engine_rank
        }
        return {r: describe_exit(exits.get(pids[r]) if r in pids else None) for r in ranks}

    def explain_failure(self, error: RankError) -> None:
        """Say how dead ranks died and, for a timeout, an interrupt or a death, what every
        rank was doing (added to ``error``'s message; best effort: the error itself must
        still come)."""
        dead = error.dead_ranks
        try:
            for rank, cause in self.death_causes(dead).items():
                error.failures[rank] = RemoteFailure("EngineError", cause)
            if dead or isinstance(error, RankTimeoutError):  # Ctrl-C on a hung cell too
                taken = self.world.last_hang  # before SIGINT, when there was one
                error.explain(taken if taken is not None else self.hang_report())
            else:
                error.args = (error._message(),)
        except Exception:
            pass

    def hang_report(self, ranks=None, *, timeout: float = REPORT_TIMEOUT_S) -> HangReport:
        """Ask every rank's sidecar what it is doing (the main threads may be stuck) and
        say why they are stuck."""
        chosen = self.world.select(ranks)
        dead = self.world.dead_ranks(chosen)
        alive = [r for r in chosen if r not in dead]
        reports: dict[int, RankReport | None] = {r: None for r in alive}
        if self.sidecars is not None and alive:
            reports.update(self._ask(alive, timeout))
        causes = self.death_causes(dead) if dead else {}
        verdict = diagnose(reports, causes)
        if self.sidecars is None and alive:
            why = self.sidecar_problem or "not started"
            verdict = replace(
                verdict, summary=f"ranks cannot be asked out of band ({why}); " + verdict.summary
            )
        return HangReport(verdict, reports, causes, time.time())

    def _ask(self, ranks: list[int], timeout: float) -> dict[int, RankReport]:
        assert self.sidecars is not None  # hang_report asks only when they are there
        self._report_id += 1
        asked = self._report_id
        self.sidecars.receive(0)  # late answers of an earlier question
        self.sidecars.send(ranks, ReportRequest(asked))
        got: dict[int, RankReport] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ranks) and time.monotonic() < deadline:
            for reply in self.sidecars.receive(max(0.0, deadline - time.monotonic())):
                if (report := report_from(reply, asked)) is not None:
                    got[report.rank] = report
        return got

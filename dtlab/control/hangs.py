"""What every rank is doing, asked out of band, and how the dead died (the core of
control/, beside the world: it knows no stepping and no feature).

- every rank runs a sidecar thread (:mod:`dtlab.agent.sidecar`) on a channel of its own,
  started at launch, so a rank stuck in a collective still says where it is;
- ``dt.hang_report()`` / ``%dt_stacks`` asks them all (bounded) and diagnoses
  (:func:`dtlab.analysis.hangs.diagnose`); runs and cells that time out attach it to
  their error; a dead rank's error says how it died (the fork server notes exit statuses),
  what its engine wrote last where that says why (``last_words``: gloo's, c10d's, NCCL's
  errors, C++'s "terminate called ...", read from the engine's own log), and what brings
  the ranks back (``advice``, registered by the recovery feature: ``dt.restart()`` where
  it can, ``%dt_launch`` only where the session cannot be restored).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
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
LOG_TAIL_BYTES = 64 << 10  # the end of a dead engine's log read for its last words
LAST_WORDS_LINES = 3  # lines of them in the error
LAST_WORDS_CHARS = 300  # each cut to this
# what an engine writes on its way out that says why: C++'s uncaught exception, gloo's and
# c10d's errors (a peer's size that differs: "... != ...", "8 vs 4"), NCCL's, a fatal signal
DECISIVE = re.compile(
    r"terminate called|what\(\)|enforce fail|connectFullMesh|\bGloo\b|gloo::|c10::|c10d|"
    r"ProcessGroup\w+|NCCL (?:error|WARN)|nccl\w*Error|Fatal Python error|Segmentation fault|"
    r"^\[E\d+ |\S != \S|\d vs \d"
)
# not why: a Python traceback's frames and source lines (ipyparallel logs a failed
# request's, which the notebook had in that request's error), torch's info and warnings
FRAME = re.compile(r"^(?:File |Cell In|Traceback|-*> ?\d|\d+ |\[[IW]\d+ )|\.py[:\"]")
# deaths a process says something on its way to: an abort, a crash (not kill -9, SIGTERM)
SPOKEN = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


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


def last_words(text: str) -> list[str]:
    """The lines of the end of an engine's log that say why it died (``DECISIVE``): the
    last ``LAST_WORDS_LINES`` of them, from C++'s "terminate called ..." on where there is
    one, each cut to ``LAST_WORDS_CHARS``; none when nothing there says why."""
    lines = [_ANSI.sub("", line).strip() for line in text.splitlines()]
    found = [line for line in lines if DECISIVE.search(line) and not FRAME.search(line)]
    starts = [i for i, line in enumerate(found) if line.startswith("terminate called")]
    if starts:
        found = found[starts[-1] :]
    found = found[:LAST_WORDS_LINES] if starts else found[-LAST_WORDS_LINES:]
    return [
        line if len(line) <= LAST_WORDS_CHARS else line[: LAST_WORDS_CHARS - 3] + "..."
        for line in found
    ]


def read_last_words(path: str) -> list[str]:
    """``last_words`` of the end of the log at ``path`` (none if it cannot be read)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - LOG_TAIL_BYTES))
            return last_words(log.read(LOG_TAIL_BYTES).decode("utf-8", "replace"))
    except OSError:
        return []


class Hangs:
    """Hang reports and death causes (``dt.hangs``). Owns each rank's sidecar channel,
    which answers while the rank's main thread is stuck."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sidecars: Channel | None = None
        self.sidecar_problem: str | None = None  # why the sidecars could not be started
        self._report_id = 0  # numbers the questions asked of the sidecars
        # what brings dead ranks back now, in words (the recovery feature registers it)
        self.advice: Callable[[], str | None] = lambda: None

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

    def death_causes(self, ranks, *, words: bool = True) -> dict[int, str]:
        """How each of ``ranks`` died, as far as the launcher knows, with (``words``) what
        its engine wrote last where that says why (its log: local launcher)."""
        exits = self.world.engines.exits()
        engine_rank = {eid: r for r, eid in enumerate(self.world.rank_map.engine_ids)}
        pids = {
            engine_rank[eid]: f.pid for eid, f in self.world.facts.items() if eid in engine_rank
        }
        causes = {}
        for r in ranks:
            pid = pids.get(r)
            code = exits.get(pid) if pid is not None else None
            cause = describe_exit(code)
            spoken = code is None or code > 0 or -code in SPOKEN
            log = self.world.engines.engine_log(pid) if pid and words and spoken else None
            said = read_last_words(log) if log else []
            if said:
                quoted = " / ".join(said)
                cause = f"{cause}; its engine's last words: {quoted} (the whole log: {log})"
            causes[r] = cause
        return causes

    def advise(self, error: RankError) -> None:
        """Say in ``error`` what brings its dead ranks back now (``advice``); best effort:
        without it the error keeps its general word."""
        if not error.dead_ranks or error.launching:
            return
        try:
            said = self.advice()
        except Exception:
            return
        if said:
            error.advice = said
            error.args = (error._message(),)

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
        self.advise(error)

    def hang_report(self, ranks=None, *, timeout: float = REPORT_TIMEOUT_S) -> HangReport:
        """Ask every rank's sidecar what it is doing (the main threads may be stuck) and
        say why they are stuck."""
        chosen = self.world.select(ranks)
        dead = self.world.dead_ranks(chosen)
        alive = [r for r in chosen if r not in dead]
        reports: dict[int, RankReport | None] = {r: None for r in alive}
        if self.sidecars is not None and alive:
            reports.update(self._ask(alive, timeout))
        causes = self.death_causes(dead, words=False) if dead else {}  # (the error says them)
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

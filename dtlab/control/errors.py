"""Errors dtlab raises in the notebook. Each message says what happened, on which ranks,
and what to do next; ``_render_traceback_`` makes IPython show that message instead of a
traceback through dtlab's own frames."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.records import RemoteFailure


class DtlabError(Exception):
    """Base of dtlab's errors."""

    def _render_traceback_(self) -> list[str]:
        return [
            f"{type(self).__name__}: {line}" if i == 0 else line
            for i, line in enumerate(str(self).splitlines())
        ]


class LaunchError(DtlabError):
    """The cluster or the process group could not be brought up; nothing was left running."""


class NoSessionError(DtlabError):
    """No live ranks to talk to."""


def _died(failure: RemoteFailure) -> bool:
    return failure.ename == "EngineError"


def describe_failures(failures: Mapping[int, RemoteFailure]) -> list[str]:
    """One block per distinct error, naming the ranks that raised it."""
    lines = []
    by_error = group_by_value({r: (f.ename, f.evalue) for r, f in failures.items()})
    for ranks, (ename, evalue) in by_error:
        if ename == "EngineError":
            lines.append(f"{label_ranks(ranks)} died: the engine process exited ({evalue})")
        else:
            lines.append(f"{label_ranks(ranks)} raised {ename}: {evalue}")
    tracebacks = group_by_value({r: f.traceback for r, f in failures.items() if f.traceback})
    for ranks, tb in tracebacks:
        lines.append(f"--- traceback on {label_ranks(ranks)} ---")
        lines.extend(tb.rstrip().splitlines())
    return lines


class RankError(DtlabError):
    """Code raised on some ranks (or their engines died); one error for all of them."""

    def __init__(
        self,
        what: str,
        failures: Mapping[int, RemoteFailure],
        finished: Iterable[int] = (),
        running: Iterable[int] = (),
    ):
        self.what = what
        self.failures = dict(failures)
        self.finished = tuple(sorted(finished))
        self.running = tuple(sorted(running))
        super().__init__(self._message())

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, f in self.failures.items() if _died(f)))

    def _message(self) -> str:
        lines = [f"{self.what} failed on {label_ranks(self.failures)}"]
        lines += describe_failures(self.failures)
        if self.finished:
            lines.append(f"{label_ranks(self.finished)} finished without error")
        if self.running:
            lines.append(
                f"{label_ranks(self.running)} still running (maybe waiting in a collective "
                "for the failed ranks); %dt_status shows them, %dt_launch N --restart "
                "replaces all engines"
            )
        if self.dead_ranks:
            lines.append("dead ranks cannot be reused: run %dt_launch again to restart the cluster")
        return "\n".join(lines)


class RankTimeoutError(RankError):
    """Some ranks did not finish in time (or the user interrupted); they were sent SIGINT."""

    def __init__(
        self,
        what: str,
        reason: str,
        stopped: Iterable[int],
        stuck: Iterable[int],
        failures: Mapping[int, RemoteFailure] | None = None,
        finished: Iterable[int] = (),
    ):
        self.reason = reason
        self.stopped = tuple(sorted(stopped))
        self.stuck = tuple(sorted(stuck))
        super().__init__(what, failures or {}, finished=finished, running=self.stuck)

    def _message(self) -> str:
        unfinished = sorted(set(self.stopped) | set(self.stuck))
        lines = [f"{self.what}: {label_ranks(unfinished)} did not finish ({self.reason})"]
        if self.stopped:
            lines.append(f"{label_ranks(self.stopped)} stopped on SIGINT")
        if self.stuck:
            lines.append(
                f"{label_ranks(self.stuck)} still busy after SIGINT: probably blocked in a "
                "collective, which SIGINT cannot break; it returns when the process-group "
                "timeout expires, or run %dt_launch N --restart to replace the engines"
            )
        if self.finished:
            lines.append(f"{label_ranks(self.finished)} finished")
        others = {r: f for r, f in self.failures.items() if f.ename != "KeyboardInterrupt"}
        lines += describe_failures(others)
        return "\n".join(lines)

"""Errors dtlab raises in the notebook. Each message says what happened, on which ranks,
and what to do next; ``_render_traceback_`` makes IPython show that message instead of a
traceback through dtlab's own frames."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.records import CellOutput, RemoteFailure, RunResult
from dtlab.records.errors import InputError

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # IPython's colours in engine tracebacks

# what to do about dead ranks where nobody said better (Hangs.advise does, from what the
# session can restore: dt.restart() in most states)
DEAD_HINT = "dead ranks cannot be reused: run %dt_launch again to restart the cluster"
STUCK_HINT = (
    "still busy after SIGINT: probably blocked in a collective, which SIGINT cannot break; "
    "it is freed when the process-group timeout expires, or run %dt_launch N --restart"
)


class DtlabError(Exception):
    """Base of dtlab's errors."""

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines()
        return [f"{type(self).__name__}: {lines[0]}", *lines[1:]]


class StepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run (``dt.step``, ``dt.run_until``, ``%dt_continue``, the runs of
    a replay or a resume check): every rank was first paused after the same step, then
    this is raised in the notebook, so that ``for _ in range(100): dt.step(10)`` stops as
    any Python loop does on Ctrl-C. The job is intact: the next ``dt.step`` goes on from
    there. ``result`` is the interrupted run's RunResult (``%dt_step`` prints it)."""

    def __init__(self, result: RunResult):
        self.result = result
        how = "paused" if result.stopped == "pause" else "stopped"  # ended meanwhile
        super().__init__(
            f"Ctrl-C: every rank {how} after step {result.last_step}; the job is intact "
            "and the next step goes on from there"
        )

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class OptionError(DtlabError, InputError):
    """An argument or option the user gave is refused: its message names it and says what
    would do. A ValueError (code catching ValueError still works); every magic shows it as
    IPython's UsageError, in one place (``views/magic_support.py: dtlab_magics``)."""


class LaunchError(DtlabError):
    """The cluster or the process group could not be brought up."""


class NoSessionError(DtlabError):
    """No live ranks to talk to."""


def describe_failures(failures: Mapping[int, RemoteFailure]) -> list[str]:
    """One line per distinct error naming the ranks that raised it, then the tracebacks."""
    lines = []
    by_error = group_by_value({r: (f.ename, f.evalue) for r, f in failures.items()})
    by_error.sort(key=lambda item: item[1][0] != "EngineError")  # the dead first: the cause
    for ranks, (ename, evalue) in by_error:
        if ename == "EngineError" and evalue.startswith(("killed by", "exited with", "the engine")):
            lines.append(f"{label_ranks(ranks)} died: {evalue}")
        elif ename == "EngineError":
            lines.append(f"{label_ranks(ranks)} died: the engine process exited ({evalue})")
        else:
            lines.append(f"{label_ranks(ranks)} raised {ename}: {ANSI.sub('', evalue)}")
    # plain text: the colour codes of the engines' IPython show as "[0;31m" in a terminal,
    # a log or a test report, and split one traceback into many when colours differ
    tracebacks = group_by_value(
        {r: ANSI.sub("", f.traceback) for r, f in failures.items() if f.traceback}
    )
    for ranks, tb in tracebacks:
        lines.append(f"--- traceback on {label_ranks(ranks)} ---")
        lines.extend(tb.rstrip().splitlines())
    return lines


class RankError(DtlabError):
    """Code raised on some ranks, or their engines died: one error for all of them.

    Ranks still running a second after the first failure were sent SIGINT: ``stopped``
    obeyed, ``stuck`` did not (and will not take new work until they are free).
    """

    outputs: dict[int, CellOutput]  # a failed %%dt cell: what the ranks printed (only then)

    def __init__(
        self,
        what: str,
        failures: Mapping[int, RemoteFailure],
        *,
        finished: Iterable[int] = (),
        stopped: Iterable[int] = (),
        stuck: Iterable[int] = (),
    ):
        self.what = what
        self.launching = False  # inside a launch, which stops every engine when it fails
        self.report: str | None = None  # why, from the ranks' sidecars (a hang report)
        self.hang = None  # the HangReport itself, when one was taken
        self.advice: str | None = None  # what brings dead ranks back now (else DEAD_HINT)
        self.finished = tuple(sorted(finished))
        self.stopped = tuple(sorted(stopped))
        self.stuck = tuple(sorted(stuck))
        # a KeyboardInterrupt on a rank we interrupted is our doing, not the rank's failure
        self.failures = {
            r: f
            for r, f in failures.items()
            if not (r in self.stopped and f.ename == "KeyboardInterrupt")
        }
        super().__init__(self._message())

    @property
    def dead_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, f in self.failures.items() if f.ename == "EngineError"))

    def explain(self, hang) -> RankError:
        """Add a hang report (what every rank was doing) to this error's message."""
        self.hang, self.report = hang, hang.summary()
        self.args = (self._message(),)
        return self

    def _aftermath(self) -> list[str]:
        lines = [f"why: {self.report}"] if self.report else []
        if self.finished:
            lines.append(f"{label_ranks(self.finished)} finished without error")
        stopped = [r for r in self.stopped if r not in self.failures]  # named once: raised
        if stopped:
            lines.append(f"{label_ranks(stopped)} stopped on SIGINT")
        if self.stuck and self.launching:
            lines.append(
                f"{label_ranks(self.stuck)} still busy after SIGINT; the failed "
                "launch stops them with every process it started: run %dt_launch "
                "again (a larger --timeout gives slow ranks longer)"
            )
        elif self.stuck:
            lines.append(f"{label_ranks(self.stuck)} {STUCK_HINT}")
        if self.dead_ranks:  # (a failed launch stops everything: launching again is it)
            lines.append(DEAD_HINT if self.launching else self.advice or DEAD_HINT)
        return lines

    def _message(self) -> str:
        head = f"{self.what} failed on {label_ranks(self.failures)}"
        return "\n".join([head, *describe_failures(self.failures), *self._aftermath()])


class RankTimeoutError(RankError):
    """Some ranks did not finish in time, or the user interrupted; they were sent SIGINT."""

    def __init__(
        self,
        what: str,
        reason: str,
        failures: Mapping[int, RemoteFailure] | None = None,
        **ranks: Iterable[int],
    ):
        self.reason = reason
        super().__init__(what, failures or {}, **ranks)

    def _message(self) -> str:
        unfinished = sorted(set(self.stopped) | set(self.stuck))
        head = f"{self.what}: {label_ranks(unfinished)} did not finish ({self.reason})"
        return "\n".join([head, *self._aftermath(), *describe_failures(self.failures)])

"""What each rank is doing, as the notebook knows it: one state per rank.

A rank is ``idle``, ``stepping`` (in a run of the stepping channel, by run id, until its
``done`` or ``error`` reply arrives, late replies included), ``stuck`` (an ipyparallel
request it did not finish even after SIGINT: blocked in a collective) or ``dead`` (its
engine unregistered; the controller says so, so it is looked up when asked). Whether a
request may be sent to some ranks now is decided here, in :meth:`RankActivity.refusal`,
and nowhere else: a request sent to a busy rank would queue behind the old one, and its
collectives could pair with the stale ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dtlab.analysis.ranks import label_ranks
from dtlab.records.words import Word


class Activity(Word):
    """What a rank is doing, as the notebook knows it."""

    IDLE = "idle"
    STEPPING = "stepping"
    STUCK = "stuck"
    DEAD = "dead"


class RankActivity:
    """Per rank: the run it is in, or the request it is stuck in (``dt.world.activity``)."""

    def __init__(self) -> None:
        self._runs: dict[int, int] = {}  # rank -> id of a run it has not finished
        self._stuck: dict[int, Any] = {}  # rank -> ipyparallel AsyncResult not finished

    # --- the stepping channel ------------------------------------------------------------
    def start_run(self, ranks: Iterable[int], run_id: int) -> None:
        self._runs.update({rank: run_id for rank in ranks})

    def end_run(self, rank: int, run_id: int | None = None) -> None:
        """``rank`` finished ``run_id`` (any run when None); an older run's late reply
        does not free a rank that is in a newer one."""
        if run_id is None or self._runs.get(rank) == run_id:
            self._runs.pop(rank, None)

    def end_runs(self, ranks: Iterable[int]) -> None:
        """``ranks`` finished whatever run they were in."""
        runs = self._runs
        for rank in ranks:
            runs.pop(rank, None)

    def stepping(self) -> list[int]:
        return sorted(self._runs)

    # --- ipyparallel requests --------------------------------------------------------------
    def mark_stuck(self, requests: Mapping[int, Any]) -> None:
        self._stuck.update(requests)

    def stuck(self) -> list[int]:
        """Ranks still inside a request that did not finish (finished ones are forgotten)."""
        self._stuck = {r: ar for r, ar in self._stuck.items() if not ar.done()}
        return sorted(self._stuck)

    # --- asking ------------------------------------------------------------------------
    def state(self, rank: int, dead: Iterable[int] = ()) -> Activity:
        if rank in set(dead):
            return Activity.DEAD
        if rank in self.stuck():
            return Activity.STUCK
        return Activity.STEPPING if rank in self._runs else Activity.IDLE

    def refusal(
        self, ranks: Iterable[int], what: str, *, run_in_flight: bool, world_size: int
    ) -> str | None:
        """Why ``what`` may not be sent to ``ranks`` now (None: it may). Dead ranks are
        refused before this, with the engine's cause (World.check_ready)."""
        ranks = set(ranks)
        stepping = ranks & set(self._runs)
        if stepping and run_in_flight:
            return (
                f"{what}: {label_ranks(stepping)} are stepping (a run from the dashboard?); "
                "pause it (the Pause button or dt.pause()) and try again when it has stopped"
            )
        busy = sorted(ranks & (set(self.stuck()) | stepping))
        if busy:
            return (
                f"{what}: {label_ranks(busy)} still busy with an earlier call that did not "
                "finish (blocked in a collective?); wait for the process-group timeout, "
                f"or run %dt_launch {world_size} --restart"
            )
        return None

    def reset(self) -> None:
        """New engines: nothing they do is known yet."""
        self._runs.clear()
        self._stuck.clear()

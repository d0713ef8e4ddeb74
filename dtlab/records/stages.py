"""Frozen records of a pipeline-parallel job that travel between the ranks and the notebook.

Plain data only (like :mod:`dtlab.records`): they pickle cheaply and tests build them by
hand. A *block* is one entry of the model's ordered sequence of blocks (``embed``,
``blocks.0``, ..., ``head``); a *stage* is the contiguous run of blocks one rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """One block: its size, and (once profiled) what one micro-batch through it costs.

    Times are for one micro-batch on the rank that holds the block; ``activation_bytes``
    is what autograd keeps from its forward for the backward.
    """

    name: str
    num_params: int
    param_bytes: int
    forward_s: float | None = None
    backward_s: float | None = None
    activation_bytes: int | None = None

    @property
    def measured(self) -> bool:
        return self.forward_s is not None and self.backward_s is not None


@dataclass(frozen=True)
class ScheduleEvent:
    """One micro-batch's forward (``"F"``) or backward (``"B"``) on one stage.

    ``start``/``end`` in seconds from the start of the step: as a rank reports them, on its
    own clock from its own step start; in a measured ``Balance``, on stage 0's clock from
    its step start (:mod:`dtlab.analysis.clock_align`); or predicted by a simulation.
    """

    stage: int
    microbatch: int
    phase: str
    start: float
    end: float


@dataclass(frozen=True)
class StageReport:
    """What one rank says about its stage after a step (collected on each rank)."""

    rank: int
    stage: int
    blocks: tuple[str, ...]
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None  # sum over its blocks of one micro-batch's, once profiled
    microbatches: int
    schedule: str  # "gpipe" | "1f1b"
    step: int  # the step the events are from (0: none yet)
    step_s: float | None  # the schedule's wall time in that step
    events: tuple[ScheduleEvent, ...] = ()
    costs: tuple[BlockCost, ...] = ()
    # the rank's clock (time.perf_counter) at the step start its events count from
    clock_start: float | None = None

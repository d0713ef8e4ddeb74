"""What one step observed, as its :class:`~dtlab.records.StepRecord`: the one place a rank
makes a step record.

Each kind of job measures a step its own way (:mod:`dtlab.agent.job`'s loop, a step
function, a DeepSpeed engine, a script) and hands what it measured to
``JobCore._keep`` (:mod:`dtlab.agent.jobs_base`), which adds what every kind records
alike (the step's number, the RNGs as it began, module outputs, memory) and calls
:func:`make_record`. A new field of the record (a collector) is measured in the job
kinds that can, and passed by name; a kind that cannot leaves the field's default.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from dtlab.records import StepMemory, StepRecord, StepTimes


def make_record(
    step: int,
    times: Sequence[float],
    memory: StepMemory,
    *,
    nonfinite: tuple[str | None, str] = (None, ""),
    grads: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
    **measured: Any,
) -> StepRecord:
    """The record of ``step``, stamped now.

    ``times``: seconds of the step's phases, in ``StepTimes``' order (data, forward,
    backward, optimizer, dtlab's own record); ``nonfinite``: (the first module whose output
    was not finite, how it was found); ``grads``: the gradient fields
    (``recorder.grad_fields``), ``params``: the parameter and buffer fingerprints
    (``JobCore._param_fields``), each empty when not recorded; ``measured``: the other
    fields of :class:`StepRecord` this job kind measured (loss, lr, scale, skipped,
    indices, epoch, micro_batches, update_rms, ...), by name.
    """
    return StepRecord(
        step=step,
        time=time.time(),
        times=StepTimes(*times),
        memory=memory,
        nonfinite_module=nonfinite[0],
        nonfinite_found=nonfinite[1],
        **(grads or {}),
        **(params or {}),
        **measured,
    )

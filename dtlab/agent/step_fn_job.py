"""``dtlab.attach(model, optimizer, data, step=fn)``: the user's whole step, watched.

``fn(batch)`` does everything a real loop does between two batches (zero_grad, forward,
backward, clipping, a manual all-reduce, ``optimizer.step()``, a scheduler or scaler
step) and returns the loss, or None. dtlab draws the batch (so it knows the data and its
time), calls ``fn`` and sees the rest through the hooks a script run uses
(:mod:`dtlab.agent.script_observe`): gradients in the optimizer's post-hook, after every
hook of the user's, the loss of each ``backward()``, micro-batches and DDP syncs, forward
and backward time. A step whose ``optimizer.step()`` never ran (a GradScaler skipped it)
is recorded as skipped.
"""

from __future__ import annotations

import math
import time

import torch

from dtlab.agent import script_observe, step_observer
from dtlab.agent.data_stream import DataStream, describe_data
from dtlab.agent.job import _default_indices
from dtlab.agent.jobs_base import DEFAULT_CAPACITY, JobCore
from dtlab.records import StepRecord


class StepFnJob(JobCore):
    """A job whose step is the user's ``step_fn(batch)``; dtlab draws the batches."""

    def __init__(
        self,
        model,
        optimizer,
        data,
        step_fn,
        *,
        record=True,
        capacity=DEFAULT_CAPACITY,
        indices=None,
        on_epoch=None,
    ):
        self.data = data
        self.stream = DataStream(data, on_epoch)
        self.indices = indices or _default_indices
        self.step_fn = step_fn
        super().__init__(model, optimizer, record=record, capacity=capacity)

    def _data_kind(self) -> str:
        return describe_data(self.stream.data)

    def _next_batch(self):
        return self.stream.next_batch()

    def step(self, record: bool | None = None) -> StepRecord:
        record = self._begin_step(record)
        t0 = self._now()
        epoch_before = self.stream.epoch
        batch = self._next_batch()
        data_s = self._now() - t0
        grads: dict = {}
        observer = step_observer.Observer(lambda kind, opt: self._boundary(kind, opt, grads))
        observer.started, observer.marker, observer.recording = True, self.optimizer, record
        script_observe.install(observer)
        try:
            returned = self.step_fn(batch)
        finally:
            script_observe.uninstall()
        draft = observer.take_draft()
        skipped = "_seen" not in grads
        if skipped and record:  # no optimizer step ran: the gradients as they are
            grads.update(self._grad_fields())
        grads.pop("_seen", None)
        grads_s = grads.pop("_s", 0.0)
        self.step_count += 1
        t1 = time.perf_counter()
        params = self._param_fields() if record else {}
        lr = grads.pop("_lr", self.optimizer.param_groups[0].get("lr"))
        return self._keep(
            loss=_loss(returned, observer, draft),
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            scale=observer.last_scale,
            skipped=skipped,
            times=(
                data_s,
                draft.forward_s,
                draft.backward_s,
                max(0.0, observer.optimizer_s - grads_s),
                grads_s + time.perf_counter() - t1,
            ),
            indices=tuple(int(i) for i in self.indices(batch)),
            epoch=epoch_before,
            nonfinite=(self.watcher.first_bad, ""),
            micro_batches=draft.backward_calls,
            synced_micro_batches=draft.synced_calls if draft.ddp_seen else None,
            input_fingerprints=tuple(draft.input_prints),
            grads=grads,
            params=params,
        )

    def _boundary(self, kind: str, optimizer, grads: dict) -> None:
        """The optimizer's post-hook: the gradients as the step used them."""
        if kind in ("step", "skipped") and "_lr" not in grads:  # before its scheduler steps
            grads["_lr"] = optimizer.param_groups[0].get("lr") if optimizer else None
        if kind == "step" and "_seen" not in grads:
            t0 = time.perf_counter()
            if self._recording:
                grads.update(self._grad_fields())
            grads.update(_seen=True, _s=time.perf_counter() - t0)


def _loss(returned, observer, draft) -> float:
    """What ``fn`` returned, else the sum of what it called backward() on."""
    if isinstance(returned, torch.Tensor) and returned.numel() == 1:
        return float(returned.detach())
    if isinstance(returned, (int, float)):
        return float(returned)
    value = observer.loss(draft)
    return value if draft.losses else math.nan

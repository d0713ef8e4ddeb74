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

from dtlab.agent import recorder, rng, script_observe, step_observer
from dtlab.agent.job import Job
from dtlab.records import StepRecord, StepTimes


class StepFnJob(Job):
    def __init__(self, model, optimizer, data, step_fn, **options):
        super().__init__(model, optimizer, data, _unused, **options)
        self.step_fn = step_fn

    def step(self, record: bool | None = None) -> StepRecord:
        record = self.record if record is None else record
        if self.step_count == 0 and self.initial is None:
            self.initial = self._initial_state()
        self.watcher.reset()
        self.outputs.reset()
        self._recording, self._buffer_prints = record, ()
        rngs = rng.fingerprints() if record else ()
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
        rec = StepRecord(
            step=self.step_count,
            time=time.time(),
            loss=_loss(returned, observer, draft),
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            scale=observer.last_scale,
            skipped=skipped,
            times=StepTimes(
                data_s,
                draft.forward_s,
                draft.backward_s,
                max(0.0, observer.optimizer_s - grads_s),
                grads_s + time.perf_counter() - t1,
            ),
            memory=recorder.memory(self.params, self.optimizer, self.device, self._buffer_bytes()),
            indices=tuple(int(i) for i in self.indices(batch)),
            epoch=epoch_before,
            nonfinite_module=self.watcher.first_bad,
            micro_batches=draft.backward_calls,
            synced_micro_batches=draft.synced_calls if draft.ddp_seen else None,
            input_fingerprints=tuple(draft.input_prints),
            rng=rngs,
            module_outputs=tuple(self.outputs.prints) if self.recording_outputs else (),
            **grads,
            **params,
        )
        self.records.append(rec)
        return rec

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


def _unused(model, batch):
    raise AssertionError("a step= job runs its step function, never a loss_fn")

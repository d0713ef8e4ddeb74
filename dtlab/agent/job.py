"""The training job attached on this rank, and one optimizer step of it, measured.

The user's code hands it over with ``dtlab.attach(...)`` (:mod:`dtlab.agent.attach`);
dtlab then owns the loop (so it can time each phase) and changes nothing in the model.
One step, in order: next batch -> ``loss_fn(model, batch)`` (forward) -> backward (with
DDP this includes the gradient all-reduce) -> [unscale] -> record gradients ->
optimizer / scaler / scheduler step -> record parameters and memory.

What every kind of job shares, and the interface stepping asks of one, are in
:mod:`dtlab.agent.jobs_base`; the other kinds (a step function, a DeepSpeed engine, a
script) are in their own modules.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping

import torch

from dtlab.agent import nonfinite, recorder
from dtlab.agent.data_stream import DataStream, describe_data
from dtlab.agent.hooks import CommCounter
from dtlab.agent.jobs_base import DEFAULT_CAPACITY, JobCore
from dtlab.agent.state import RANK
from dtlab.records import StepRecord


def install(job: JobCore) -> None:
    """Make ``job`` (built by another attach, e.g. a pipeline's) the attached job."""
    RANK.attach_count += 1
    if RANK.job is not None and RANK.job is not job:
        RANK.job.release()  # the job it replaces leaves no hook on its parameters
    RANK.job = job


def current() -> JobCore:
    """The attached job (any kind: every one is a ``JobCore``, a ``RankJob``)."""
    if RANK.job is None:
        raise RuntimeError(
            "no job attached on this rank: call dtlab.attach(model, optimizer, data, loss_fn) "
            "on every rank first (or %dt_demo for the built-in demo job)"
        )
    return RANK.job


def attach_count() -> int:
    return RANK.attach_count


def checkpoint_problem() -> str | None:
    """Why the attached job (if any) cannot be checkpointed or rebuilt, else None."""
    return None if RANK.job is None else RANK.job.checkpoint_problem


class JobEnded(Exception):
    """The job has nothing more to step (a script job whose script is over)."""


class Job(JobCore):
    """One rank's attached training job (model, optimizer, data, ``loss_fn``): ``step()``
    runs dtlab's own loop for one optimizer step and records it."""

    def __init__(
        self,
        model,
        optimizer,
        data,
        loss_fn,
        *,
        scheduler=None,
        scaler=None,
        record=True,
        capacity=DEFAULT_CAPACITY,
        indices=None,
        on_epoch=None,
        accumulate=1,
        no_sync=True,
        before_step=None,
        lr=None,
    ):
        self.before_step = before_step
        self.lr_at = lr
        self.data = data
        self.loss_fn = loss_fn
        self.indices = indices or _default_indices
        self.stream = DataStream(data, on_epoch)
        self.accumulate = accumulate
        self.no_sync = no_sync
        # only where it is asked about: a comm hook is a change to the user's DDP object
        self.comm = CommCounter(model) if accumulate > 1 else None
        self._input_prints: tuple[int, ...] = ()  # this step's batches' tensors
        self._epoch_starts: tuple[int, ...] = ()
        self._bad_micro: nonfinite.BadMicroBatch | None = None  # this step's, if any
        super().__init__(
            model, optimizer, scheduler=scheduler, scaler=scaler, record=record, capacity=capacity
        )

    def _data_kind(self) -> str:
        return describe_data(self.stream.data)

    def _next_batch(self):
        return self.stream.next_batch()

    def step(self, record: bool | None = None) -> StepRecord:
        """Run one optimizer step and return (and keep) what it measured."""
        record = self._begin_step(record)
        self.optimizer.zero_grad(set_to_none=True)
        if self.comm is not None:
            self.comm.reset()
        if self.lr_at is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(self.lr_at(self.step_count))
        if record:
            self.reached.start()
        try:
            loss, indices, epoch, (data_s, forward_s, backward_s) = self._accumulate()
        finally:
            unreached = self.reached.stop()
        source, how = self._nonfinite_source()  # before the optimizer moves anything
        t3 = self._now()
        lr = self.optimizer.param_groups[0].get("lr")
        scale = float(self.scaler.get_scale()) if self.scaler is not None else None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # record true gradients, not scaled ones
        if self.before_step is not None:
            self.before_step(self.model, self.optimizer)
        t4 = self._now()
        if record:
            self.update_sample.before()
        skipped, grads, grads_s = self._step_recording_grads(record)
        update_rms = self.update_sample.after() if record else math.nan
        self.step_count += 1  # at once: the parameters have moved, whatever comes next
        t5 = self._now()
        params = self._param_fields() if record else {}
        t6 = self._now()
        counted = self.comm is not None and self.comm.installed
        return self._keep(
            times=(
                data_s,
                forward_s,
                backward_s,
                t5 - t4 - grads_s,
                (t4 - t3) + grads_s + (t6 - t5),
            ),
            loss=loss,
            lr=float(lr) if lr is not None else None,
            scale=scale,
            skipped=skipped,
            indices=indices,
            epoch=epoch,
            epoch_starts=self._epoch_starts,
            nonfinite=(source, how),
            micro_batches=self.accumulate,
            input_fingerprints=self._input_prints,
            unreached=unreached,
            update_rms=update_rms,
            comm_calls=self.comm.calls if counted else None,
            comm_bytes=self.comm.bytes if counted else None,
            grads=grads,
            params=params,
        )

    def _accumulate(self):
        """Forward and backward of ``accumulate`` micro-batches; only the last one syncs
        gradients when ``no_sync`` (DDP's ``no_sync()`` skips the all-reduce)."""
        losses, indices, epoch, times = [], [], None, [0.0, 0.0, 0.0]
        inputs: list[int] = []  # fingerprints of the batches' tensors, when recording
        starts = []  # where in ``indices`` a new epoch began (accumulation across the end)
        self._bad_micro = None
        for micro in range(self.accumulate):
            t0 = self._now()
            start_rng = nonfinite.rng_state(self.device)  # to re-run it, should it blow up
            before = self.stream.epoch
            batch = self._next_batch()
            if epoch is None:
                epoch = self.stream.epoch  # the pass the step began in
            elif self.stream.epoch != before:
                starts.append(len(indices))
            t1 = self._now()
            last = micro == self.accumulate - 1
            with _without_sync(self.model, not last and self.no_sync):
                loss = self.loss_fn(self.model, batch)
                t2 = self._now()
                share = loss / self.accumulate if self.accumulate > 1 else loss
                (self.scaler.scale(share) if self.scaler is not None else share).backward()
            t3 = self._now()
            for i, spent in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                times[i] += spent
            losses.append(float(loss.detach()))
            if self._bad_micro is None and not math.isfinite(losses[-1]):
                self._bad_micro = nonfinite.BadMicroBatch(micro, batch, start_rng)
            indices.extend(int(i) for i in self.indices(batch))
            if self._recording:
                inputs.extend(recorder.input_fingerprints(batch))
        self._epoch_starts, self._input_prints = tuple(starts), tuple(inputs)
        return math.fsum(losses) / len(losses), tuple(indices), epoch, times

    def _nonfinite_source(self) -> tuple[str | None, str]:
        """The first module with a non-finite output: seen while watching, or else found
        by re-running the first micro-batch whose loss was not finite (agent/nonfinite.py)."""
        if self.watcher.first_bad is not None:
            return self.watcher.first_bad, "watched during the step"
        if self._bad_micro is None:
            return None, ""
        bad, self._bad_micro = self._bad_micro, None
        module = self.model if self.flat is not None else self.module  # (FSDP1: refused)
        return nonfinite.locate(module, self.loss_fn, bad, self.device)

    def _step_recording_grads(self, record: bool) -> tuple[bool, dict, float]:
        """The optimizer step, with the gradients recorded as it used them: in a post-hook,
        which runs after every hook on the optimizer (a manual all-reduce in a pre-hook
        included). A step the GradScaler skipped fires no hook: then as they are after it.
        -> (skipped, gradient fields, seconds spent recording them)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        seen: dict = {}

        def capture(optimizer, args, kwargs) -> None:
            if optimizer is self.optimizer and not seen:
                t0 = time.perf_counter()
                seen.update(self._grad_fields(), _s=time.perf_counter() - t0)

        handle = register_optimizer_step_post_hook(capture) if record else None
        try:
            skipped = self._optimizer_step()
        finally:
            if handle is not None:
                handle.remove()
        spent = seen.pop("_s", 0.0)
        if record and not seen:
            t0 = time.perf_counter()
            seen = self._grad_fields()
            spent += time.perf_counter() - t0
        return skipped, seen, spent

    def _optimizer_step(self) -> bool:
        if self.scaler is None:
            self.optimizer.step()
            skipped = False
        else:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before  # the scaler backs off when it skips
        if self.scheduler is not None:
            self.scheduler.step()
        return skipped


@contextlib.contextmanager
def _without_sync(model, quiet: bool):
    """No gradient sync inside, when ``quiet``: DDP's and FSDP1's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync(False)`` (its reduce-scatter waits for the last one)."""
    if quiet and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif quiet and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _default_indices(batch) -> Iterable[int]:
    if isinstance(batch, Mapping) and "index" in batch:
        index = batch["index"]
        return index.tolist() if isinstance(index, torch.Tensor) else index
    return ()

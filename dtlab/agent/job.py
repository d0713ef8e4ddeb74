"""The training job attached on this rank, and one optimizer step of it, measured.

The user's code hands it over with ``dtlab.attach(...)`` (:mod:`dtlab.agent.attach`);
dtlab then owns the loop (so it can time each phase) and changes nothing in the model.
One step, in order: next batch -> ``loss_fn(model, batch)`` (forward) -> backward (with
DDP this includes the gradient all-reduce) -> [unscale] -> record gradients ->
optimizer / scaler / scheduler step -> record parameters and memory.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Iterable, Mapping

import torch

from dtlab.agent import fsdp1, mesh, nonfinite, recorder, rng
from dtlab.agent.data_stream import DataStream, describe_data
from dtlab.agent.hooks import CommCounter, ModuleWatcher, OutputRecorder, ReachedParams, hidden
from dtlab.agent.state import RANK
from dtlab.agent.update_size import UpdateSample
from dtlab.records import (
    InitialState,
    JobInfo,
    ParamInfo,
    StepRecord,
    StepTimes,
    combine_fingerprints,
)

DEFAULT_CAPACITY = 1_000  # full step records kept on the rank: ~6 KB each for the demo,
# ~150 KB for a model of 1,000 parameter tensors, so the default stays well under 200 MB


def install(job: Job) -> None:
    """Make ``job`` (built by another attach, e.g. a pipeline's) the attached job."""
    RANK.attach_count += 1
    if RANK.job is not None and RANK.job is not job:
        RANK.job.reached.close()  # the job it replaces leaves no hook on its parameters
    RANK.job = job


def current() -> Job:
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


class Job:
    """One rank's attached training job; ``step()`` runs and records one optimizer step."""

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
        self.model = model
        self.before_step = before_step
        self.lr_at = lr
        self.module = getattr(model, "module", model)  # the user's model inside DDP
        self.optimizer = optimizer
        self.data = data
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.scaler = scaler
        self.record = record
        self.indices = indices or _default_indices
        named = list(self.module.named_parameters())
        if not named:
            raise ValueError(f"{type(self.module).__name__} has no parameters: nothing to train")
        self.names, self.params = zip(*named, strict=True)
        self.device = self.params[0].device
        # FSDP1: ``params`` are what the rank holds (flat shards, or views of them), for
        # memory; ``names`` and every record's entries are the model's own parameters,
        # gathered whole through ``flat`` (agent/fsdp1.py)
        self.flat = fsdp1.view_of(model)
        if self.flat is not None:
            self.names = self.flat.names
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self._stashed: collections.deque[StepRecord] | None = None
        # why this job cannot be checkpointed or rebuilt (a script job says), else None
        self.checkpoint_problem: str | None = None
        self.step_count = 0
        self.stream = DataStream(data, on_epoch)
        self.accumulate = accumulate
        self.no_sync = no_sync
        # only where it is asked about: a comm hook is a change to the user's DDP object
        self.comm = CommCounter(model) if accumulate > 1 else None
        self.watcher = ModuleWatcher(self.module)
        # what this rank's own backward reached (not under FSDP1: flat gradients)
        self.reached = ReachedParams(self.params, sharded=self.flat is not None)
        self.outputs = OutputRecorder(self.module)
        self.recording_outputs = False
        self.autosave: tuple[str, int] | None = None  # (checkpoint root, every k steps)
        self._recording = False
        self._record_size: dict[bool, int] = {}
        self._buffer_prints: tuple[int, ...] = ()
        self._input_prints: tuple[int, ...] = ()  # this step's batches' tensors
        self._epoch_starts: tuple[int, ...] = ()
        self._bad_micro: nonfinite.BadMicroBatch | None = None  # this step's, if any
        if any(True for _ in self.module.buffers()):
            self.module.register_forward_pre_hook(self._snapshot_buffers)
        self.initial: InitialState | None = None
        # how far each step moves this rank's own elements (its shard, when sharded)
        self.update_sample = UpdateSample.of_optimizers([optimizer])
        self.info = self._describe(capacity)

    def _describe(self, capacity: int) -> JobInfo:
        wrapper = type(self.model).__name__ if self.module is not self.model else None
        return JobInfo(
            rank=_rank(),
            model=type(self.module).__name__,
            wrapper=wrapper,
            optimizer=type(self.optimizer).__name__,
            scheduler=type(self.scheduler).__name__ if self.scheduler is not None else None,
            scaler=self.scaler is not None,
            params=self._param_infos(),
            record=self.record,
            capacity=capacity,
            buffers=tuple(name for name, _ in self.module.named_buffers()),
            data=self._data_kind(),
            find_unused_parameters=getattr(self.model, "find_unused_parameters", None),
            mesh=mesh.describe(self.model),
        )

    def info_now(self) -> JobInfo:
        """``info``, with what changed since the job was attached (a script job's)."""
        return self.info

    def _param_infos(self) -> tuple[ParamInfo, ...]:
        if self.flat is not None:  # the original parameters, whole
            return tuple(
                ParamInfo(e.name, e.shape, str(e.dtype), e.numel) for e in self.flat.entries
            )
        return tuple(
            ParamInfo(n, tuple(p.shape), str(p.dtype), p.numel())
            for n, p in zip(self.names, self.params, strict=True)
        )

    def _data_kind(self) -> str:
        return describe_data(self.stream.data)

    def _next_batch(self):
        return self.stream.next_batch()

    def _now(self) -> float:
        if self.device.type == "cuda":  # kernels run asynchronously; time them, not launches
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, record: bool | None = None) -> StepRecord:
        """Run one optimizer step and return (and keep) what it measured."""
        record = self.record if record is None else record
        if self.step_count == 0 and self.initial is None:
            self.initial = self._initial_state()  # what every rank starts from
        self.optimizer.zero_grad(set_to_none=True)
        self.watcher.reset()
        self.outputs.reset()
        self._recording, self._buffer_prints = record, ()
        rngs = rng.fingerprints() if record else ()  # before the step draws from them
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
        rec = StepRecord(
            step=self.step_count,
            time=time.time(),
            loss=loss,
            lr=float(lr) if lr is not None else None,
            scale=scale,
            skipped=skipped,
            times=StepTimes(
                data_s, forward_s, backward_s, t5 - t4 - grads_s, (t4 - t3) + grads_s + (t6 - t5)
            ),
            memory=recorder.memory(self.params, self.optimizer, self.device, self._buffer_bytes()),
            indices=indices,
            epoch=epoch,
            epoch_starts=self._epoch_starts,
            nonfinite_module=source,
            nonfinite_found=how,
            micro_batches=self.accumulate,
            input_fingerprints=self._input_prints,
            unreached=unreached,
            update_rms=update_rms,
            comm_calls=self.comm.calls if counted else None,
            comm_bytes=self.comm.bytes if counted else None,
            rng=rngs,
            module_outputs=tuple(self.outputs.prints) if self.recording_outputs else (),
            **grads,
            **params,
        )
        self.records.append(rec)
        return rec

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

    def _buffer_bytes(self) -> int:
        """About what the record buffer holds: records x the size of the newest one
        (measured once; recording on and off make records of two sizes)."""
        if not self.records:
            return 0
        last = self.records[-1]
        key = last.detailed
        if key not in self._record_size:
            self._record_size[key] = recorder.object_bytes(last)
        return len(self.records) * self._record_size[key]

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

    def stash_records(self, on: bool) -> None:
        """Put the step records aside (on: a replay's own records begin empty) or back."""
        if on:
            self._stashed = self.records
            self.records = collections.deque(maxlen=self.records.maxlen)
        elif self._stashed is not None:
            self.records, self._stashed = self._stashed, None

    def _grad_fields(self) -> dict:
        if self.flat is not None:
            return recorder.grad_fields(*self.flat.grad_summary())
        return recorder.grad_fields(*recorder.grad_summary([p.grad for p in self.params]))

    def _param_prints(self) -> tuple[int, ...]:
        """Fingerprint per parameter, whole (a collective when sharded)."""
        if self.flat is not None:
            return tuple(self.flat.param_prints())
        return tuple(recorder.fingerprints(self.params))

    def _param_fields(self) -> dict:
        fingerprints = self._param_prints()
        buffers = self._buffer_prints
        return {
            "param_fingerprints": fingerprints,
            "param_fingerprint": combine_fingerprints(fingerprints),
            "buffer_fingerprints": buffers,
            "buffer_fingerprint": combine_fingerprints(buffers),
        }

    def _snapshot_buffers(self, module, inputs) -> None:
        """Buffers as this step's forward sees them: after DDP's buffer broadcast (which
        runs before the wrapped module), before the forward updates them on this rank."""
        if self._recording and not self._buffer_prints and not hidden():  # the first only:
            # inside no_sync() DDP does not broadcast buffers before the last one
            buffers = [b for _, b in self.module.named_buffers()]
            self._buffer_prints = tuple(recorder.fingerprints(buffers))

    def _initial_state(self) -> InitialState:
        buffers = list(self.module.named_buffers())
        return InitialState(
            param_fingerprints=self._param_prints(),
            buffer_names=tuple(name for name, _ in buffers),
            buffer_fingerprints=tuple(recorder.fingerprints([b for _, b in buffers])),
        )

    def watch_modules(self, on: bool) -> None:
        """Name the first module with a non-finite output in each step's record (~20% of
        a step, so only while asked)."""
        self.watcher.watch(on)

    def record_outputs(self, on: bool) -> None:
        """Fingerprint every module's forward output in each step's record (for bisection)."""
        self.recording_outputs = on
        self.outputs.record(on)

    # --- looking closer -----------------------------------------------------------------
    def tensor(self, name: str, what: str = "grad") -> torch.Tensor | None:
        """A CPU copy of one parameter's gradient (``what="grad"``) or value (``"param"``).
        Under FSDP1: this rank's part of it, flattened (empty where it holds none)."""
        if what not in ("grad", "param"):
            raise ValueError(f"what must be 'grad' or 'param', got {what!r}")
        try:
            index = self.names.index(name)
        except ValueError:
            close = [n for n in self.names if name in n][:5]
            raise KeyError(
                f"no parameter {name!r} in {type(self.module).__name__}"
                + (f"; did you mean one of {close}?" if close else "")
            ) from None
        if self.flat is not None:
            tensor = self.flat.local_part(name, what)
        else:
            tensor = self.params[index].grad if what == "grad" else self.params[index]
        return None if tensor is None else tensor.detach().to("cpu", copy=True)

    def record_at(self, step: int) -> StepRecord | None:
        """The full record of ``step`` if the buffer still holds it."""
        for rec in reversed(self.records):
            if rec.step == step:
                return rec
            if rec.step < step:
                break
        return None

    def kept_steps(self) -> tuple[int, int]:
        """(first, last) step the buffer holds; (0, 0) when empty."""
        return (self.records[0].step, self.records[-1].step) if self.records else (0, 0)


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


def _rank() -> int:
    from dtlab.agent.rendezvous import identity

    return identity().rank

"""What every attached job is: the interface the rest of dtlab steps and asks (``RankJob``),
and what every kind of job shares (``JobCore``).

Kinds of job, each a ``JobCore`` that says only how a step runs and what it measured:

- :class:`dtlab.agent.job.Job`: ``dtlab.attach(model, optimizer, data, loss_fn)``, dtlab's
  own loop (a ``PipelineJob`` is one, stepped by a pipeline schedule);
- :class:`dtlab.agent.step_fn_job.StepFnJob`: ``dtlab.attach(..., step=fn)``, the user's
  step watched through hooks;
- :class:`dtlab.agent.deepspeed_job.DeepSpeedJob`: an attached DeepSpeedEngine;
- :class:`dtlab.agent.script_job.ScriptJob`: a script run by ``%dt_script``, stepped by
  resuming it to its next optimizer step.

A step's measurements become its :class:`~dtlab.records.StepRecord` in one place:
``JobCore._keep`` (:func:`dtlab.agent.step_record.make_record`).
"""

from __future__ import annotations

import abc
import collections
import time
from typing import Protocol, runtime_checkable

import torch

from dtlab.agent import fsdp1, mesh, recorder, rng
from dtlab.agent.hooks import ModuleWatcher, OutputRecorder, ReachedParams, hidden
from dtlab.agent.step_record import make_record
from dtlab.agent.update_size import UpdateSample
from dtlab.records import (
    InitialState,
    JobInfo,
    ParamInfo,
    StepMemory,
    StepRecord,
    combine_fingerprints,
)

DEFAULT_CAPACITY = 1_000  # full step records kept on the rank: ~6 KB each for the demo,
# ~150 KB for a model of 1,000 parameter tensors, so the default stays well under 200 MB


@runtime_checkable
class RankJob(Protocol):
    """What stepping (:mod:`dtlab.agent.stepping`), the requests of :mod:`dtlab.agent.api`,
    the sidecar and checkpoints ask of the attached job, whatever its kind.

    ``step`` runs one optimizer step, keeps its full record (``records``) and returns it,
    or raises :class:`dtlab.agent.job.JobEnded` when there is nothing more to step.
    Checkpoints and faults (:mod:`dtlab.agent.checkpoint`, :mod:`dtlab.agent.inject`) also
    read the model side every ``JobCore`` has (``model``, ``module``, ``optimizer``,
    ``scheduler``, ``params``...), and a job's data (``stream``) where it draws batches.
    """

    record: bool  # per-parameter statistics by default (a run may say otherwise)
    step_count: int  # optimizer steps made (the last record's step)
    records: collections.deque[StepRecord]  # full records kept, oldest first
    info: JobInfo  # as attached
    initial: InitialState | None  # fingerprints before its first step
    autosave: tuple[str, int] | None  # (checkpoint root, every k steps): api.set_autosave
    checkpoint_problem: str | None  # why it cannot be checkpointed or rebuilt, else None

    def step(self, record: bool | None = None) -> StepRecord: ...

    def info_now(self) -> JobInfo:
        """``info`` with what changed since (a script's observations switched off)."""
        ...

    def watch_modules(self, on: bool) -> None: ...

    def record_outputs(self, on: bool) -> None: ...

    def record_at(self, step: int) -> StepRecord | None: ...

    def kept_steps(self) -> tuple[int, int]: ...

    def stash_records(self, on: bool) -> None: ...

    def tensor(self, name: str, what: str = "grad") -> torch.Tensor | None: ...

    def take_output(self) -> str:
        """What it printed since the last call (a script's output; "" for other kinds)."""
        ...

    def release(self) -> None:
        """Leave no hook of dtlab's on its parameters (it is replaced or over)."""
        ...


class JobCore(abc.ABC):
    """What every kind of job has (a :class:`RankJob`): the model and its optimizer as
    dtlab watches them (hooks, fingerprints, gradient and memory readers), the record
    buffer, and the start and end of a step. A kind adds how a step runs (``step``) and,
    where it reads them otherwise, its parameters (``_param_infos``, ``_param_prints``,
    ``_grad_fields``), memory (``_memory``) and data (``_data_kind``); it sets what those
    read before calling ``JobCore.__init__``, which describes the job (``info``)."""

    def __init__(
        self,
        model,
        optimizer,
        *,
        scheduler=None,
        scaler=None,
        record: bool = True,
        capacity: int = DEFAULT_CAPACITY,
    ):
        self.model = model
        self.module = getattr(model, "module", model)  # the user's model inside DDP
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.record = record
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
        self.watcher = ModuleWatcher(self.module)
        # what this rank's own backward reached (not under FSDP1: flat gradients)
        self.reached = ReachedParams(self.params, sharded=self.flat is not None)
        self.outputs = OutputRecorder(self.module)
        self.recording_outputs = False
        self.autosave: tuple[str, int] | None = None  # (checkpoint root, every k steps)
        self._recording = False
        self._record_size: dict[bool, int] = {}
        self._buffer_prints: tuple[int, ...] = ()
        self._rngs: tuple[tuple[str, int], ...] = ()  # every RNG as this step began
        if any(True for _ in self.module.buffers()):
            self.module.register_forward_pre_hook(self._snapshot_buffers)
        self.initial: InitialState | None = None
        # how far each step moves this rank's own elements (its shard, when sharded)
        self.update_sample = UpdateSample.of_optimizers([optimizer])
        self.info = self._describe(capacity)

    @abc.abstractmethod
    def step(self, record: bool | None = None) -> StepRecord:
        """Run one optimizer step and return (and keep) what it measured."""

    # --- describing --------------------------------------------------------------------
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

    def _data_kind(self) -> str:
        """How batches are drawn (``JobInfo.data``; "": not known)."""
        return ""

    def _param_infos(self) -> tuple[ParamInfo, ...]:
        if self.flat is not None:  # the original parameters, whole
            return tuple(
                ParamInfo(e.name, e.shape, str(e.dtype), e.numel) for e in self.flat.entries
            )
        return tuple(
            ParamInfo(n, tuple(p.shape), str(p.dtype), p.numel())
            for n, p in zip(self.names, self.params, strict=True)
        )

    # --- a step's start and end --------------------------------------------------------
    def _now(self) -> float:
        if self.device.type == "cuda":  # kernels run asynchronously; time them, not launches
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _begin_step(self, record: bool | None) -> bool:
        """Ready the watchers for a step (the initial state before the first); -> whether
        it records per-parameter statistics (``record``, else the job's default)."""
        record = self.record if record is None else record
        if self.step_count == 0 and self.initial is None:
            self.initial = self._initial_state()  # what every rank starts from
        self.watcher.reset()
        self.outputs.reset()
        self._recording, self._buffer_prints = record, ()
        self._rngs = rng.fingerprints() if record else ()  # before the step draws from them
        return record

    def _keep(self, *, times, memory: StepMemory | None = None, **measured) -> StepRecord:
        """The record of the step just made (``step_count`` counts it), kept: what the job
        kind ``measured`` (:func:`dtlab.agent.step_record.make_record`'s arguments) with
        what every kind records alike; ``memory`` None: read now (``_memory``)."""
        rec = make_record(
            self.step_count,
            times,
            self._memory() if memory is None else memory,
            rng=self._rngs,
            module_outputs=tuple(self.outputs.prints) if self.recording_outputs else (),
            **measured,
        )
        self.records.append(rec)
        return rec

    def _memory(self) -> StepMemory:
        return recorder.memory(self.params, self.optimizer, self.device, self._buffer_bytes())

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

    def stash_records(self, on: bool) -> None:
        """Put the step records aside (on: a replay's own records begin empty) or back."""
        if on:
            self._stashed = self.records
            self.records = collections.deque(maxlen=self.records.maxlen)
        elif self._stashed is not None:
            self.records, self._stashed = self._stashed, None

    # --- reading the model -------------------------------------------------------------
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

    def take_output(self) -> str:
        """What the job printed since the last call: a script job's output; "" here."""
        return ""

    def release(self) -> None:
        """Leave no hook of dtlab's on the parameters (the job is replaced or over)."""
        self.reached.close()

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
        """The full record of ``step`` if the buffer still holds it (a copy of the buffer
        read: a connected notebook asks from the engine's thread while the job steps)."""
        for rec in reversed(list(self.records)):
            if rec.step == step:
                return rec
            if rec.step < step:
                break
        return None

    def kept_steps(self) -> tuple[int, int]:
        """(first, last) step the buffer holds; (0, 0) when empty."""
        kept = list(self.records)
        return (kept[0].step, kept[-1].step) if kept else (0, 0)


def _rank() -> int:
    from dtlab.agent.rendezvous import identity

    return identity().rank

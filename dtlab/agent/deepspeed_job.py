"""A DeepSpeedEngine attached as this rank's job: ``dtlab.attach(engine, None, loader,
loss_fn)`` or ``dtlab.attach(engine, step=fn)``, with the engine from ``deepspeed.initialize``.

One dtlab step is one DeepSpeed update: micro-batches until the engine's accumulation
boundary, each ``loss = loss_fn(engine, batch)``, ``engine.backward(loss)``,
``engine.step()`` (or ``fn(batch)`` doing those itself, called with the next batch until
the engine updated). The step ends at the ``engine.step()`` after which the engine's
``global_steps`` moved, as for a DeepSpeed script, and is watched the same way
(:mod:`dtlab.agent.deepspeed_observe` through :mod:`dtlab.agent.script_observe`'s
hooks): each parameter's full gradient through DeepSpeed's ``safe_get_full_grad`` just
before the update, the LR that update used (DeepSpeed's scheduler moves it inside
``step()``), the loss of each micro-batch, backward calls, DataLoader sample indices.
Parameters are the model's own (``engine.module``), read whole: gathered under ZeRO-3, the
fp32 master copy (``safe_get_full_fp32_param``) when the model computes in fp16 / bf16.
What the engine made of its ds_config goes to ``JobInfo.deepspeed``, for the doctor.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

import torch

from dtlab.agent import deepspeed_observe, recorder, script_observe, step_observer
from dtlab.agent.data_stream import DataStream, describe_data
from dtlab.agent.job import _default_indices
from dtlab.agent.jobs_base import DEFAULT_CAPACITY, JobCore
from dtlab.records import StepMemory, StepRecord

PIPELINE_MODULE = "deepspeed.runtime.pipe.engine"
CALLS_PER_ACCUMULATION = 16  # step=fn: calls without an update before dtlab gives up

ENGINE_CHECKPOINTS = (
    "dtlab checkpoints of an attached DeepSpeed engine are not supported yet (ZeRO keeps "
    "the optimizer state in its own flat partitions): save with engine.save_checkpoint(dir) "
    "from a %%dt cell and load with engine.load_checkpoint(dir); %dt_restart rebuilds the "
    "job through dt.set_job_setup(fn) from its step 0. Replays, bisection and the resume "
    "check need dtlab checkpoints, so they are refused too"
)


class EngineParams:
    """The model's own parameters inside a DeepSpeedEngine (``engine.module``), read whole
    wherever ZeRO keeps them; the same readers a DeepSpeed script's job uses
    (:mod:`dtlab.agent.deepspeed_observe`). Every read of their values is a collective
    under ZeRO: every rank, same order."""

    def __init__(self, engine):
        self.engine = engine
        named = list(engine.module.named_parameters())
        self.names = tuple(n for n, _ in named)
        self.params = tuple(p for _, p in named)

    def infos(self):
        return deepspeed_observe.param_infos(self.names, self.params)  # ZeRO-3: ds_shape

    def grad_fields(self, summaries: dict | None = None) -> dict:
        """The record's gradient fields: from ``summaries`` (``id(p) -> (norm, bad,
        print)``, taken before the update) or else read now."""
        if summaries is None:
            summaries = deepspeed_observe.full_grads(self.params)
        norms, bad, missing, prints = [], [], [], []
        for i, p in enumerate(self.params):
            norm, nonfinite, fingerprint = summaries.get(id(p), (math.nan, 0, 0))
            if id(p) not in summaries:
                missing.append(i)
            norms.append(norm)
            bad.append(nonfinite)
            prints.append(fingerprint)
        return recorder.grad_fields(norms, bad, missing, prints)

    def param_prints(self) -> tuple[int, ...]:
        """Fingerprint of each whole parameter. In fp32 the model's own tensors: replicated
        under ZeRO-1/2 (so a rank whose weights drifted shows), gathered under ZeRO-3. In
        fp16 / bf16 the fp32 master copy the optimizer updates (a small update can leave
        the low-precision copy unchanged)."""
        if not (self.engine.bfloat16_enabled() or self.engine.fp16_enabled()):
            with deepspeed_observe.gathered(self.engine, self.params):
                return tuple(recorder.fingerprints(self.params))
        from deepspeed.utils import safe_get_full_fp32_param

        prints = []
        for p in self.params:
            master = safe_get_full_fp32_param(p)
            if master is None:  # no master copy (ZeRO-0 without one): the model's own
                with deepspeed_observe.gathered(self.engine, [p]):
                    master = p.detach().clone()
            prints.append(recorder.fingerprint(master))
        return tuple(prints)


def make_job(engine, optimizer, data, loss_fn, *, step, accumulate, options: dict) -> DeepSpeedJob:
    """The job for ``dtlab.attach(engine, ...)``, after checking what does not fit an
    engine; ``options`` are attach's other keyword arguments."""
    pipe = sys.modules.get(PIPELINE_MODULE)
    if pipe is not None and isinstance(engine, pipe.PipelineEngine):
        raise TypeError(
            "dtlab.attach does not take a DeepSpeed PipelineEngine: its train_batch() runs a "
            "whole pipeline schedule that dtlab cannot step or watch micro-batch by "
            "micro-batch. Attach a DeepSpeedEngine without pipeline parallelism, or build "
            "the pipeline with dtlab.agent.pipeline_job.attach_pipeline"
        )
    inner = deepspeed_observe.inner_optimizer(engine)
    if optimizer is not None and optimizer not in (engine.optimizer, engine.basic_optimizer, inner):
        raise TypeError(
            "the DeepSpeed engine owns its optimizer: pass None (dtlab.attach(engine, None, "
            f"data, loss_fn)), not a {type(optimizer).__name__} of your own"
        )
    if (loss_fn is None) == (step is None):
        raise TypeError(
            "give either loss_fn(engine, batch) -> loss (dtlab calls engine.backward and "
            "engine.step), or step=fn(batch) that does one micro-batch itself, not both"
        )
    if not callable(loss_fn if step is None else step):
        raise TypeError("loss_fn(engine, batch) and step=fn(batch) must be callable")
    if options.get("scheduler") not in (None, engine.lr_scheduler):
        raise TypeError(
            "the DeepSpeed engine steps its own scheduler: give it to deepspeed.initialize("
            "lr_scheduler=...) or the ds_config's 'scheduler', not to dtlab.attach"
        )
    refused = {
        "scaler": "DeepSpeed scales the loss itself (fp16 in the ds_config)",
        "before_step": "under ZeRO the gradients are not in .grad between backward and step: "
        "clip with gradient_clipping in the ds_config",
        "lr": "set the LR through DeepSpeed's scheduler (the ds_config's 'scheduler')",
    }
    for name, why in refused.items():
        if options.get(name) is not None:
            raise TypeError(f"{name}= does not apply to a DeepSpeed engine: {why}")
    if data is None:
        data = getattr(engine, "training_dataloader", None)
        if data is None:
            raise TypeError(
                "give the data to draw batches from: dtlab.attach(engine, None, data, loss_fn), "
                "or deepspeed.initialize(training_data=...) for the engine's own loader"
            )
    expected = int(engine.gradient_accumulation_steps())
    if accumulate is not None and accumulate != expected:
        raise ValueError(
            f"accumulate={accumulate}, but the DeepSpeed engine's gradient_accumulation_steps "
            f"is {expected} (from its ds_config): one dtlab step is one DeepSpeed update, so "
            "leave accumulate out (or None), or change gradient_accumulation_steps in the "
            "ds_config"
        )
    if engine.micro_steps % expected:
        raise ValueError(
            f"the DeepSpeed engine is in the middle of an accumulation ({engine.micro_steps} "
            f"micro-steps, gradient_accumulation_steps {expected}): attach it at a boundary, "
            "before its first engine.step() or right after an update"
        )
    return DeepSpeedJob(
        engine,
        data,
        loss_fn,
        step,
        record=options.get("record", True),
        capacity=options.get("capacity", DEFAULT_CAPACITY),
        indices=options.get("indices"),
        on_epoch=options.get("on_epoch"),
    )


class DeepSpeedJob(JobCore):
    """An attached DeepSpeedEngine; ``step()`` runs it to its next update."""

    def __init__(self, engine, data, loss_fn, step_fn, *, record, capacity, indices, on_epoch):
        self.engine = engine
        self.engine_params = EngineParams(engine)  # (read by JobCore.__init__'s describing)
        self.data, self._on_epoch, self._streaming = data, on_epoch, False
        # the data is drawn from the first step on, watched (see _start_stream)
        self.stream = DataStream((), None)
        self.loss_fn = loss_fn  # (None: step_fn does each micro-batch)
        self.step_fn = step_fn
        self.indices = indices or _default_indices
        self.own_indices = indices is not None
        self.accumulate = int(engine.gradient_accumulation_steps())
        super().__init__(
            engine,
            deepspeed_observe.inner_optimizer(engine),
            scheduler=engine.lr_scheduler,
            record=record,
            capacity=capacity,
        )
        self.info = replace(
            self.info,
            optimizer=deepspeed_observe.label(engine),
            scaler=engine.fp16_enabled(),
            deepspeed=deepspeed_observe.describe(engine),
        )
        self.checkpoint_problem = ENGINE_CHECKPOINTS

    def _data_kind(self) -> str:
        return describe_data(self.data)

    def _param_infos(self):
        return self.engine_params.infos()

    def _param_prints(self) -> tuple[int, ...]:
        return self.engine_params.param_prints()

    def _grad_fields(self) -> dict:
        return self.engine_params.grad_fields()

    def _memory(self) -> StepMemory:
        return deepspeed_observe.step_memory(self.engine, self.device, self._buffer_bytes())

    def _start_stream(self) -> None:
        """The data's first pass begins inside the first step, watched: a DataLoader's
        iterator made then reports the sample indices of its batches."""
        if not self._streaming:
            self.stream = DataStream(self.data, self._on_epoch)
            self._streaming = True

    def step(self, record: bool | None = None) -> StepRecord:
        record = self._begin_step(record)
        kinds: list[str] = []
        observer = step_observer.Observer(lambda kind, engine: kinds.append(kind))
        observer.started, observer.marker, observer.recording = True, self.engine, record
        if record:
            self.reached.start()
        own = {"forward": 0.0, "backward": 0.0, "data": 0.0}
        values, indices, starts = [], [], []
        script_observe.install(observer)
        try:
            self._start_stream()
            epoch = self.stream.epoch
            limit = CALLS_PER_ACCUMULATION * self.accumulate
            while not kinds:
                if len(values) == limit:
                    raise RuntimeError(
                        f"step=fn ran {limit} times without the DeepSpeed engine updating: it "
                        "must call engine.backward(loss) and engine.step() once per call"
                    )
                position = len(indices) if self.own_indices else len(observer.draft.indices)
                before = self.stream.epoch
                t0 = time.perf_counter()
                batch = self.stream.next_batch()
                own["data"] += time.perf_counter() - t0
                if self.stream.epoch != before:
                    starts.append(position)
                if self.step_fn is not None:
                    values.append(self.step_fn(batch))
                else:
                    values.append(self._micro_batch(batch, own))
                if self.own_indices or _default_indices(batch):
                    self.own_indices = True
                    indices.extend(int(i) for i in self.indices(batch))
        finally:
            script_observe.uninstall()
            unreached = self.reached.stop()
        draft = observer.take_draft()
        self.step_count += 1  # at once: the parameters have moved, whatever comes next
        t0 = time.perf_counter()
        grads = self.engine_params.grad_fields(draft.early_grads) if record else {}
        params = self._param_fields() if record else {}
        seen = self.step_fn is not None
        return self._keep(
            loss=_loss(values, observer, draft),
            lr=draft.lr,
            scale=observer.last_scale,
            skipped=kinds[0] == "skipped",
            times=(
                own["data"],
                draft.forward_s if seen else own["forward"],
                draft.backward_s if seen else own["backward"],
                observer.optimizer_s,
                time.perf_counter() - t0,
            ),
            indices=tuple(indices) if self.own_indices else tuple(draft.indices),
            epoch=epoch,
            epoch_starts=tuple(starts),
            nonfinite=(
                self.watcher.first_bad,
                _nonfinite_how(self.watcher.first_bad, values, draft),
            ),
            micro_batches=draft.backward_calls,
            input_fingerprints=tuple(draft.input_prints),
            unreached=unreached,
            grads=grads,
            params=params,
        )

    def _micro_batch(self, batch, own: dict) -> float:
        """One micro-batch the way DeepSpeed's tutorial loop does it."""
        t0 = time.perf_counter()
        loss = self.loss_fn(self.engine, batch)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        own["forward"] += t1 - t0
        own["backward"] += time.perf_counter() - t1
        self.engine.step()
        return float(loss.detach())


def _loss(values: list, observer, draft) -> float:
    """The mean of the micro-batches' losses (what loss_fn or fn returned), else of what
    the engine's backward() was given (which DeepSpeed divides by the accumulation)."""
    numbers = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            numbers.append(float(value.detach()))
        elif isinstance(value, (int, float)):
            numbers.append(float(value))
        else:
            return observer.loss(draft)
    return math.fsum(numbers) / len(numbers) if numbers else math.nan


def _nonfinite_how(module: str | None, values: list, draft) -> str:
    if module is not None:
        return "watched during the step"
    losses = [float(v) for v in draft.losses]
    if all(math.isfinite(v) for v in losses):
        return ""
    return (
        "not re-run: an attached DeepSpeed engine's micro-batches are not re-run; "
        "dt.watch_modules() names the module from the next steps on"
    )

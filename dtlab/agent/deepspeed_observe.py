"""DeepSpeed seen from a script run: its engine's steps are the step boundaries.

A DeepSpeed script calls ``engine.backward(loss)`` and ``engine.step()`` once per
micro-batch; the engine updates the parameters only at an accumulation boundary (every
``gradient_accumulation_steps`` calls), inside ``step()``, through an inner optimizer that
holds flat partitions of the parameters (ZeRO), not the model's own. So for a script that
uses DeepSpeed, dtlab wraps ``DeepSpeedEngine.step`` and ``.backward`` (once
``deepspeed.runtime.engine`` is imported: :func:`install_if_imported` runs at each
``backward()`` until then) and:

- a step boundary is a ``step()`` call after which the engine's ``global_steps`` moved (an
  update made, or skipped by the fp16 loss scaler on overflow: then recorded as skipped);
  the inner optimizer's own steps, inside it, are not boundaries;
- the first boundary's step-0 pause is just before that ``step()``, after the backward
  passes of the first optimizer step, as for a plain optimizer;
- while recording, each parameter's full gradient is taken through DeepSpeed's own
  accessor (``deepspeed.utils.safe_get_full_grad``) just before the update: under ZeRO-2
  the model's ``.grad`` are gone by then, moved into the engine's partitions. It is a
  collective per parameter on every rank, in the same order (recording is on or off on
  all ranks together);
- the loss of a micro-batch is the value ``engine.backward`` returns (divided by the
  accumulation steps, as DeepSpeed does; never multiplied by the fp16 loss scale);
- a step's memory counts the bytes the engine holds for its model on this rank, in
  DeepSpeed's own tensors (partitions, fp32 master copy, gradient partitions), not the
  model's ``.grad``: :func:`step_memory`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import weakref
from dataclasses import dataclass, field, replace

import torch

from dtlab.agent.recorder import PLAIN, grad_summary, local, memory
from dtlab.agent.state import RANK
from dtlab.records import DeepSpeedInfo, ParamInfo, StepMemory

ENGINE_MODULE = "deepspeed.runtime.engine"


def is_engine(obj) -> bool:
    """A DeepSpeedEngine (without importing deepspeed when the script did not)."""
    module = sys.modules.get(ENGINE_MODULE)
    return module is not None and isinstance(obj, module.DeepSpeedEngine)


def install_if_imported(patch) -> None:
    """Wrap the engine's ``step`` and ``backward`` with ``patch(owner, name, factory)``
    (script_observe's, undone at uninstall), once DeepSpeed's engine module is imported."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is None or (module.DeepSpeedEngine, "step") in RANK.observer_patched:
        return
    patch(module.DeepSpeedEngine, "step", _engine_step)
    patch(module.DeepSpeedEngine, "backward", _engine_backward)


def _at_boundary(engine) -> bool:
    """Will this ``step()`` call update (or skip) the parameters?"""
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    return not managed or bool(engine.is_gradient_accumulation_boundary())


def _engine_step(original):
    def step(self, *args, **kwargs):
        observer = RANK.observer
        if observer is None:
            return original(self, *args, **kwargs)
        before = observer.observe("deepspeed", _before_step, observer, self)
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        observer = RANK.observer  # read again: it may have been uninstalled meanwhile
        if observer is not None and before is not None:
            observer.observe("deepspeed", _after_step, observer, self, *before, t0)
        return out

    step.__wrapped__ = original
    return step


def _before_step(observer, engine) -> tuple[int, float | None]:
    """Before ``step()``: the update's own work if it is a boundary; (the engine's steps,
    the scale this step's backward passes used: step() lowers it on overflow, as
    DeepSpeed logs "Attempted loss scale: S, reducing to S/2")."""
    boundary = _at_boundary(engine)
    if boundary:
        _before_update(observer, engine)
    return engine.global_steps, (_loss_scale(engine) if boundary else None)


def _after_step(observer, engine, steps: int, scale: float | None, t0: float) -> None:
    """After ``step()``: a boundary when the engine's steps moved (an update, or a step the
    fp16 loss scaler skipped)."""
    if engine.global_steps != steps and observer.marker is engine:
        observer.last_scale = scale
        if not observer.explicit:
            observer.optimizer_s = time.perf_counter() - t0
            observer.steps_marked += 1
            observer.boundary("step" if engine.was_step_applied() else "skipped", engine)


def _before_update(observer, engine) -> None:
    """An accumulation boundary's ``step()`` is about to update: the step-0 pause on the
    first one, then the full gradients while recording."""
    observer.stepping(engine)
    if observer.marker is not engine:
        return
    lrs = engine.get_lr()  # DeepSpeed's scheduler moves it inside step(), after the update
    observer.draft.lr = float(lrs[0]) if lrs else None
    # ZeRO-1/2 free the gradient partition inside step(): counted now, for step_memory
    _GRADS_AT_UPDATE[engine] = (engine.global_steps, model_state(engine, True).grads.nbytes())
    if observer.recording:
        observer.draft.early_grads.update(full_grads(engine.module.parameters()))
        if observer.before_update is not None:
            observer.observe("update size", observer.before_update)


def full_grads(params) -> dict[int, tuple[float, int, int]]:
    """``id(param) -> (norm, non-finite count, fingerprint)`` of each parameter's whole
    gradient, through DeepSpeed's ``safe_get_full_grad`` (ZeRO-2 moved ``.grad`` into its
    partitions): a collective per parameter under ZeRO, so every rank, same order. A
    parameter without a gradient is left out."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for p in params:
        grad = safe_get_full_grad(p)
        if grad is not None:
            norms, bad, _, prints = grad_summary([grad])
            out[id(p)] = (norms[0], bad[0], prints[0])
    return out


def _engine_backward(original):
    def backward(self, loss, *args, **kwargs):
        observer = RANK.observer
        if observer is None:
            return original(self, loss, *args, **kwargs)
        observer.in_engine_backward += 1
        try:
            out = original(self, loss, *args, **kwargs)
        finally:
            observer.in_engine_backward -= 1
        observer = RANK.observer
        if observer is not None and isinstance(out, torch.Tensor) and out.numel() == 1:
            observer.observe("backward", observer.add_loss, out.detach().reshape(()))
        return out

    backward.__wrapped__ = original
    return backward


def gathered(engine, params):
    """A context in which ZeRO-3's partitioned ``params`` are whole (an all-gather on
    every rank, read-only: partitioned again at its end); nothing to do below stage 3."""
    if engine.zero_optimization_stage() < 3:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(list(params), modifier_rank=None)


def param_infos(names, params) -> tuple[ParamInfo, ...]:
    """Each parameter's full shape: ZeRO-3 leaves an empty tensor in the model between
    uses and keeps the shape in ``ds_shape``."""
    infos = []
    for name, p in zip(names, params, strict=True):
        shape = tuple(getattr(p, "ds_shape", p.shape))
        infos.append(ParamInfo(name, shape, str(p.dtype), int(getattr(p, "ds_numel", p.numel()))))
    return tuple(infos)


def _loss_scale(engine) -> float | None:
    """The fp16 loss scale now: ZeRO's optimizers expose their DynamicLossScaler's as
    ``cur_scale``, stage 0's FP16_Optimizer as ``loss_scale``; None without fp16 (bf16 and
    fp32 scale nothing)."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(engine.optimizer, "cur_scale", None)
    if scale is None:
        scale = getattr(engine.optimizer, "loss_scale", None)
    return float(scale) if scale is not None else None


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed steps (over ZeRO's flat partitions), for the LR and
    the optimizer state's bytes on this rank."""
    for candidate in (
        engine.basic_optimizer,
        getattr(engine.optimizer, "optimizer", None),
        engine.optimizer,
    ):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    raise TypeError(f"no torch optimizer found in {type(engine.optimizer).__name__}")


def describe(engine) -> DeepSpeedInfo:
    """What the engine made of its ds_config on this rank."""
    if engine.bfloat16_enabled():
        precision = "bf16"
    elif engine.fp16_enabled():
        precision = "fp16"
    else:
        precision = "fp32"
    raw = getattr(engine.config, "_param_dict", None) or getattr(engine, "_config", None)
    raw = getattr(raw, "_param_dict", raw)
    try:
        config = json.dumps(raw, sort_keys=True, default=str) if isinstance(raw, dict) else ""
    except (TypeError, ValueError):
        config = ""
    return DeepSpeedInfo(
        zero_stage=int(engine.zero_optimization_stage()),
        micro_batch=int(engine.train_micro_batch_size_per_gpu()),
        accumulation=int(engine.gradient_accumulation_steps()),
        train_batch=int(engine.train_batch_size()),
        dp_world=int(engine.dp_world_size),
        precision=precision,
        config=config,
    )


def label(engine) -> str:
    """The engine and its optimizer, as the rank table and the doctor name them."""
    outer = type(engine.optimizer).__name__
    inner = type(inner_optimizer(engine)).__name__
    stage = engine.zero_optimization_stage()
    return f"{outer} ({inner}, ZeRO stage {stage})" if outer != inner else inner


# --- memory ----------------------------------------------------------------------------------


class Held:
    """Byte ranges of storages, each counted once however many tensors view it: a tensor
    counts the range its elements reach in its storage (a view into a flat buffer its own
    slice, not the whole buffer), and ranges that several tensors cover count once. A
    DTensor counts its local shard."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[tuple[int, int]]] = {}

    def add(self, tensor) -> None:
        if tensor is None:
            return
        if type(tensor) not in PLAIN:
            if not isinstance(tensor, torch.Tensor):
                return
            tensor = local(tensor)
        numel = tensor.numel()
        if numel == 0 or tensor.is_meta:
            return
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        if tensor.is_contiguous():
            span = numel
        else:  # the span its elements reach
            span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        # keyed by where the storage begins (its data_ptr, without making its object)
        self.ranges.setdefault(tensor.data_ptr() - start, []).append((start, start + span * size))

    def add_all(self, tensors) -> None:
        for tensor in tensors:
            self.add(tensor)

    def merge(self, *others: Held) -> None:
        for other in others:
            for ptr, ranges in other.ranges.items():
                self.ranges.setdefault(ptr, []).extend(ranges)

    def covers(self) -> dict[int, list[tuple[int, int]]]:
        merged = {}
        for ptr, ranges in self.ranges.items():
            out: list[tuple[int, int]] = []
            for start, end in sorted(ranges):
                if out and start <= out[-1][1]:
                    out[-1] = (out[-1][0], max(out[-1][1], end))
                else:
                    out.append((start, end))
            merged[ptr] = out
        return merged

    def nbytes(self, minus: Held | None = None) -> int:
        """Bytes covered, less any covered by ``minus``."""
        mine, theirs = self.covers(), minus.covers() if minus else {}
        total = 0
        for ptr, ranges in mine.items():
            for start, end in ranges:
                total += end - start
                for a, b in theirs.get(ptr, ()):
                    total -= max(0, min(end, b) - max(start, a))
        return total


@dataclass
class ModelState:
    """The tensors a DeepSpeed engine holds for its model on this rank, by kind (see
    :func:`model_state`)."""

    model: Held = field(default_factory=Held)  # the model's own parameter tensors
    partition: Held = field(default_factory=Held)  # this rank's partition of them
    master: Held = field(default_factory=Held)  # the fp32 master copy the optimizer updates
    grads: Held = field(default_factory=Held)
    optimizer: Held = field(default_factory=Held)  # the inner torch optimizer's state
    buffers: list = field(default_factory=list)  # DeepSpeed's reduce buckets (not counted)

    def params(self) -> Held:
        params = Held()
        params.merge(self.model, self.partition, self.master)
        return params

    def nbytes(self) -> tuple[int, int, int]:
        """``(param_bytes, grad_bytes, optimizer_bytes)``, each range once."""
        return self.params().nbytes(), self.grads.nbytes(), self.optimizer.nbytes()


# the ZeRO optimizers' tensors, by DeepSpeed's names (stage 1/2: DeepSpeedZeroOptimizer,
# stage 3: DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer, stage 0's FP16_Optimizer)
_MODEL_FLAT = ("bit16_groups_flat", "bf16_groups_flat", "fp16_groups_flat")
_PARTITIONS = ("parallel_partitioned_bit16_groups", "bf16_partitioned_groups")  # per rank
_PARTITION_FLAT = ("fp16_partitioned_groups_flat",)
_MASTER = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
    "fp32_groups_flat",
)
_GRADS = ("grads_in_partition", "grad_partitions_flat_buffer", "fp32_groups_gradients_flat")
_GRAD_GROUPS = ("averaged_gradients", "all_grad_tensors")  # group -> tensors (or None)


def _tensors(value) -> list:
    """The tensors in one of DeepSpeed's attributes: a tensor, or a list of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _dp_rank(zero, group: int) -> int:
    import torch.distributed as dist

    groups = getattr(zero, "real_dp_process_group", None)
    pg = groups[group] if groups else getattr(zero, "dp_process_group", None)
    return dist.get_rank(group=pg)


def model_state(engine, grads_only: bool = False) -> ModelState:
    """What ``engine`` (a DeepSpeedEngine) holds for its model on this rank, counted in
    DeepSpeed's own tensors, whatever holds them at the moment of the call:

    - parameters: the model's tensors (``param.data``; ZeRO-1/2 and fp16/bf16: the flat
      buffer they are views into), this rank's partition (ZeRO-3: ``param.ds_tensor``, in
      ``fp16_partitioned_groups_flat``) and the fp32 master copy of it that the optimizer
      updates (a copy even when the model is fp32);
    - gradients: the model's ``.grad`` (and ``.grad_accum``) and DeepSpeed's own: ZeRO-1/2
      ``averaged_gradients`` / ``grads_in_partition`` / the master's ``.grad``, ZeRO-3
      ``grad_partitions_flat_buffer`` (this rank's partition of every gradient), bf16's
      fp32 gradient buffer;
    - optimizer state: the inner torch optimizer's ``state`` (exp_avg, exp_avg_sq, ...),
      of this rank's partition under ZeRO.

    Not counted: DeepSpeed's reduce buckets (``buffers``) and all-gather buffers, the
    parameters ZeRO-3 gathers for a module while it runs, activations. ``grads_only``: the
    gradients alone (what :func:`_before_update` counts at every step)."""
    zero = engine.optimizer
    params = list(engine.module.parameters())
    state = ModelState()
    state.grads.add_all(p.grad for p in params)
    state.grads.add_all(getattr(p, "grad_accum", None) for p in params)
    for name in _GRADS:
        state.grads.add_all(_tensors(getattr(zero, name, None)))
    for name in _GRAD_GROUPS:
        for group in (getattr(zero, name, None) or {}).values():
            state.grads.add_all(_tensors(group))
            state.grads.add(getattr(group, "flat_partition", None))
    masters = [t for name in _MASTER for t in _tensors(getattr(zero, name, None))]
    state.grads.add_all(t.grad for t in masters)
    if grads_only:
        return state
    state.model.add_all(p.data for p in params)  # ZeRO-3: empty unless gathered
    for name in _MODEL_FLAT:
        state.model.add_all(_tensors(getattr(zero, name, None)))
    for name in _PARTITIONS:
        for i, parts in enumerate(getattr(zero, name, None) or ()):
            state.partition.add(parts[_dp_rank(zero, i)])
    state.partition.add_all(getattr(p, "ds_tensor", None) for p in params)
    for name in _PARTITION_FLAT:
        state.partition.add_all(_tensors(getattr(zero, name, None)))
    state.master.add_all(masters)
    state.optimizer.add_all(
        value
        for values in inner_optimizer(engine).state.values()
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )
    for bucket in (getattr(zero, "ipg_buckets", None) or {}).values():
        state.buffers.extend(_tensors(getattr(bucket, "buffer", None)))
    return state


# engine -> (its global_steps, gradient bytes) as the last update began
_GRADS_AT_UPDATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_memory(engine, device: torch.device, dtlab_bytes: int = 0) -> StepMemory:
    """A DeepSpeed step's memory on this rank, counted in the engine's own tensors
    (:func:`model_state`) when the record is made, at the end of the step (after
    ``engine.step()`` updated and, under ZeRO-1/2, all-gathered the parameters):

    - ZeRO-1/2: parameters are the whole model (the flat buffer its tensors view, on every
      rank) plus the fp32 master copy of this rank's partition (1/N of it); the optimizer
      state is the partition's. Gradients are gone by then: ``step()`` frees the reduced
      partition once the optimizer used it. So they are the bytes held when the update
      began (counted in ``engine.step()``, after the backward passes of the step): this
      rank's reduced partition, about 1/N of the gradients under stage 1 as under stage 2
      (stage 1 holds the full gradients during the backward only).
    - ZeRO-3: parameters are partitioned: this rank's partition, the fp32 master copy of
      it, and the parameters kept whole on every rank (those under
      ``stage3_param_persistence_threshold`` elements) or still gathered; gradients are
      the partition buffer ZeRO-3 allocates once and keeps (the same at both moments);
      the optimizer state is the partition's.
    - stage 0: the model's tensors and ``.grad``, as under DDP (plus the fp32 master copy
      under fp16 / bf16).

    RSS, CUDA and dtlab's own bytes as for any job (:func:`dtlab.agent.recorder.memory`)."""

    param_bytes, grad_bytes, optimizer_bytes = model_state(engine).nbytes()
    at_update = _GRADS_AT_UPDATE.pop(engine, None)
    if at_update is not None and at_update[0] + 1 == engine.global_steps:
        grad_bytes = at_update[1]  # this step's update, made since
    base = memory((), inner_optimizer(engine), device, dtlab_bytes)
    return replace(
        base, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes
    )

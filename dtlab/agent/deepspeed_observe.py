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
  accumulation steps, as DeepSpeed does; never multiplied by the fp16 loss scale).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import torch

from dtlab.agent.state import RANK
from dtlab.records import DeepSpeedInfo, ParamInfo

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
        boundary = _at_boundary(self)
        if boundary:
            _before_update(observer, self)
        steps = self.global_steps
        # the scale this step's backward passes used, as for a GradScaler: step() lowers it
        # on overflow (DeepSpeed logs "Attempted loss scale: S, reducing to S/2")
        scale = _loss_scale(self) if boundary else None
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        observer = RANK.observer  # read again: it may have been uninstalled meanwhile
        if observer is not None and self.global_steps != steps and observer.marker is self:
            observer.last_scale = scale
            if not observer.explicit:
                observer.optimizer_s = time.perf_counter() - t0
                observer.steps_marked += 1
                observer.boundary("step" if self.was_step_applied() else "skipped", self)
        return out

    step.__wrapped__ = original
    return step


def _before_update(observer, engine) -> None:
    """An accumulation boundary's ``step()`` is about to update: the step-0 pause on the
    first one, then the full gradients while recording."""
    observer.stepping(engine)
    if observer.marker is not engine:
        return
    lrs = engine.get_lr()  # DeepSpeed's scheduler moves it inside step(), after the update
    observer.draft.lr = float(lrs[0]) if lrs else None
    if observer.recording:
        observer.draft.early_grads.update(full_grads(engine.module.parameters()))


def full_grads(params) -> dict[int, tuple[float, int, int]]:
    """``id(param) -> (norm, non-finite count, fingerprint)`` of each parameter's whole
    gradient, through DeepSpeed's ``safe_get_full_grad`` (ZeRO-2 moved ``.grad`` into its
    partitions): a collective per parameter under ZeRO, so every rank, same order. A
    parameter without a gradient is left out."""
    from deepspeed.utils import safe_get_full_grad

    from dtlab.agent.recorder import grad_summary

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
            observer.draft.losses.append(out.detach().reshape(()))
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


def held(params) -> list[torch.Tensor]:
    """The parameter tensors this rank holds: ZeRO-3's local partitions (``ds_tensor``)."""
    return [getattr(p, "ds_tensor", p) for p in params]


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

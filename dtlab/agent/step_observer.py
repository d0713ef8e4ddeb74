"""What a step of code dtlab does not own did, told by hooks: the ``Observer``.

:mod:`dtlab.agent.script_observe` installs the hooks and patches (a script run by
``%dt_script``, or one call of a ``dtlab.attach(..., step=fn)`` step function) and sends
their events here: optimizer steps (the step boundaries), ``backward()`` calls and their
losses, forwards while recording, DataLoader batches. The Observer adds them up in a
``StepDraft`` until the boundary's owner takes it.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from dtlab.agent.data_stream import describe_data
from dtlab.agent.nonfinite import rng_state as nonfinite_rng


@dataclass
class StepDraft:
    """What one step did so far (reset at each boundary)."""

    losses: list = field(default_factory=list)  # detached loss tensors, already unscaled
    backward_calls: int = 0
    synced_calls: int = 0  # backward calls after a DDP forward that synchronises
    ddp_seen: bool = False
    forward_s: float = 0.0
    backward_s: float = 0.0
    data_s: float = 0.0
    indices: list = field(default_factory=list)
    passes: list = field(default_factory=list)  # (position in indices, pass number)
    input_prints: list = field(default_factory=list)  # outermost forwards' input tensors
    # optimizer in backward: each parameter's gradient as its optimizer stepped inside
    # backward() (the script drops it right after): id(param) -> grad_summary of it
    early_grads: dict = field(default_factory=dict)
    # while recording: each outermost training forward (module, args, kwargs or None when
    # not seen, RNG state at its start), to re-run one whose loss comes out inf/nan
    forwards: list = field(default_factory=list)
    nonfinite: tuple[str | None, str] = (None, "")  # (first bad module, how found / why not)
    lr: float | None = None  # the LR the update used, when read before it (DeepSpeed)


class Observer:
    """Receives the hooks' events for one script run; ``boundary(kind, optimizer)`` is
    called at each step boundary (``kind``: "pre" before the first step's update, "step"
    after a step, "skipped" when a GradScaler skipped it)."""

    def __init__(self, boundary, note=None):
        self._make_boundary = boundary
        self.note = note or (lambda text: None)
        self.draft = StepDraft()
        self.recording = True
        self.marker: torch.optim.Optimizer | None = None  # the optimizer whose steps count
        self.explicit = False  # the script calls dtlab.step_boundary() itself
        self.steps_marked = 0  # boundaries made at the marking optimizer's steps
        self.optimizers: list = []  # every optimizer seen stepping, in order
        self.started = False  # the first boundary ("pre") has been reached
        self._depth = 0
        self._forward_t0 = 0.0
        self._last_sync: bool | None = None
        self._scaled: dict[int, float] = {}  # id(scaled loss) -> scale it was multiplied by
        self._in_scaler_step = 0
        self._post_seen = 0
        self._opt_t0 = 0.0
        self.optimizer_s = 0.0
        self._passes: dict[int, int] = {}  # id(DataLoader) -> passes begun
        self.data_kinds: dict[int, str] = {}  # id(DataLoader) -> how it draws batches
        self.iterators: weakref.WeakSet = weakref.WeakSet()  # to shut their workers down
        self.last_scale: float | None = None
        self._backward_depth = 0
        self._deferred: list = []  # boundaries reached inside backward(), made at its end
        self._noted_in_backward = False
        self._kwarg_hooks: dict[int, object] = {}  # id(outermost module) -> kwargs hook
        self.deepspeed = False  # DeepSpeedEngine's step and backward are wrapped
        self.in_engine_backward = 0  # inside DeepSpeedEngine.backward: it records the loss

    def boundary(self, kind: str, optimizer) -> None:
        """A step boundary. One reached inside ``backward()`` (an optimizer stepped from a
        gradient hook: optimizer in backward) waits until that backward returns: pausing
        in the middle of autograd would leave the other parameters' updates, and the
        step's loss, on the wrong side of the pause."""
        if self._backward_depth:
            if not self._noted_in_backward:
                self._noted_in_backward = True
                self.note(
                    "the optimizer steps inside backward() (optimizer in backward): each "
                    "step boundary is where that backward() returns, so the step-0 pause "
                    "comes after the first update; gradients are recorded as each "
                    "parameter's optimizer stepped"
                )
            self._deferred.append((kind, optimizer))
            return
        self._make_boundary(kind, optimizer)

    def enter_backward(self) -> None:
        self._backward_depth += 1

    def leave_backward(self) -> None:
        self._backward_depth = max(0, self._backward_depth - 1)

    def flush_deferred(self) -> None:
        """After the outermost backward() returned: the boundaries reached inside it."""
        while self._deferred and not self._backward_depth:
            kind, optimizer = self._deferred.pop(0)
            self._make_boundary(kind, optimizer)

    # --- optimizer ----------------------------------------------------------------------
    def stepping(self, optimizer) -> None:
        """An optimizer steps (or its scaler skipped the step): the first one marks the
        boundaries, and the first step of all is the step-0 pause."""
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        if self.marker is None and not self.explicit:
            self.marker = optimizer
        if not self.started:
            self.started = True
            self.boundary("pre", optimizer)

    def on_pre_step(self, optimizer) -> None:
        self.stepping(optimizer)
        if optimizer is self.marker and self.recording and not self.draft.nonfinite[1]:
            self._locate_nonfinite()  # before the update: the parameters are the forward's
        if self._backward_depth and self.recording:
            self._keep_early_grads(optimizer)
        if optimizer is self.marker:
            self._opt_t0 = time.perf_counter()

    def on_post_step(self, optimizer) -> None:
        self._post_seen += 1
        if optimizer is self.marker and not self.explicit:
            self.optimizer_s = time.perf_counter() - self._opt_t0
            self.steps_marked += 1
            self.boundary("step", optimizer)

    def on_scaler_step_done(self, optimizer, posts_before: int) -> None:
        if self._post_seen != posts_before:
            return  # the optimizer stepped: its post-hook was the boundary
        self.stepping(optimizer)
        if optimizer is self.marker and not self.explicit:
            self.optimizer_s = 0.0
            self.steps_marked += 1
            self.boundary("skipped", optimizer)

    def explicit_boundary(self) -> None:
        """``dtlab.step_boundary()`` in the script: from its first call on, a boundary at
        each call and none at optimizer steps. A first call that ends an iteration whose
        optimizer step was a boundary already is not one more (the script cannot be read
        ahead: whether it calls step_boundary() may depend on its arguments)."""
        first, self.explicit = not self.explicit, True
        if not self.started:  # no optimizer stepped yet: begin at the first call
            self.started = True
            self.boundary("pre", None)
        if first and self.steps_marked:
            return
        self.boundary("step", None)

    def _keep_early_grads(self, optimizer) -> None:
        from dtlab.agent.recorder import grad_summary

        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    norms, bad, missing, prints = grad_summary([p.grad])
                    self.draft.early_grads[id(p)] = (norms[0], bad[0], prints[0])

    def _watch_kwargs(self, module) -> None:
        """Hook ``module`` alone (once) so that its forwards' keyword arguments reach
        :meth:`on_forward_kwargs`; a hook added during a call fires from the next one."""
        if id(module) not in self._kwarg_hooks:
            self._kwarg_hooks[id(module)] = module.register_forward_pre_hook(
                self._forward_kwargs, with_kwargs=True
            )

    def _forward_kwargs(self, module, args, kwargs):
        """The hook on an outermost module alone: its forward's keyword arguments (the
        global forward hooks see positional inputs only)."""
        if self.recording:
            self.on_forward_kwargs(module, kwargs)
        return None  # never replace the call's arguments

    def close(self) -> None:
        """Remove the per-module hooks this observer added."""
        for handle in self._kwarg_hooks.values():
            handle.remove()
        self._kwarg_hooks.clear()

    def take_draft(self) -> StepDraft:
        draft, self.draft = self.draft, StepDraft()
        self._depth = 0  # a forward that raised never closed
        return draft

    # --- backward -----------------------------------------------------------------------
    def on_backward(self, tensors, seconds: float) -> None:
        d = self.draft
        d.backward_calls += 1
        d.backward_s += seconds
        if self._last_sync is not None:
            d.ddp_seen = True
            d.synced_calls += int(self._last_sync)
        first = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
        if self.in_engine_backward:
            return  # DeepSpeed scaled it: its engine's backward() gives the loss
        if isinstance(first, torch.Tensor) and first.numel() == 1:
            scale = self._scaled.pop(id(first), None)
            value = first.detach().reshape(())
            d.losses.append(value / scale if scale else value)

    def loss(self, draft: StepDraft) -> float:
        """The step's loss: the sum of what backward() was called on (nan: none)."""
        if not draft.losses:
            return math.nan
        return sum(float(v) for v in draft.losses)  # left to right, as `total += loss.item()`

    # --- forward (only while recording) -------------------------------------------------
    def on_forward_pre(self, module, inputs) -> None:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self._last_sync = bool(module.require_backward_grad_sync and torch.is_grad_enabled())
        if self._depth == 0:
            self._forward_t0 = time.perf_counter()
            if torch.is_grad_enabled():  # training inputs, not an evaluation's
                self.draft.input_prints.extend(_input_prints(inputs))
                device = next((p.device for p in module.parameters()), torch.device("cpu"))
                rng = nonfinite_rng(device)
                self._watch_kwargs(module)
                # kwargs: None until this module's own hook reports them (on_forward_kwargs)
                self.draft.forwards.append((module, inputs, None, rng))
        self._depth += 1

    def on_forward_kwargs(self, module, kwargs) -> None:
        """The outermost forward's keyword arguments (a per-module hook, after the global
        one that opened the forward)."""
        forwards = self.draft.forwards
        if forwards and forwards[-1][0] is module and forwards[-1][2] is None:
            forwards[-1] = (module, forwards[-1][1], dict(kwargs), forwards[-1][3])

    def _locate_nonfinite(self) -> None:
        """A step whose loss went inf/nan: re-run the forward that made it, with hooks
        (agent/nonfinite.py), before the optimizer moves the parameters."""
        from dtlab.agent import nonfinite

        d = self.draft
        bad = [i for i, v in enumerate(d.losses) if not math.isfinite(float(v))]
        if not bad or not d.forwards:
            return
        index = bad[0] if len(d.forwards) == len(d.losses) else len(d.forwards) - 1
        module, args, kwargs, rng = d.forwards[index]
        inner = nonfinite.unwrapped(module)
        device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        d.nonfinite = nonfinite.rerun(
            inner, lambda m: m(*args, **(kwargs or {})), rng, device, index, "output"
        )

    def on_forward_post(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.draft.forward_s += time.perf_counter() - self._forward_t0

    # --- data ---------------------------------------------------------------------------
    def on_new_pass(self, loader) -> int:
        self.data_kinds[id(loader)] = describe_data(loader)
        number = self._passes.get(id(loader), -1) + 1
        self._passes[id(loader)] = number
        return number

    def on_batch(self, index, pass_number: int, seconds: float) -> None:
        d = self.draft
        d.data_s += seconds
        if not torch.is_grad_enabled() or index is None:
            return
        if not d.passes or d.passes[-1][1] != pass_number:
            d.passes.append((len(d.indices), pass_number))
        d.indices.extend(_flat_indices(index))


def _input_prints(inputs) -> list[int]:
    from dtlab.agent.recorder import input_fingerprints

    return input_fingerprints(inputs)


def _flat_indices(index) -> list[int]:
    if isinstance(index, int):
        return [index]
    if isinstance(index, torch.Tensor):
        return [int(i) for i in index.reshape(-1).tolist()]
    out: list[int] = []
    for item in index:
        if isinstance(item, (list, tuple, torch.Tensor)):
            out.extend(_flat_indices(item))
        elif isinstance(item, int):
            out.append(item)
    return out

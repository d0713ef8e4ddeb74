"""What an unchanged training script does in each optimizer step, seen through hooks.

dtlab does not own the loop of a script run by ``%dt_script``: it watches it. Installed
while a script runs on this rank (``install(observer)``; ``uninstall()`` at its end):

- torch's global optimizer step hooks (every ``optimizer.step()``, directly or through a
  GradScaler, accelerate or HF Trainer): the post-hook is the step boundary. It runs after
  every hook the user put on the optimizer, so the gradients it records are the ones the
  step used (after the script's clipping, manual all-reduce or unscale). Its pre-hook
  returns None, always: it never changes the step's arguments. An optimizer stepped
  inside ``backward()`` (from a gradient hook: optimizer in backward) makes its boundary
  where that backward returns, never in the middle of autograd;
- ``torch.autograd.backward`` (``loss.backward()`` calls it): one micro-batch each, its
  loss value (unscaled when a GradScaler scaled it) and time;
- ``GradScaler.step``: a step the scaler skipped on inf/nan fires no optimizer hook, yet
  is a step boundary, recorded as skipped; ``GradScaler.scale`` notes the scale of each
  loss it scales;
- global module forward hooks while recording: forward time (outermost calls only) and,
  on a DistributedDataParallel module, whether that micro-batch synchronises gradients
  (``require_backward_grad_sync``, which ``no_sync()`` and nanoGPT-style loops toggle);
- DataLoader iterators: the sample indices each batch was drawn from (whatever the batch
  looks like), the pass over the loader (each ``iter(loader)`` begins one) and the time
  spent waiting for the batch. Only batches fetched with gradients enabled count: an
  evaluation loop under ``torch.no_grad()`` is not training data.

Each wrapper does nothing but call the original when no observer is installed, so a
module that bound one while a script ran stays correct after it ended.
"""

from __future__ import annotations

import collections
import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from dtlab.agent.state import RANK


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
        self.iterators: weakref.WeakSet = weakref.WeakSet()  # to shut their workers down
        self.last_scale: float | None = None
        self._backward_depth = 0
        self._deferred: list = []  # boundaries reached inside backward(), made at its end
        self._noted_in_backward = False

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
    def _stepping(self, optimizer) -> None:
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
        self._stepping(optimizer)
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
        self._stepping(optimizer)
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
        self._depth += 1

    def on_forward_post(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.draft.forward_s += time.perf_counter() - self._forward_t0

    # --- data ---------------------------------------------------------------------------
    def on_new_pass(self, loader) -> int:
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


# --- the patches -----------------------------------------------------------------------------


def install(observer: Observer) -> None:
    """Observe this process's training through ``observer`` until ``uninstall()``."""
    if RANK.observer is not None:
        raise RuntimeError("a script is already observed on this rank")
    RANK.observer = observer
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    RANK.observer_hooks["pre"] = register_optimizer_step_pre_hook(_pre_hook)
    RANK.observer_hooks["post"] = register_optimizer_step_post_hook(_post_hook)
    _patch(torch.autograd, "backward", _backward)
    _patch_scalers()
    _patch_loader()
    set_recording(observer.recording)


def uninstall() -> None:
    for key in ("pre", "post", "fwd_pre", "fwd_post"):
        handle = RANK.observer_hooks.pop(key, None)
        if handle is not None:
            handle.remove()
    for (owner, name), original in list(RANK.observer_patched.items()):
        setattr(owner, name, original)
    RANK.observer_patched.clear()
    RANK.observer = None


def set_recording(on: bool) -> None:
    """Forward hooks cost every module call a little: on only while recording."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    hooks = RANK.observer_hooks
    if RANK.observer is not None:
        RANK.observer.recording = on
    if on and "fwd_pre" not in hooks:
        hooks["fwd_pre"] = register_module_forward_pre_hook(_forward_pre)
        hooks["fwd_post"] = register_module_forward_hook(_forward_post, always_call=True)
    elif not on:
        for key in ("fwd_pre", "fwd_post"):
            handle = hooks.pop(key, None)
            if handle is not None:
                handle.remove()


def _patch(owner, name: str, wrapper_factory) -> None:
    original = getattr(owner, name)
    RANK.observer_patched[(owner, name)] = original
    setattr(owner, name, wrapper_factory(original))


def _pre_hook(optimizer, args, kwargs):
    observer = RANK.observer
    if observer is not None:
        observer.on_pre_step(optimizer)
    return None  # never replace the step's arguments


def _post_hook(optimizer, args, kwargs) -> None:
    observer = RANK.observer
    if observer is not None:
        observer.on_post_step(optimizer)


def _forward_pre(module, inputs) -> None:
    observer = RANK.observer
    if observer is not None:
        observer.on_forward_pre(module, inputs)


def _forward_post(module, inputs, output) -> None:
    observer = RANK.observer
    if observer is not None:
        observer.on_forward_post()


def _backward(original):
    def backward(tensors, *args, **kwargs):
        observer = RANK.observer
        if observer is None:
            return original(tensors, *args, **kwargs)
        t0 = time.perf_counter()
        observer.enter_backward()
        try:
            out = original(tensors, *args, **kwargs)
        finally:
            observer.leave_backward()
        observer.on_backward(tensors, time.perf_counter() - t0)
        observer.flush_deferred()
        return out

    backward.__wrapped__ = original
    return backward


def _patch_scalers() -> None:
    scaler = torch.amp.GradScaler
    _patch(scaler, "step", _scaler_step)
    _patch(scaler, "scale", _scaler_scale)


def _scaler_step(original):
    def step(self, optimizer, *args, **kwargs):
        if RANK.observer is None:
            return original(self, optimizer, *args, **kwargs)
        before = RANK.observer._post_seen
        out = original(self, optimizer, *args, **kwargs)
        observer = RANK.observer  # read again: it may have been uninstalled meanwhile
        if observer is not None:
            observer.last_scale = _scale_of(self)
            observer.on_scaler_step_done(optimizer, before)
        return out

    return step


def _scaler_scale(original):
    def scale(self, outputs):
        out = original(self, outputs)
        observer = RANK.observer
        if observer is not None and isinstance(out, torch.Tensor) and out.numel() == 1:
            value = _scale_of(self)
            if value:
                observer._scaled[id(out)] = value
                observer.last_scale = value
        return out

    return scale


def _scale_of(scaler) -> float | None:
    if not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def _patch_loader() -> None:
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    _patch(base, "__init__", _loader_init)
    _patch(base, "_reset", _loader_reset)
    _patch(base, "_next_index", _loader_next_index)
    _patch(base, "__next__", _loader_next)


def _loader_init(original):
    def __init__(self, loader, *args, **kwargs):
        observer = RANK.observer
        if observer is not None:  # before the original: worker prefetch draws indices
            self._dtlab_pass = observer.on_new_pass(loader)
            self._dtlab_indices = collections.deque()
            observer.iterators.add(self)
        original(self, loader, *args, **kwargs)

    return __init__


def _loader_reset(original):
    def _reset(self, loader, first_iter=False):
        observer = RANK.observer
        if observer is not None and not first_iter:  # persistent workers: a new pass
            self._dtlab_pass = observer.on_new_pass(loader)
            self._dtlab_indices = collections.deque()
        return original(self, loader, first_iter)

    return _reset


def _loader_next_index(original):
    def _next_index(self):
        index = original(self)
        queue = getattr(self, "_dtlab_indices", None)
        if queue is not None:  # prefetching workers draw ahead: batches come in order
            queue.append(index)
        return index

    return _next_index


def _loader_next(original):
    def __next__(self):
        if RANK.observer is None:
            return original(self)
        t0 = time.perf_counter()
        data = original(self)
        spent = time.perf_counter() - t0
        queue = getattr(self, "_dtlab_indices", None)
        index = queue.popleft() if queue else None
        observer = RANK.observer  # read again: it may have been uninstalled meanwhile
        if observer is not None:
            observer.on_batch(index, getattr(self, "_dtlab_pass", 0), spent)
        return data

    return __next__

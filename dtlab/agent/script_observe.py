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
module that bound one while a script ran stays correct after it ended. The events go to
the installed :class:`dtlab.agent.step_observer.Observer` (``RANK.observer``).

dtlab never breaks the script it watches:

- every observation runs guarded (``Observer.observe``): an exception of dtlab's own inside
  one switches that observation off for the rest of the run (``Observer.switch_off``: one
  note naming it, the step and the error; the doctor says "not checked" for what it fed)
  and the script goes on as under torchrun. The script's own calls (the original
  ``backward``, ``step``, ``__next__``) are never inside the guard: their exceptions are
  the script's;
- a forward dtlab sees only where it is the script's own (``hooks.hidden``): a forward
  run inside ``backward()`` (activation checkpointing's recompute), under a
  ``TorchDispatchMode`` (selective checkpointing's caching mode, FlopCounterMode, fake
  tensors) or while ``torch.compile`` traces is left alone, so no op of dtlab's is
  recorded, replayed or compiled.
"""

from __future__ import annotations

import collections
import sys
import time

import torch

from dtlab.agent import deepspeed_observe
from dtlab.agent.hooks import hidden
from dtlab.agent.state import RANK
from dtlab.agent.step_observer import Observer


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
    _watch_deepspeed(observer)
    set_recording(observer.recording)


def uninstall() -> None:
    if RANK.observer is not None:
        RANK.observer.close()
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


def _watch_deepspeed(observer: Observer) -> None:
    """Wrap DeepSpeed's engine once the script imported it: called at install, at every
    forward while recording and at every backward (a module lookup until then)."""
    if not observer.deepspeed and deepspeed_observe.ENGINE_MODULE in sys.modules:
        deepspeed_observe.install_if_imported(_patch)
        observer.deepspeed = True


def _patch(owner, name: str, wrapper_factory) -> None:
    original = getattr(owner, name)
    RANK.observer_patched[(owner, name)] = original
    setattr(owner, name, wrapper_factory(original))


def _pre_hook(optimizer, args, kwargs):
    observer = RANK.observer
    if observer is not None:
        observer.observe("optimizer", observer.on_pre_step, optimizer)
    return None  # never replace the step's arguments


def _post_hook(optimizer, args, kwargs) -> None:
    observer = RANK.observer
    if observer is not None:
        observer.observe("optimizer", observer.on_post_step, optimizer)


def _forward_pre(module, inputs) -> None:
    if torch.compiler.is_compiling():
        return  # first: dynamo traces this hook into a compiled region, and drops it here
    observer = RANK.observer
    if observer is None or "forward" in observer.off:
        return
    seen = not hidden()
    observer.forward_seen.append(seen)
    if seen:
        observer.observe("deepspeed", _watch_deepspeed, observer)
        observer.observe("forward", observer.on_forward_pre, module, inputs)


def _forward_post(module, inputs, output) -> None:
    if torch.compiler.is_compiling():
        return
    observer = RANK.observer
    if observer is None or "forward" in observer.off or not observer.forward_seen:
        return
    if observer.forward_seen.pop():
        observer.observe("forward", observer.on_forward_post)


def _backward(original):
    def backward(tensors, *args, **kwargs):
        observer = RANK.observer
        if observer is None:
            return original(tensors, *args, **kwargs)
        observer.observe("deepspeed", _watch_deepspeed, observer)
        t0 = time.perf_counter()
        observer.enter_backward()
        try:
            out = original(tensors, *args, **kwargs)
        finally:
            observer.leave_backward()
        observer.observe("backward", observer.on_backward, tensors, time.perf_counter() - t0)
        observer.observe("optimizer", observer.flush_deferred)
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
            observer.observe("scaler", _note_scale, observer, self)
            observer.observe("optimizer", observer.on_scaler_step_done, optimizer, before)
        return out

    return step


def _scaler_scale(original):
    def scale(self, outputs):
        out = original(self, outputs)
        observer = RANK.observer
        if observer is not None and isinstance(out, torch.Tensor) and out.numel() == 1:
            observer.observe("scaler", _note_scaled, observer, self, out)
        return out

    return scale


def _note_scale(observer: Observer, scaler) -> None:
    observer.last_scale = _scale_of(scaler)


def _note_scaled(observer: Observer, scaler, loss) -> None:
    """A loss the scaler scaled: backward() divides its value back."""
    value = _scale_of(scaler)
    if value:
        observer._scaled[id(loss)] = value
        observer.last_scale = value


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
            observer.observe("data loader", _begin_pass, observer, self, loader)
            observer.iterators.add(self)  # (not an observation: its workers end with it)
        original(self, loader, *args, **kwargs)

    return __init__


def _loader_reset(original):
    def _reset(self, loader, first_iter=False):
        observer = RANK.observer
        if observer is not None and not first_iter:  # persistent workers: a new pass
            observer.observe("data loader", _begin_pass, observer, self, loader)
        return original(self, loader, first_iter)

    return _reset


def _begin_pass(observer: Observer, iterator, loader) -> None:
    iterator._dtlab_pass = observer.on_new_pass(loader)
    iterator._dtlab_indices = collections.deque()


def _loader_next_index(original):
    def _next_index(self):
        index = original(self)
        queue = getattr(self, "_dtlab_indices", None)
        observer = RANK.observer
        if queue is not None and observer is not None and "data loader" not in observer.off:
            queue.append(index)  # prefetching workers draw ahead: batches come in order
        return index

    return _next_index


def _loader_next(original):
    def __next__(self):
        if RANK.observer is None:
            return original(self)
        t0 = time.perf_counter()
        data = original(self)
        spent = time.perf_counter() - t0
        observer = RANK.observer  # read again: it may have been uninstalled meanwhile
        if observer is not None:
            observer.observe("data loader", _took_batch, observer, self, spent)
        return data

    return __next__


def _took_batch(observer: Observer, iterator, seconds: float) -> None:
    queue = getattr(iterator, "_dtlab_indices", None)
    index = queue.popleft() if queue else None
    observer.on_batch(index, getattr(iterator, "_dtlab_pass", 0), seconds)

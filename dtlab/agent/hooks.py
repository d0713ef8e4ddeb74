"""Hooks dtlab puts on the user's model, each only while it is asked for.

- :class:`ModuleWatcher`: forward hooks that name the first module whose output is not
  finite (they cost ~20% of a demo step, so they are on only while watching);
- :class:`OutputRecorder`: forward hooks that fingerprint every module's output, in the
  order modules finish (for bisection: which module's output first differs between a run
  and its replay); ~10-20% of a step, so only while asked for;
- :class:`CommCounter`: a DDP comm hook that counts the gradient all-reduces (calls,
  bytes) and then does what DDP does by default.

A forward hook of dtlab's does nothing where :func:`hidden` says the forward is not the
script's own to observe.
"""

from __future__ import annotations

import torch


def hidden() -> bool:
    """Is a forward running now none of dtlab's business? Inside ``backward()`` (the
    recompute of activation checkpointing), under a TorchDispatchMode (selective
    checkpointing caches the ops it sees and replays them in the recompute: one of
    dtlab's would be replayed in place of the script's; FlopCounterMode; fake tensors)
    or while dynamo traces (compiled code would run dtlab's ops every call)."""
    return (
        torch.compiler.is_compiling()
        or torch._C._current_graph_task_id() != -1
        or torch._C._len_torch_dispatch_stack() > 0
    )


class ModuleWatcher:
    """``first_bad``: the first module (by name) with an inf/nan output since ``reset``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list = []
        self.first_bad: str | None = None

    def reset(self) -> None:
        self.first_bad = None

    def watch(self, on: bool) -> None:
        if on and not self.handles:
            self.handles = [
                module.register_forward_hook(self._hook(name))
                for name, module in self.model.named_modules()
                if name
            ]
        elif not on:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def _hook(self, name: str):
        def check(module, inputs, output):
            if self.first_bad is None and not hidden() and not _all_finite(output):
                self.first_bad = name

        return check


def _all_finite(output) -> bool:
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return all(
        bool(torch.isfinite(t).all())
        for t in tensors
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


class OutputRecorder:
    """``prints``: ``[(module name, fingerprint of its output), ...]`` since ``reset``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list = []
        self.prints: list[tuple[str, int]] = []

    def reset(self) -> None:
        self.prints = []

    def record(self, on: bool) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if on:  # (re-)registered last, so they see outputs after other hooks changed them
            self.handles = [
                module.register_forward_hook(self._hook(name))
                for name, module in self.model.named_modules()
                if name
            ]

    def _hook(self, name: str):
        from dtlab.agent.recorder import fingerprints

        def keep(module, inputs, output):
            if hidden():
                return
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            prints = fingerprints([t for t in tensors if isinstance(t, torch.Tensor)])
            self.prints.append((name, hash(tuple(prints)) & ((1 << 63) - 1)))

        return keep


class CommCounter:
    """Counts DDP's gradient all-reduces; ``installed`` is False when the model is not DDP
    or already has a comm hook of its own (DDP allows one)."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        self.bytes = 0
        self.installed = self._install(model)

    def reset(self) -> None:
        self.calls = self.bytes = 0

    def _install(self, model: torch.nn.Module) -> bool:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return False  # FSDP1 has a register_comm_hook too, for its own kind of hook
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def counting_allreduce(state, bucket):
            self.calls += 1
            self.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket)

        try:
            model.register_comm_hook(None, counting_allreduce)
        except RuntimeError:  # the user registered a hook of their own: leave it be
            return False
        return True


class ReachedParams:
    """Which parameters this rank's own backward reached in a step: a gradient hook on
    each one, before any all-reduce. Under DDP a parameter a rank's forward never used
    still ends the step with a gradient (find_unused_parameters=True averages the other
    ranks' in), so only this tells a rank-dependent branch from a shared one. Watching
    from ``start()`` to ``stop()``; the hooks are registered once (not every step) and
    do nothing in between; ``close()`` removes them. A sharded model (FSDP2, or FSDP1:
    ``sharded=True``) is not watched: its gradients accumulate on unsharded copies, not
    on the parameters it registers."""

    def __init__(self, params, sharded: bool = False):
        self.params = list(params)
        self.sharded = sharded or any(hasattr(p, "to_local") for p in self.params)
        self.reached: set[int] = set()
        self.watching = False
        self.handles: list = []

    def start(self) -> None:
        self.reached.clear()
        if self.sharded:
            return
        if not self.handles:
            self.handles = [
                p.register_post_accumulate_grad_hook(self._hook(i))
                for i, p in enumerate(self.params)
                if p.requires_grad
            ]
        self.watching = True

    def _hook(self, index: int):
        def reached(param) -> None:
            if self.watching:
                self.reached.add(index)

        return reached

    def stop(self) -> tuple[int, ...] | None:
        """Indices of the parameters (needing gradients) not reached since ``start()``;
        None when nothing was watched."""
        if not self.watching:
            return None
        self.watching = False
        return tuple(
            i for i, p in enumerate(self.params) if p.requires_grad and i not in self.reached
        )

    def close(self) -> None:
        self.watching = False
        for handle in self.handles:
            handle.remove()
        self.handles = []

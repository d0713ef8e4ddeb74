"""Where a non-finite loss came from, found after the fact, without watching in advance.

Nobody knows which step will blow up, and forward hooks on every module cost ~20% of a
step, so they are off by default. Instead, when a micro-batch's loss comes out inf/nan,
the job keeps that micro-batch (its batch and the random-number state it began with) and,
before the optimizer moves the parameters, runs its forward once more on this rank with
a hook on every module: the first module whose output is not finite is the source.

The re-run is local and leaves no trace: it goes through the unwrapped model (DDP's
wrapper would start a collective that the other ranks never join), under ``no_grad``,
with the RNGs restored to the micro-batch's start (dropout draws the same masks) and the
buffers (BatchNorm statistics) put back afterwards. A model with SyncBatchNorm is not
re-run: its forward is a collective. When the re-run comes out finite, the value did not
come back, and the record says so instead of naming a module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.agent.hooks import ModuleWatcher


@dataclass
class BadMicroBatch:
    """The first micro-batch of a step whose loss was not finite."""

    index: int  # its position in the step's micro-batches
    batch: Any
    rng: tuple[torch.Tensor, torch.Tensor | None]  # CPU and (if any) CUDA state at its start


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generators a forward on ``device`` draws from (cheap: a few KB copied)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def locate(
    module: torch.nn.Module,
    loss_fn: Callable,
    bad: BadMicroBatch,
    device: torch.device,
) -> tuple[str | None, str]:
    """``(first module with a non-finite output or None, how it was found / why not)``."""
    return rerun(module, lambda m: loss_fn(m, bad.batch), bad.rng, device, bad.index, "loss")


def rerun(
    module: torch.nn.Module,
    call: Callable[[torch.nn.Module], Any],
    rng: tuple[torch.Tensor, torch.Tensor | None],
    device: torch.device,
    index: int,
    what: str,
) -> tuple[str | None, str]:
    """Run ``call(module)`` once more with a hook on every module (see the module's
    docstring); ``what`` the call returns: "loss" or the model's "output"."""
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
        return None, "not re-run: the model has SyncBatchNorm, whose forward is a collective"
    if any(
        type(m).__name__.startswith("FSDP") or type(m).__name__ == "FullyShardedDataParallel"
        for m in module.modules()
    ):
        return None, "not re-run: the model is sharded (FSDP): its forward gathers from peers"
    watcher = ModuleWatcher(module)
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            watcher.watch(True)
            result = call(module)
    except Exception as e:  # the user's loss function may need the wrapper: say so
        return None, f"not located: re-running the forward failed ({type(e).__name__}: {e})"
    finally:
        watcher.watch(False)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in saved:
                    b.copy_(saved[name])
    how = f"found by re-running micro-batch {index} of the step with module hooks"
    if watcher.first_bad is not None:
        return watcher.first_bad, how
    if what == "output" and _finite(result):
        return None, (
            "re-run: every module's output was finite, so was the model's: the inf/nan came "
            "from the loss computed outside the model"
        )
    if not _finite(result):
        return None, f"re-run: every module's output was finite, the {what} was not"
    return None, "re-run came out finite: the inf/nan did not come back (not reproducible)"


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model without DDP's or torch.compile's wrapper (whose forward would start a
    collective, or compile again). FSDP1's stays: its inner module holds only flat
    shards, and :func:`rerun` says why it does not re-run it."""
    for _ in range(4):
        if type(model).__name__ == "FullyShardedDataParallel":
            return model
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def _finite(result: Any) -> bool:
    tensors = result if isinstance(result, (tuple, list)) else (result,)
    if isinstance(result, dict):
        tensors = tuple(result.values())
    with contextlib.suppress(Exception):
        return all(
            bool(torch.isfinite(t).all())
            for t in tensors
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        )
    return True

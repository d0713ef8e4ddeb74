"""``dtlab.attach``: hand this rank's training job to dtlab.

On every rank the user's code builds an ordinary model, optimizer, data and a loss
function, then hands them over::

    dtlab.attach(model, optimizer, loader, loss_fn, scheduler=sched, scaler=scaler)

or a whole step of its own (``step=fn``). The job is then the rank's attached job
(:mod:`dtlab.agent.job` runs the loop, :mod:`dtlab.agent.step_fn_job` watches a step
function). A DeepSpeedEngine is attached in place of the model, its optimizer left out
(``dtlab.attach(engine, None, loader, loss_fn)``): :mod:`dtlab.agent.deepspeed_job`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dtlab.agent import deepspeed_job, deepspeed_observe
from dtlab.agent.job import DEFAULT_CAPACITY, Job, install
from dtlab.agent.step_fn_job import StepFnJob
from dtlab.records import JobInfo


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    data: Iterable | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    *,
    step: Callable[[Any], Any] | None = None,
    before_step: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None = None,
    lr: Callable[[int], float] | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    record: bool = True,
    capacity: int = DEFAULT_CAPACITY,
    indices: Callable[[Any], Iterable[int]] | None = None,
    on_epoch: Callable[[int], None] | None = None,
    accumulate: int | None = None,
    no_sync: bool = True,
) -> JobInfo:
    """Hand this rank's training job to dtlab (call it on every rank).

    ``loss_fn(model, batch)`` runs the forward pass and returns the loss. ``indices(batch)``
    says which samples a batch holds (default: ``batch["index"]`` when there is one).
    ``on_epoch(epoch)`` is called when ``data`` is exhausted, before it is iterated again
    (e.g. ``sampler.set_epoch``). ``record=False`` keeps only loss, LR, times and memory.
    ``accumulate=k`` makes each step k micro-batches; with DDP only the last one syncs
    gradients unless ``no_sync=False`` (DDP's all-reduces are then counted each step).
    ``before_step(model, optimizer)`` runs after backward (and unscale), before the step:
    clipping, say. ``lr(step)`` sets every group's LR before each step (step counts from 0).

    Or hand over the whole step: ``step=fn``, ``fn(batch) -> loss`` doing its own
    zero_grad, backward, clipping, optimizer (and scheduler) step; dtlab watches it through
    the optimizer and backward hooks (:mod:`dtlab.agent.step_fn_job`), as for a script.
    Gradients are always recorded after every hook on the optimizer (a manual all-reduce in
    a pre-hook included): what the step used.

    A DeepSpeedEngine (``deepspeed.initialize``'s) as ``model``, with ``optimizer`` None:
    one step is one DeepSpeed update, ``loss_fn(engine, batch)`` / ``engine.backward`` /
    ``engine.step()`` per micro-batch (or ``step=fn(batch)`` doing one micro-batch),
    ``accumulate`` the engine's gradient_accumulation_steps (None: take it from there),
    ``data`` by default the loader ``deepspeed.initialize`` made from ``training_data``.
    """
    if deepspeed_observe.is_engine(model):
        options = dict(scheduler=scheduler, scaler=scaler, before_step=before_step, lr=lr)
        options.update(record=record, capacity=capacity, indices=indices, on_epoch=on_epoch)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 step, got {capacity}")
        engine_job = deepspeed_job.make_job(
            model, optimizer, data, loss_fn, step=step, accumulate=accumulate, options=options
        )
        install(engine_job)
        return engine_job.info
    accumulate = 1 if accumulate is None else accumulate
    if data is None:
        raise TypeError(
            "give the data to draw batches from: dtlab.attach(model, optimizer, data, ...)"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if (loss_fn is None) == (step is None):
        raise TypeError(
            "give either loss_fn(model, batch) -> loss, or step=fn(batch) that "
            "does the whole step (backward and optimizer step too), not both"
        )
    if not callable(loss_fn if step is None else step):
        what = "loss_fn(model, batch) -> loss tensor" if step is None else "step=fn(batch)"
        raise TypeError(f"{what} must be callable")
    for name, fn in (("before_step", before_step), ("lr", lr)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name}= must be callable, got {type(fn).__name__}")
    if step is not None and (before_step or lr or accumulate != 1 or scheduler or scaler):
        raise TypeError(
            "with step=fn the function does the whole step: leave out "
            "before_step, lr, accumulate, scheduler and scaler"
        )
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 step, got {capacity}")
    if accumulate < 1:
        raise ValueError(f"accumulate must be at least 1 micro-batch, got {accumulate}")
    if step is not None:
        job = StepFnJob(
            model,
            optimizer,
            data,
            step,
            record=record,
            capacity=capacity,
            indices=indices,
            on_epoch=on_epoch,
        )
    else:
        job = Job(
            model,
            optimizer,
            data,
            loss_fn,
            scheduler=scheduler,
            scaler=scaler,
            record=record,
            capacity=capacity,
            indices=indices,
            on_epoch=on_epoch,
            accumulate=accumulate,
            no_sync=no_sync,
            before_step=before_step,
            lr=lr,
        )
    install(job)
    return job.info

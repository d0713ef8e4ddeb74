"""What a step of code dtlab does not own did, told by hooks: the ``Observer``.

:mod:`dtlab.agent.script_observe` installs the hooks and patches (a script run by
``%dt_script``, or one call of a ``dtlab.attach(..., step=fn)`` step function) and sends
their events here: optimizer steps (the step boundaries), ``backward()`` calls and their
losses, forwards while recording, DataLoader batches. The Observer adds them up in a
``StepDraft`` until the boundary's owner takes it.

Each event is one of dtlab's *observations* (``OBSERVATIONS``), run through
:meth:`Observer.observe`: one that raises is switched off for the rest of the run, with a
note, instead of breaking the script.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
import weakref
from dataclasses import dataclass, field

import torch

from dtlab.agent.data_stream import describe_data
from dtlab.agent.nonfinite import rng_state as nonfinite_rng
from dtlab.agent.state import RANK

# dtlab's observations of a step it does not own, and what each one records
OBSERVATIONS = {
    "optimizer": "the step boundaries (the script runs on without pausing)",
    "backward": "the loss, micro-batches and backward time",
    "forward": "forward time, the model's input fingerprints, where an inf/nan came from",
    "data loader": "sample indices, epochs and the time spent waiting for data",
    "scaler": "the loss scale and the steps a GradScaler skipped",
    "deepspeed": "DeepSpeed's engine steps",
    "gradients": "gradient norms and fingerprints",
    "parameters": "parameter fingerprints",
    "memory": "memory",
    "update size": "the size of each rank's update",
    "output": "the script's output",
}


@dataclass
class StepDraft:
    """What one step did so far (reset at each boundary)."""

    losses: list = field(default_factory=list)  # detached loss tensors, already unscaled
    loss_at: list = field(default_factory=list)  # per loss: how many forwards came before
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
        self.steps_done = 0  # boundaries made after a step (the step running is this + 1)
        self.off: set[str] = set()  # observations switched off after they failed
        self.switched_off: list[tuple[str, int, str]] = []  # (name, step, error), in order
        # per forward call in progress, outermost first: whether dtlab observes it (one
        # inside backward, a dispatch mode or compilation is not)
        self.forward_seen: list[bool] = []
        # optimizers stepped inside the marking one's step (a container's, a wrapper's
        # inner optimizers): those that update the parameters; set at each marking step
        self.updaters: list = []
        self._marker_open = False
        # the last step whose model forwards were seen: its micro-batches, and whether it
        # called backward() more often than that (a chunked loss)
        self._micro, self._chunked = 0, False
        # the job's ``part_of(module)``: the model part a forward runs, else None (set by
        # a script job once it knows its model)
        self.part_of = None
        # the job's call just before the marking optimizer updates (while recording)
        self.before_update = None

    def observe(self, name: str, fn, *args):
        """``fn(*args)``, part of the observation ``name`` (a key of OBSERVATIONS); an
        exception inside it switches that observation off for the run instead of reaching
        the script. Nothing is done (None) once it is off."""
        if name in self.off:
            return None
        try:
            if RANK.fault_observations:
                self._planted_fault(name)
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - dtlab's own failure, never the script's
            self.switch_off(name, error)
            return None

    def _planted_fault(self, name: str) -> None:
        """A failure made on purpose (``dtlab.inject.fail_observation``)."""
        at = RANK.fault_observations.get(name)
        if at is not None and self.steps_done + 1 >= at:
            raise RuntimeError(f"planted fault in dtlab's {name} observation")

    def switch_off(self, name: str, error: BaseException) -> None:
        """Observation ``name`` failed: off for the rest of the run, said once."""
        if name in self.off:
            return
        self.off.add(name)
        step = self.steps_done + 1
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        what = f"{type(error).__name__}: {error}"
        self.switched_off.append((name, step, what))
        if name == "forward":
            self.forward_seen.clear()
            self._depth = 0
        self.note(
            f"dtlab's {name} observation failed at step {step} ({what}{where}); it is off "
            f"for the rest of this run and the script goes on unchanged. Not recorded from "
            f"then on: {OBSERVATIONS.get(name, name)}; the doctor says 'not checked' where "
            "it needed them"
        )

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
        self._boundary_now(kind, optimizer)

    def _boundary_now(self, kind: str, optimizer) -> None:
        if kind != "pre":
            self.steps_done += 1
        self._make_boundary(kind, optimizer)

    def enter_backward(self) -> None:
        self._backward_depth += 1

    def leave_backward(self) -> None:
        self._backward_depth = max(0, self._backward_depth - 1)

    def flush_deferred(self) -> None:
        """After the outermost backward() returned: the boundaries reached inside it."""
        while self._deferred and not self._backward_depth:
            kind, optimizer = self._deferred.pop(0)
            self._boundary_now(kind, optimizer)

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
        if optimizer is self.marker:
            self._marker_open, self.updaters = True, []
        elif self._marker_open and optimizer not in self.updaters:
            self.updaters.append(optimizer)  # stepped by the marking one: it updates
        self.stepping(optimizer)
        if optimizer is self.marker and self.recording and self.before_update is not None:
            self.observe("update size", self.before_update)
        if optimizer is self.marker and self.recording and not self.draft.nonfinite[1]:
            self._locate_nonfinite()  # before the update: the parameters are the forward's
        if self._backward_depth and self.recording:
            self._keep_early_grads(optimizer)
        if optimizer is self.marker:
            self._opt_t0 = time.perf_counter()

    def on_post_step(self, optimizer) -> None:
        self._post_seen += 1
        if optimizer is self.marker:
            self._marker_open = False
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

    def add_loss(self, value: torch.Tensor) -> None:
        """A micro-batch's loss (a detached 0-d tensor), after the forwards so far."""
        self.draft.losses.append(value)
        self.draft.loss_at.append(len(self.draft.forwards))

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
            scale = self._scaled.pop(id(first), None) or 1.0
            value = first.detach().reshape(())
            divisor = scale * loss_divisor()  # a pipeline schedule's micro-batches: a mean
            self.add_loss(value / divisor if divisor != 1 else value)

    def loss(self, draft: StepDraft) -> float:
        """The step's loss: the sum of what backward() was called on (nan: none)."""
        if not draft.losses:
            return math.nan
        return sum(float(v) for v in draft.losses)  # left to right, as `total += loss.item()`

    def step_loss(self, draft: StepDraft, part_of) -> tuple[float, int]:
        """(the step's loss, its micro-batches), the model's forwards telling them apart
        (``part_of(module)``: the index of the model part it runs, else None).

        A micro-batch is a forward of the model (of each of its parts, when it is held
        in parts run one after another): the step's count is the most forwards any part
        ran. Where backward() ran more often than that (a chunked loss calls it per chunk
        inside its loss function, then the script once on the total), a micro-batch's
        loss is the last backward() before the model's next forward; otherwise each
        backward() is one micro-batch's (a pipeline schedule runs every forward first).
        With no forward of the model seen (forward hooks off: not recording), each
        backward() is a micro-batch, as before."""
        counts: dict[int, int] = {}
        lead_before: list[int] = []  # forwards of the first part before forward i
        lead = None
        for module, *_ in draft.forwards:
            lead_before.append(counts.get(lead, 0) if lead is not None else 0)
            part = part_of(module)
            if part is None:
                continue
            lead = part if lead is None else lead
            counts[part] = counts.get(part, 0) + 1
        lead_before.append(counts.get(lead, 0) if lead is not None else 0)
        micro = max(counts.values(), default=0)
        losses = draft.losses
        if not micro:
            if "forward" in self.off and self._chunked:  # unknown now: as the last seen
                return math.nan, self._micro
            return self.loss(draft), draft.backward_calls
        self._micro, self._chunked = micro, len(losses) > micro
        if len(losses) > micro:
            last: dict[int, torch.Tensor] = {}
            for value, at in zip(losses, draft.loss_at, strict=True):
                last[lead_before[at]] = value  # later ones of a micro-batch replace it
            losses = list(last.values())
        loss = sum(float(v) for v in losses) if losses else math.nan
        return loss, micro

    # --- forward (only while recording) -------------------------------------------------
    def on_forward_pre(self, module, inputs) -> None:
        """A forward the script runs (never one inside backward, a dispatch mode or
        compilation: script_observe sees to it)."""
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self._last_sync = bool(module.require_backward_grad_sync and torch.is_grad_enabled())
        if self._depth == 0:
            self._forward_t0 = time.perf_counter()
            # training inputs, not an evaluation's, nor a pipeline stage's shape inference
            if torch.is_grad_enabled() and _schedule_frame(*SHAPE_INFERENCE) is None:
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
        index = micro = bad[0] if len(d.forwards) == len(d.losses) else len(d.forwards) - 1
        if self.part_of is not None:  # the model's last forward before that loss (its
            # first part's: a loss module or a chunked loss's head runs outermost too)
            parts = [self.part_of(f[0]) for f in d.forwards[: d.loss_at[bad[0]]]]
            lead = next((p for p in parts if p is not None), None)
            ran = [i for i, p in enumerate(parts) if p is not None and p == lead]
            if ran:
                index, micro = ran[-1], len(ran) - 1
        module, args, kwargs, rng = d.forwards[index]
        inner = nonfinite.unwrapped(module)
        device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        d.nonfinite = nonfinite.rerun(
            inner, lambda m: m(*args, **(kwargs or {})), rng, device, micro, "output"
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


SCHEDULES = "torch.distributed.pipelining.schedules"
# a pipeline stage's first forward, on placeholder inputs, to learn its outputs' shapes
# (torch < 2.10 named it _shape_inference): not a micro-batch
SHAPE_INFERENCE = ("_shape_inference", "_forward_metadata_inference")


def loss_divisor() -> int:
    """Inside a pipeline schedule's step (torch.distributed.pipelining): its micro-batches
    when it scales the gradients by them (``scale_grads``, its default), else 1. Such a
    schedule calls backward() on each micro-batch's loss and then divides the gradients,
    which makes the step's loss their mean (torch's docs: scale_grads=True matches a loss
    function that averages)."""
    schedule = _schedule_frame("step", "_step_microbatches")
    if schedule is None or not getattr(schedule, "scale_grads", False):
        return 1
    return int(schedule._n_microbatches)


def _schedule_frame(*names: str):
    """The ``self`` of the innermost frame named one of ``names`` that is a pipeline
    schedule's or stage's (torch.distributed.pipelining), else None. Read off the stack
    rather than by wrapping them: a schedule may have begun its step before dtlab could
    wrap it, and importing the module first costs ~1 s. Nothing is looked at unless the
    script imported it."""
    if SCHEDULES not in sys.modules:
        return None
    from torch.distributed.pipelining import schedules, stage

    kinds = (schedules._PipelineSchedule, stage._PipelineStageBase)
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            break
        if frame.f_code.co_name in names:
            owner = frame.f_locals.get("self")
            if isinstance(owner, kinds):
                return owner
        frame = frame.f_back
    return None


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

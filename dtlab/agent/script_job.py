"""The job a script runs (``ScriptJob``), how the script's run ends (``Outcome``,
``ScriptEnded``, ``ScriptFailed``), and how its model, scheduler and scaler are found.

:mod:`dtlab.agent.script` runs the script (``ScriptRun``); at the first optimizer step it
makes a ``ScriptJob`` from what the script made by then:

- the optimizers that update the parameters: the one stepped, or, when it is a container
  or a wrapper (an ``Optimizer`` holding others, as torchtitan's OptimizersContainer and
  accelerate's AcceleratedOptimizer do), the ones inside it, which carry the LR;
- the model: the modules owning those optimizers' parameters (seen through DDP / FSDP /
  compile wrappers), among the modules that ran forward and the objects the script's
  frames reach (inside lists, tuples and dicts: a trainer's ``model_parts``); a model
  held in parts that no one module owns is one ``ModelParts`` for dtlab;
- the scheduler of those optimizers and a GradScaler, found the same way.

The stepping channel steps it like any job; a step runs the script to its next boundary.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
import types
import weakref
from dataclasses import dataclass, replace

import torch

from dtlab.agent import deepspeed_observe, recorder, rng, script_observe
from dtlab.agent import job as jobs
from dtlab.agent.jobs_base import JobCore
from dtlab.agent.update_size import UpdateSample
from dtlab.records import StepMemory, StepRecord


class ScriptEnded(jobs.JobEnded):
    """The script is over (finished, exited or failed); nothing more to step."""


class ScriptFailed(RuntimeError):
    """The script raised; carries its own exception name and traceback."""

    def __init__(self, outcome: Outcome, step: int):
        self.ename = outcome.ename
        self.script_traceback = outcome.traceback
        where = f"{os.path.basename(outcome.file)}:{outcome.line}" if outcome.line else ""
        super().__init__(
            f"{outcome.evalue} (in the script at step {step}" + (f", {where})" if where else ")")
        )


@dataclass(frozen=True)
class Outcome:
    """How the script ended: "finished", "exited" (sys.exit) or "failed" (an exception)."""

    kind: str
    code: int | None = None
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    file: str = ""
    line: int | None = None


SCRIPT_CHECKPOINTS = (
    "checkpoints of a script job are not supported yet: dtlab cannot restore where the "
    "script's own loop and data are (its iterator, its step counter), so a resume would "
    "be silently wrong. %dt_restart and %dt_resume_check run the script again to the "
    "step it was at instead (and check it got there); use the script's own "
    "checkpointing otherwise. dt.checkpoint() and replays work on attached jobs"
)


class ScriptJob(JobCore):
    """The job a script runs, as the stepping channel and the doctor see it: found at the
    first optimizer step (the model that owns the optimizer's parameters, seen through
    DDP / FSDP / compile wrappers), stepped by running the script to its next boundary
    (``step``), recorded there (``finish_step``, called by the script's run). ``run`` is
    the :class:`dtlab.agent.script.ScriptRun` it belongs to."""

    def __init__(self, run, optimizer):
        self.run = run  # (read by JobCore.__init__'s describing, as the engine below)
        engine = optimizer if deepspeed_observe.is_engine(optimizer) else None
        self.engine = engine
        # the optimizers that update the parameters (a container's inner ones), for the LR
        # and the optimizer state; the observer tells, at each step, which ones stepped
        self.updaters: list = []
        if engine is not None:  # the engine wraps the model; its optimizer holds partitions
            model, optimizer = engine, deepspeed_observe.inner_optimizer(engine)
            scheduler, scaler = engine.lr_scheduler, None
        else:
            self.updaters = inner_optimizers(optimizer) if optimizer is not None else []
            stepped = [o for o in (optimizer, *self.updaters) if o is not None]
            objects = _frames_objects(run)
            model = _find_model(run, stepped, objects)
            scheduler = _find_scheduler(objects, stepped)
            scaler = next((o for o in objects if isinstance(o, torch.amp.GradScaler)), None)
        super().__init__(
            model,
            optimizer or _ParamsOnly.no_optimizer(model),
            scheduler=scheduler,
            scaler=scaler,
            record=run.record,
        )
        draft = run.observer.draft  # the first step's, so far: backward() on no loss means
        # a rank that has none (a pipeline stage before the last)
        lossless = draft.backward_calls > 0 and not draft.losses
        self.info = replace(self.info, computes_loss=not lossless)
        if self.updaters:
            inner = [type(o).__name__ for o in self.updaters]
            named = ", ".join(f"{n} x{inner.count(n)}" for n in dict.fromkeys(inner))
            self.info = replace(self.info, optimizer=f"{type(optimizer).__name__} ({named})")
        # which model part a module's forward runs (its wrappers' too): micro-batches
        parts = model.parts if isinstance(model, ModelParts) else [model]
        self._parts: dict[int, int] = {}
        for i, part in enumerate(parts):
            for m in (part, getattr(part, "module", None), getattr(part, "_orig_mod", None)):
                if isinstance(m, torch.nn.Module):
                    self._parts.setdefault(id(m), i)
        run.observer.part_of = self.part_of
        if self.updaters:  # the container's own param groups may hold nothing
            self.update_sample = UpdateSample.of_optimizers(self.updaters)
        run.observer.before_update = self.update_sample.before
        if engine is not None:
            self.info = replace(
                self.info,
                optimizer=deepspeed_observe.label(engine),
                scaler=engine.fp16_enabled(),
                deepspeed=deepspeed_observe.describe(engine),
            )
        self.checkpoint_problem = SCRIPT_CHECKPOINTS
        self.output: list[str] = []
        self._epoch = 0  # the data pass the last step ended in
        self.initial = self._initial_state()
        self._rngs = rng.fingerprints() if run.record else ()

    def info_now(self):
        """Also the observations switched off since the script began."""
        off = tuple((name, step) for name, step, _ in self.run.observer.switched_off)
        return replace(self.info, unobserved=off) if off else self.info

    def _param_infos(self):
        if self.engine is None:
            return super()._param_infos()
        return deepspeed_observe.param_infos(self.names, self.params)  # ZeRO-3: ds_shape

    def _param_prints(self) -> tuple[int, ...]:
        """Under ZeRO-3 the parameters are gathered whole to be read (every rank, same
        point of the step)."""
        if self.engine is None:
            return super()._param_prints()
        with deepspeed_observe.gathered(self.engine, self.params):
            return super()._param_prints()

    def _data_kind(self) -> str:
        """The DataLoaders the script iterated so far, else that it used none."""
        kinds = sorted(set(self.run.observer.data_kinds.values()))
        return " + ".join(kinds) if kinds else "no DataLoader: the script's own code"

    def release(self) -> None:
        """Another job is attached in its place: nothing can step the script any more,
        so it ends here, as ``dt.scripts.stop()`` ends it (``ScriptRun.detached``)."""
        super().release()
        self.run.detached()

    def step(self, record: bool | None = None) -> StepRecord:
        """Run the script to its next optimizer step (where ``finish_step`` records it)."""
        record = self._begin_step(record)
        script_observe.set_recording(record)
        self.run.capture = self.output  # no ipyparallel request carries it: the reply does
        try:
            return self.run.resume()
        except ScriptEnded:
            o = self.run.outcome
            if o is not None and o.kind == "failed":
                raise ScriptFailed(o, self.step_count) from None
            raise
        finally:
            self.run.capture = None

    def take_output(self) -> str:
        """What the script printed since the last call (stdout and stderr, in order)."""
        text, self.output[:] = "".join(self.output), []
        return text

    def _grad_fields(self, early: dict | None = None) -> dict:
        """The gradients the step used: each as it is now, or, for a parameter whose
        optimizer stepped inside backward() and dropped it, as it was then (FSDP1: the
        model's own parameters, gathered whole)."""
        if self.flat is not None:
            return recorder.grad_fields(*self.flat.grad_summary())
        norms, bad, missing, prints = recorder.grad_summary([p.grad for p in self.params])
        early = early or {}
        for i in [i for i in missing if id(self.params[i]) in early]:
            norms[i], bad[i], prints[i] = early[id(self.params[i])]
            missing.remove(i)
        return recorder.grad_fields(norms, bad, missing, prints)

    def part_of(self, module) -> int | None:
        """The model part ``module`` runs (0 for a model in one piece), else None."""
        for m in (module, getattr(module, "_orig_mod", None), getattr(module, "module", None)):
            part = self._parts.get(id(m)) if m is not None else None
            if part is not None:
                return part
        return None

    def _lr(self, draft) -> float | None:
        """The LR the update used: DeepSpeed's, read before it, else that of the first
        optimizer that updated parameters (inside a container: its own param groups may
        carry none, or a stale one)."""
        lr = draft.lr
        updaters = self.run.observer.updaters or self.updaters or [self.optimizer]
        for optimizer in updaters if lr is None else ():
            if optimizer.param_groups and "lr" in optimizer.param_groups[0]:
                lr = optimizer.param_groups[0]["lr"]
                break
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:  # a tensor LR (capturable)
            lr = float(lr)
        return float(lr) if isinstance(lr, (int, float)) else None

    def _memory(self):
        if self.engine:
            return deepspeed_observe.step_memory(self.engine, self.device, self._buffer_bytes())
        held = self.updaters or self.optimizer
        return recorder.memory(self.params, held, self.device, self._buffer_bytes())

    def finish_step(self, skipped: bool) -> StepRecord:
        """Inside the script, at its step boundary: what this step did, kept and returned.
        Each measurement is one of the observer's observations: one that fails is left out
        from then on (noted), and the step is still recorded."""
        observer = self.run.observer
        draft = observer.take_draft()
        record = observer.recording
        t0 = time.perf_counter()
        lr = self._lr(draft)
        grads = (
            observer.observe("gradients", self._grad_fields, draft.early_grads) if record else {}
        )
        unreached = self.reached.stop()  # watched from the last boundary (not step 1's)
        self.step_count += 1
        params = observer.observe("parameters", self._param_fields) if record else {}
        update_rms = observer.observe("update size", self.update_sample.after) if record else None
        memory = observer.observe("memory", self._memory) or StepMemory(
            recorder.rss_bytes(), 0, 0, 0
        )
        loss, micro = observer.step_loss(draft, self.part_of)
        epoch = draft.passes[0][1] if draft.passes else self._epoch
        self._epoch = draft.passes[-1][1] if draft.passes else epoch
        first_bad = self.watcher.first_bad
        rec = self._keep(
            loss=loss,
            lr=lr,
            scale=getattr(observer, "last_scale", None),
            skipped=skipped,
            times=(
                draft.data_s,
                draft.forward_s,
                draft.backward_s,
                observer.optimizer_s,
                time.perf_counter() - t0,
            ),
            memory=memory,
            indices=tuple(draft.indices),
            epoch=epoch,
            epoch_starts=tuple(pos for pos, _ in draft.passes[1:]),
            nonfinite=(
                first_bad or draft.nonfinite[0],
                "watched during the step" if first_bad else draft.nonfinite[1],
            ),
            micro_batches=micro,
            update_rms=math.nan if update_rms is None else update_rms,
            synced_micro_batches=draft.synced_calls if draft.ddp_seen else None,
            input_fingerprints=tuple(draft.input_prints),
            unreached=unreached,
            grads=grads,
            params=params,
        )
        if observer.recording:
            self.reached.start()  # the next step's backward
        return rec


# --- finding what the script made ----------------------------------------------------------

_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
_SKIPPED = (type, types.ModuleType, types.FunctionType, *_PROXIES)
MAX_ITEMS = 200  # of one list, dict or object's attributes looked into


def _frames_objects(run) -> list:
    """Objects the script can reach from where it is now: the locals of every frame of
    the script's greenlet and the script's globals, one attribute level below them (a
    Trainer's ``self.model``), and inside the lists, tuples and dicts met on the way (a
    trainer's ``self.model_parts``). Never a dead weak proxy (touching one raises)."""
    seen: dict[int, object] = {}

    def add(value, depth: int) -> None:
        kind = type(value)  # type() never dereferences a proxy; isinstance may
        if id(value) in seen or issubclass(kind, _SKIPPED):
            return
        seen[id(value)] = value
        if issubclass(kind, (list, tuple)):
            for inner in value[:MAX_ITEMS]:
                add(inner, depth)
        elif issubclass(kind, dict):
            for inner in list(value.values())[:MAX_ITEMS]:
                add(inner, depth)
        elif depth and not issubclass(kind, torch.nn.Module):
            try:
                attributes = list(vars(value).values())[:MAX_ITEMS]
            except TypeError:  # no __dict__
                return
            for inner in attributes:
                add(inner, depth - 1)

    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            add(value, 1)
        frame = frame.f_back
    for value in list(run.module.__dict__.values()):
        add(value, 1)
    return list(seen.values())


def inner_optimizers(optimizer, _seen: set[int] | None = None) -> list:
    """The optimizers an optimizer holds and steps, innermost (a container's list of them,
    a wrapper's one, a ZeroRedundancyOptimizer's local one); [] for a plain optimizer."""
    seen = _seen if _seen is not None else {id(optimizer)}
    found: list = []
    for name, value in vars(optimizer).items():
        if name in ("state", "param_groups", "defaults"):
            continue
        kind = type(value)  # never isinstance: a dead weak proxy raises
        if issubclass(kind, dict):
            values = list(value.values())
        else:
            values = list(value) if issubclass(kind, (list, tuple)) else [value]
        for v in values[:MAX_ITEMS]:
            if not issubclass(type(v), torch.optim.Optimizer) or id(v) in seen:
                continue
            seen.add(id(v))
            for o in inner_optimizers(v, seen) or [v]:
                if o not in found:
                    found.append(o)
    return found


class ModelParts(torch.nn.Module):
    """A model the script holds in parts (a trainer's ``model_parts``, a pipeline's
    stages on one rank), none of which owns all the trained parameters: one module for
    dtlab, its parts named ``part0``, ``part1``... (the script's modules are not
    changed: this only refers to them)."""

    def __init__(self, parts):
        super().__init__()
        self.parts = list(parts)
        for i, part in enumerate(self.parts):
            self.add_module(f"part{i}", part)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "_orig_mod", module)  # torch.compile's wrapper


def _modules_in(objects) -> list[torch.nn.Module]:
    return [o for o in objects if issubclass(type(o), torch.nn.Module)]


def _find_model(run, optimizers, objects) -> torch.nn.Module:
    """The modules owning the optimizers' parameters, the fewest that cover them (one,
    unless the model is held in parts), each the outermost such (DDP around the model),
    so that the job sees the wrapper and names the inner model's. Looked for among the
    modules that ran forward and those the script's frames reach, else, once, among every
    module the garbage collector knows. Parts come in the order the optimizers list their
    parameters (ties never depend on where the modules were found)."""
    order: dict[int, int] = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                order.setdefault(id(p), len(order))
    wanted = set(order)
    ran = [m for m, *_ in run.observer.draft.forwards]
    found = list({id(m): m for m in [*ran, *_modules_in(objects)]}.values())
    owned = {id(m): {id(p) for p in m.parameters()} for m in found}
    if wanted and not any(owned[id(m)] & wanted for m in found):
        found = _modules_in(gc.get_objects())  # slow, once; type() is safe on anything
        owned = {id(m): {id(p) for p in m.parameters()} for m in found}
    if not wanted:  # no optimizer: the module with the most parameters
        best = max(found, key=lambda m: len(owned[id(m)]), default=None)
        return _outermost(best, found) if best is not None else _ParamsOnly(optimizers[0])

    def first(m) -> int:  # where the optimizers list its first parameter
        return min((order[p] for p in owned[id(m)] if p in order), default=len(order))

    chosen, left = [], set(wanted)
    while left:
        best = max(
            found,
            key=lambda m: (len(owned[id(m)] & left), len(owned[id(m)]), -first(m)),
            default=None,
        )
        if best is None or not owned[id(best)] & left:
            break
        chosen.append(best)
        left -= owned[id(best)]
    if not chosen:
        return _ParamsOnly(optimizers[0])
    parts = [_outermost(m, found) for m in sorted(chosen, key=first)]
    return parts[0] if len(parts) == 1 else ModelParts(parts)


def _outermost(best: torch.nn.Module, found) -> torch.nn.Module:
    """A wrapper holding exactly ``best`` (DDP's .module), else ``best`` itself, seen
    through torch.compile's wrapper."""
    for m in found:
        if getattr(m, "module", None) is best:
            return m
    return _unwrap(best)


def _find_scheduler(objects, optimizers):
    from torch.optim.lr_scheduler import LRScheduler

    for o in objects:
        if isinstance(o, LRScheduler) and any(o.optimizer is x for x in optimizers):
            return o
    return None


class _ParamsOnly(torch.nn.Module):
    """The optimizer's parameters under names of their place in it, when no module of
    the script owns them."""

    def __init__(self, optimizer):
        super().__init__()
        for g, group in enumerate(optimizer.param_groups if optimizer is not None else ()):
            for i, p in enumerate(group["params"]):
                self.register_parameter(f"group{g}_param{i}", p)

    @staticmethod
    def no_optimizer(model):
        return torch.optim.SGD(model.parameters(), lr=0.0)

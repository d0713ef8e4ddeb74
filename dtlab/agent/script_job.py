"""The job a script runs (``ScriptJob``), how the script's run ends (``Outcome``,
``ScriptEnded``, ``ScriptFailed``), and how its model, scheduler and scaler are found.

:mod:`dtlab.agent.script` runs the script (``ScriptRun``); at the first optimizer step it
makes a ``ScriptJob`` from what the script made by then: the module owning the
optimizer's parameters (seen through DDP / FSDP / compile wrappers), the scheduler of that
optimizer and a GradScaler, found among the objects the script's frames can reach. The
stepping channel steps it like any job; a step runs the script to its next boundary.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import types
from dataclasses import dataclass, replace

import torch

from dtlab.agent import deepspeed_observe, recorder, rng, script_observe
from dtlab.agent import job as jobs
from dtlab.records import StepRecord, StepTimes


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


class ScriptJob(jobs.Job):
    """The job a script runs, as the stepping channel and the doctor see it: found at the
    first optimizer step (the model that owns the optimizer's parameters, seen through
    DDP / FSDP / compile wrappers), stepped by running the script to its next boundary.
    ``run`` is the :class:`dtlab.agent.script.ScriptRun` it belongs to."""

    def __init__(self, run, optimizer):
        engine = optimizer if deepspeed_observe.is_engine(optimizer) else None
        self.engine = engine  # (read by the parameter hooks below, from Job.__init__ on)
        if engine is not None:  # the engine wraps the model; its optimizer holds partitions
            model, optimizer = engine, deepspeed_observe.inner_optimizer(engine)
            scheduler, scaler = engine.lr_scheduler, None
        else:
            model = _find_model(run, optimizer)
            scheduler = _find_scheduler(run, optimizer)
            scaler = _find_instance(run, torch.amp.GradScaler)
        super().__init__(
            model,
            optimizer or _ParamsOnly.no_optimizer(model),
            (),
            lambda m, b: None,
            scheduler=scheduler,
            scaler=scaler,
            record=run.record,
        )
        self.run = run
        self.info = replace(self.info, data=self._data_kind())
        if engine is not None:
            self.info = replace(
                self.info,
                optimizer=deepspeed_observe.label(engine),
                scaler=engine.fp16_enabled(),
                deepspeed=deepspeed_observe.describe(engine),
            )
        self.checkpoint_problem = SCRIPT_CHECKPOINTS
        self.output: list[str] = []
        self.initial = self._initial_state()
        self._rngs = rng.fingerprints() if run.record else ()

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
        run = getattr(self, "run", None)
        kinds = sorted(set(run.observer.data_kinds.values())) if run is not None else []
        return " + ".join(kinds) if kinds else "no DataLoader: the script's own code"

    def step(self, record: bool | None = None) -> StepRecord:
        record = self.record if record is None else record
        self.watcher.reset()
        self.outputs.reset()
        self._recording, self._buffer_prints = record, ()
        self._rngs = rng.fingerprints() if record else ()  # as the step begins
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

    def finish_step(self, skipped: bool) -> StepRecord:
        """Inside the script, at its step boundary: what this step did, kept and returned."""
        observer = self.run.observer
        draft = observer.take_draft()
        record = observer.recording
        t0 = time.perf_counter()
        lr = draft.lr
        if lr is None and self.optimizer.param_groups:
            lr = self.optimizer.param_groups[0].get("lr")
        grads = self._grad_fields(draft.early_grads) if record else {}
        unreached = self.reached.stop()  # watched from the last boundary (not step 1's)
        self.step_count += 1
        params = self._param_fields() if record else {}
        epoch = draft.passes[0][1] if draft.passes else getattr(self, "_epoch", 0)
        self._epoch = draft.passes[-1][1] if draft.passes else epoch
        rec = StepRecord(
            step=self.step_count,
            time=time.time(),
            loss=observer.loss(draft),
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            scale=getattr(observer, "last_scale", None),
            skipped=skipped,
            times=StepTimes(
                draft.data_s,
                draft.forward_s,
                draft.backward_s,
                observer.optimizer_s,
                time.perf_counter() - t0,
            ),
            memory=(
                deepspeed_observe.step_memory(self.engine, self.device, self._buffer_bytes())
                if self.engine
                else recorder.memory(self.params, self.optimizer, self.device, self._buffer_bytes())
            ),
            indices=tuple(draft.indices),
            epoch=epoch,
            epoch_starts=tuple(pos for pos, _ in draft.passes[1:]),
            nonfinite_module=self.watcher.first_bad or draft.nonfinite[0],
            nonfinite_found=(
                "watched during the step" if self.watcher.first_bad else draft.nonfinite[1]
            ),
            micro_batches=draft.backward_calls,
            synced_micro_batches=draft.synced_calls if draft.ddp_seen else None,
            input_fingerprints=tuple(draft.input_prints),
            unreached=unreached,
            rng=self._rngs,
            module_outputs=tuple(self.outputs.prints) if self.recording_outputs else (),
            **grads,
            **params,
        )
        self.records.append(rec)
        if observer.recording:
            self.reached.start()  # the next step's backward
        return rec


# --- finding what the script made ----------------------------------------------------------


def _frames_objects(run):
    """Objects the script can reach from where it is now: the locals of every frame of
    the script's greenlet, the script's globals, and one attribute level below them (a
    Trainer's ``self.model``)."""
    seen: dict[int, object] = {}

    def add(value, depth: int) -> None:
        if id(value) in seen or isinstance(value, (type, types.ModuleType, types.FunctionType)):
            return
        seen[id(value)] = value
        if depth and not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
            for inner in list(vars(value).values())[:200]:
                add(inner, depth - 1)

    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            add(value, 1)
        frame = frame.f_back
    for value in list(run.module.__dict__.values()):
        add(value, 1)
    return list(seen.values())


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "_orig_mod", module)  # torch.compile's wrapper


def _find_model(run, optimizer) -> torch.nn.Module:
    """The module owning most of the optimizer's parameters; the outermost such (DDP
    around the model), so that the job sees the wrapper and names the inner model's."""
    wanted = {id(p) for g in (optimizer.param_groups if optimizer else []) for p in g["params"]}
    found = [o for o in _frames_objects(run) if isinstance(o, torch.nn.Module)]
    if wanted and not any(id(p) in wanted for m in found for p in m.parameters()):
        found = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]  # slow, once

    def score(m):
        params = list(m.parameters())
        return (sum(id(p) in wanted for p in params) if wanted else len(params), len(params))

    best = max(found, key=score, default=None)
    if best is None or (wanted and score(best)[0] == 0):
        return _ParamsOnly(optimizer)
    for m in found:  # a wrapper holding exactly it (DDP's .module, compile's _orig_mod)
        if getattr(m, "module", None) is best or getattr(m, "_orig_mod", None) is best:
            return _unwrap(m) if getattr(m, "_orig_mod", None) is best else m
    return _unwrap(best)


def _find_scheduler(run, optimizer):
    from torch.optim.lr_scheduler import LRScheduler

    for o in _frames_objects(run):
        if isinstance(o, LRScheduler) and getattr(o, "optimizer", None) is optimizer:
            return o
    return None


def _find_instance(run, cls):
    return next((o for o in _frames_objects(run) if isinstance(o, cls)), None)


class _ParamsOnly(torch.nn.Module):
    """The optimizer's parameters under names of their place in it, when no module of
    the script owns them."""

    def __init__(self, optimizer):
        super().__init__()
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                self.register_parameter(f"group{g}_param{i}", p)

    @staticmethod
    def no_optimizer(model):
        return torch.optim.SGD(model.parameters(), lr=0.0)

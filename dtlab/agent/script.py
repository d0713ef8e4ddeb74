"""A user's own training script, unchanged, run on this rank and paused at its steps.

``%dt_script train.py --lr 3e-4`` calls ``start`` on every rank at once. The script runs
as ``__main__`` with ``sys.argv = [path, *args]``, its folder first on ``sys.path``, the
working directory asked for, and the torchrun environment the rank already has (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...). ``script_env`` makes its
``init_process_group`` return dtlab's group; ``script_observe`` sees its steps.

Where it runs, chosen knowingly: in a greenlet on the engine's **main thread**.
``signal.signal`` works only on the main thread (torchelastic, Lightning and many trainers
call it), so a script thread would break them; yet the engine must serve the notebook
(``%%dt`` cells, pulls, stepping commands) while the script is paused, which a main
thread stuck inside the script could not. A greenlet gives both: at a step boundary the
script's greenlet switches back to the engine's, which returns to its event loop and
serves requests as usual; the next step switches into the script again. Whatever is
process-wide and the script may change (``sys.argv``, the working directory,
``sys.modules["__main__"]``, torch's grad mode, the signal handlers it set) is swapped in
and out with it. A pause is always at an optimizer step boundary, where no collective of
the script is pending, so nothing of it can time out while paused.

Stages on each rank:
1. ``start``: read and compile the script (a clear error if it is missing or not Python),
   bind its module as ``script`` in the rank's namespace, run it until the first
   optimizer step is about to update the parameters (step 0: set-up done, the first
   gradients computed) or until it ends;
2. ``ScriptJob.step`` (the stepping channel's ``job.step``): run to the next boundary and
   return its StepRecord; ScriptEnded when the script is over;
3. at its end: the hooks and patches come off, DataLoader workers are shut down, the
   modules it imported from its own folder are forgotten (an edit takes effect next run).
"""

from __future__ import annotations

import builtins
import gc
import io
import os
import signal
import sys
import time
import traceback
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from dtlab.agent import job as jobs
from dtlab.agent import recorder, rng, script_env, script_observe
from dtlab.agent.state import RANK
from dtlab.records import StepRecord, StepTimes

_real_signal = signal.signal


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


def start(path: str, argv: list[str], cwd: str | None, record: bool = True) -> dict:
    """Rank side of ``%dt_script``: run the script to its first step boundary or its end;
    returns ``status()``. A script still paused from before is stopped first."""
    if RANK.script_run is not None:
        stop()
    run = ScriptRun(path, list(argv), cwd, record)
    RANK.script_run = run
    run.engine_ns["script"] = run.module
    run.engine_ns["script_locals"] = run.module.__dict__
    try:
        run.resume()
    except ScriptEnded:
        pass
    return run.status()


def stop() -> dict | None:
    """End a paused script now (its ``finally`` blocks run); its status, or None."""
    run, RANK.script_run = RANK.script_run, None
    if run is None:
        return None
    run.kill()
    return run.status()


def status() -> dict | None:
    run = RANK.script_run
    return run.status() if run is not None else None


def step_boundary() -> None:
    """The script marks a step boundary itself (``dtlab.step_boundary()``)."""
    run, observer = RANK.script_run, RANK.observer
    if run is not None and not run.over and observer is not None:
        observer.explicit_boundary()


class ScriptRun:
    """One run of one script on this rank."""

    def __init__(self, path: str, argv: list[str], cwd: str | None, record: bool):
        import greenlet

        self.cwd = os.path.abspath(cwd or os.getcwd())
        if not os.path.isdir(self.cwd):
            raise FileNotFoundError(f"--cwd {cwd!r} is not a folder on this rank")
        self.path = os.path.abspath(os.path.join(self.cwd, path))
        self.code = _compile(self.path)
        self.argv = [path, *argv]
        self.record = record
        self.module = types.ModuleType("__main__")
        self.module.__dict__.update(
            __file__=self.path, __builtins__=builtins, __cached__=None, __spec__=None
        )
        self.notes: list[str] = []
        self.outcome: Outcome | None = None
        self.job: ScriptJob | None = None
        self.grad_enabled = True
        self.handlers: dict[int, object] = {}  # signals the script handles, while it runs
        self._slice_saved: dict[int, object] | None = None
        self.streams: tuple | None = None
        self.capture: list[str] | None = None  # while stepped: what it prints goes here
        self.started_at = time.time()
        self.setup_s: float | None = None
        self.folder = os.path.dirname(self.path)
        # the rank's interactive namespace (%%dt cells): the engine's __main__ module
        self.engine_ns = getattr(sys.modules.get("__main__"), "__dict__", {})
        self._modules_before = set(sys.modules)
        self.observer = script_observe.Observer(self._on_boundary, note=self.notes.append)
        self.observer.recording = record
        self.glet = greenlet.greenlet(self._main)
        sys.path.insert(0, self.folder)
        script_env.install(self.notes, self.folder + os.sep)
        script_observe.install(self.observer)
        signal.signal = self._signal

    # --- running -----------------------------------------------------------------------
    @property
    def over(self) -> bool:
        return self.outcome is not None

    def resume(self):
        """Run the script to its next boundary (-> the StepRecord, or None at step 0) or
        its end (-> ScriptEnded)."""
        if self.over:
            raise ScriptEnded(self.describe_end())
        with self._inside():
            event = self.glet.switch()
        if self.glet.dead:
            self.outcome = event
            self._finish()
            raise ScriptEnded(self.describe_end())
        return event

    def kill(self) -> None:
        if not self.glet.dead and self.glet:
            import greenlet

            with self._inside():
                try:
                    self.glet.throw(greenlet.GreenletExit)
                except BaseException:
                    pass
        if self.outcome is None:
            self.outcome = Outcome("exited", None, evalue="stopped by dtlab")
            self._finish()

    def _main(self) -> Outcome:
        try:
            exec(self.code, self.module.__dict__)
        except SystemExit as e:
            code = e.code
            if code is None or isinstance(code, int):
                return Outcome("exited", code or 0)
            return Outcome("exited", 1, evalue=str(code))
        except BaseException as e:  # noqa: BLE001 - the script's failure is its outcome
            import greenlet

            if isinstance(e, greenlet.GreenletExit):
                return Outcome("exited", None, evalue="stopped by dtlab")
            file, line = _script_line(e, self.path)
            return Outcome(
                "failed", None, type(e).__name__, str(e), _script_traceback(e), file, line
            )
        return Outcome("finished", 0)

    def _pause(self, event):
        self.engine_ns["script_locals"] = self._locals_here()
        return self.glet.parent.switch(event)

    def _locals_here(self) -> dict:
        """The locals of the script's frame that made this optimizer step (its training
        loop, inside ``main()`` for most scripts): read, and mutate objects, from ``%%dt``."""
        frame = sys._getframe()
        while frame is not None and os.path.abspath(frame.f_code.co_filename) != self.path:
            frame = frame.f_back
        return frame.f_locals if frame is not None else self.module.__dict__

    def _on_boundary(self, kind: str, optimizer) -> None:
        """Called inside the script's greenlet, from the optimizer hooks."""
        if kind == "pre":
            self.setup_s = time.time() - self.started_at
            self.job = ScriptJob(self, optimizer)
            jobs.install(self.job)
            self._pause(None)
            return
        rec = self.job.finish_step(kind == "skipped")
        self._pause(rec)

    @contextmanager
    def _inside(self):
        """Process-wide state as the script had it, while it runs."""
        engine = (
            sys.argv,
            os.getcwd(),
            sys.modules.get("__main__"),
            torch.is_grad_enabled(),
            sys.stdout,
            sys.stderr,
        )
        sys.argv, sys.modules["__main__"] = self.argv, self.module
        if self.streams is not None:  # the script replaced them (a logger's tee, say)
            sys.stdout, sys.stderr = self.streams
        elif self.capture is not None:
            sys.stdout = sys.stderr = _Capture(self.capture)
        os.chdir(self.cwd)
        torch.set_grad_enabled(self.grad_enabled)
        self._slice_saved = {sig: _real_signal(sig, h) for sig, h in self.handlers.items()}
        try:
            yield
        finally:
            self.argv, self.cwd, self.grad_enabled = sys.argv, os.getcwd(), torch.is_grad_enabled()
            if not isinstance(sys.stdout, _Capture) and (sys.stdout, sys.stderr) != engine[4:]:
                self.streams = (sys.stdout, sys.stderr)
            for sig, handler in self._slice_saved.items():
                _real_signal(sig, handler)
            self._slice_saved = None
            sys.argv, cwd, main, grad, sys.stdout, sys.stderr = engine
            if main is not None:
                sys.modules["__main__"] = main
            os.chdir(cwd)
            torch.set_grad_enabled(grad)

    def _signal(self, signum, handler):
        """``signal.signal`` as the script sees it: its handlers are in force while it
        runs and the engine's while it is paused."""
        import greenlet

        if self._slice_saved is None or greenlet.getcurrent() is not self.glet:
            return _real_signal(signum, handler)
        old = _real_signal(signum, handler)
        self._slice_saved.setdefault(signum, old)
        previous = self.handlers.get(signum, old)
        self.handlers[signum] = handler
        return previous

    def _finish(self) -> None:
        with self._inside():  # as at its process's end: its cwd, argv, __main__
            self.notes.extend(script_env.run_exit_handlers())
        script_observe.uninstall()
        script_env.uninstall()
        if self.job is not None:
            self.job.reached.close()  # no hook of dtlab's stays on the script's parameters
        if signal.signal == self._signal:
            signal.signal = _real_signal
        for it in list(self.observer.iterators):
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if self.folder in sys.path:
            sys.path.remove(self.folder)
        for name in set(sys.modules) - self._modules_before:
            file = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.abspath(file).startswith(self.folder + os.sep):
                del sys.modules[name]  # an edit of the script's own modules counts next run

    # --- what it says ------------------------------------------------------------------
    def describe_end(self) -> str:
        o = self.outcome
        step = self.job.step_count if self.job is not None else 0
        if o is None:
            return f"the script is paused at step {step}"
        if o.kind == "failed":
            return f"the script failed at step {step}: {o.ename}: {o.evalue}"
        if o.kind == "exited":
            return f"the script exited with code {o.code} at step {step}" + (
                f" ({o.evalue})" if o.evalue else ""
            )
        return f"the script finished at step {step}"

    def status(self) -> dict:
        job = self.job
        return {
            "state": "ended" if self.over else "paused",
            "step": job.step_count if job is not None else 0,
            "outcome": asdict(self.outcome) if self.outcome is not None else None,
            "notes": list(self.notes),
            "setup_s": self.setup_s,
            "backward_calls": self.observer.draft.backward_calls,
            "optimizers": [type(o).__name__ for o in self.observer.optimizers],
            "model": job.info.model if job is not None else None,
            "wrapper": job.info.wrapper if job is not None else None,
            "path": self.path,
        }


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
    DDP / FSDP / compile wrappers), stepped by running the script to its next boundary."""

    def __init__(self, run: ScriptRun, optimizer):
        model = _find_model(run, optimizer)
        super().__init__(
            model,
            optimizer or _ParamsOnly.no_optimizer(model),
            (),
            lambda m, b: None,
            scheduler=_find_scheduler(run, optimizer),
            scaler=_find_instance(run, torch.amp.GradScaler),
            record=run.record,
        )
        self.run = run
        self.checkpoint_problem = SCRIPT_CHECKPOINTS
        self.output: list[str] = []
        self.initial = self._initial_state()
        self._rngs = rng.fingerprints() if run.record else ()

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
        optimizer stepped inside backward() and dropped it, as it was then."""
        norms, bad, missing, prints = recorder.grad_summary([p.grad for p in self.params])
        early = early or {}
        for i in [i for i in missing if id(self.params[i]) in early]:
            norms[i], bad[i], prints[i] = early[id(self.params[i])]
            missing.remove(i)
        return jobs.grad_fields(norms, bad, missing, prints)

    def finish_step(self, skipped: bool) -> StepRecord:
        """Inside the script, at its step boundary: what this step did, kept and returned."""
        observer = self.run.observer
        draft = observer.take_draft()
        record = observer.recording
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
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
            memory=recorder.memory(self.params, self.optimizer, self.device, self._buffer_bytes()),
            indices=tuple(draft.indices),
            epoch=epoch,
            epoch_starts=tuple(pos for pos, _ in draft.passes[1:]),
            nonfinite_module=self.watcher.first_bad,
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


class _Capture(io.TextIOBase):
    """A text stream that keeps what is written (the script's prints while stepped)."""

    def __init__(self, parts: list[str]):
        self.parts = parts

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def writable(self) -> bool:
        return True


# --- finding what the script made ----------------------------------------------------------


def _frames_objects(run: ScriptRun):
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


def _find_model(run: ScriptRun, optimizer) -> torch.nn.Module:
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


def _find_scheduler(run: ScriptRun, optimizer):
    from torch.optim.lr_scheduler import LRScheduler

    for o in _frames_objects(run):
        if isinstance(o, LRScheduler) and getattr(o, "optimizer", None) is optimizer:
            return o
    return None


def _find_instance(run: ScriptRun, cls):
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


# --- reading the script ---------------------------------------------------------------------


def _source(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        raise ValueError(f"{path} is not a Python script (it holds binary data)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a Python script (not UTF-8 text: {e})") from None


def _compile(path: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"no script {path} on this rank")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder, not a script")
    try:
        return compile(_source(path), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ValueError(f"{path} is not a Python script: {e.msg} at line {e.lineno}") from None


def _script_traceback(error: BaseException) -> str:
    """The traceback from the script's own first frame on (dtlab's runner left out)."""
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def _script_line(error: BaseException, path: str) -> tuple[str, int | None]:
    """The innermost frame of the traceback in the script itself (else any file)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if os.path.abspath(f.filename) == path]
    pick = (ours or frames[-1:] or [None])[-1]
    return (pick.filename, pick.lineno) if pick is not None else (path, None)

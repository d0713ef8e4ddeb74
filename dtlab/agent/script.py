"""A user's own training script, unchanged, run on this rank and paused at its steps.

``%dt_script train.py --lr 3e-4`` calls ``start`` on every rank at once. The script runs
as ``__main__`` with ``sys.argv = [path, *args]``, its folder first on ``sys.path``, the
working directory asked for, and the torchrun environment the rank already has (every
variable torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, TORCHELASTIC_RUN_ID...,
from ``rendezvous.torchrun_env``). ``script_env`` makes its
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

What it prints: for its whole run the script's ``sys.stdout`` and ``sys.stderr`` are two
stream objects of dtlab's own (``_Route``), so whatever holds them (a
``logging.StreamHandler(sys.stdout)`` made at set-up, ``print(file=sys.stderr)``, a
logger's tee that wrapped them) writes through them, at any later moment. Each write goes
where that moment's output belongs: during an ipyparallel request (set-up, the end run
by ``stop``) to the request's stdout, both streams there so that their order holds;
while stepped to the step's capture (``ScriptJob.output``, sent with the stepping
channel's reply); outside the script (a ``%%dt`` cell calling its logger, a thread of it
while paused, a handler it left after its end) to the engine's streams of that moment.
Writes to file descriptors 1 and 2 from C code are not routed: see ``_Route``.

Stages on each rank:
1. ``start``: read and compile the script (a clear error if it is missing or not Python),
   bind its module as ``script`` in the rank's namespace, run it until the first
   optimizer step is about to update the parameters (step 0: set-up done, the first
   gradients computed) or until it ends;
2. ``ScriptJob.step`` (the stepping channel's ``job.step``; :mod:`dtlab.agent.script_job`,
   with how the script's model is found): run to the next boundary and return its
   StepRecord; ScriptEnded when the script is over;
3. at its end (it finished, failed or exited; ``stop`` ended it; another job was
   attached in its place, ``detached``): the hooks and patches come off, DataLoader
   workers are shut down, the modules it imported from its own folder are forgotten (an
   edit takes effect next run), and process-wide state it may have changed is as it was
   before it (``_process_state``): the root logger (handlers, level: what
   ``logging.basicConfig`` sets; ``logging.disable``), the warning filters, the garbage
   collector (``gc.disable()``, thresholds), ``sys.path`` (the same list, entry for
   entry), torch's intra-op thread count and the environment variables (added ones
   removed, changed or removed ones as they were). Under torchrun all of it would die with
   the script's process; an engine lives on to the next job. While the script is paused
   it is the script's (a ``%%dt`` cell sees it, and what a cell changes of it then is put
   back at the end too).

``plain=True`` (``python -m dtlab.run``, :mod:`dtlab.agent.batch_run`): the process is the
script's own, as under plain torchrun, and nothing of the above that makes an engine's
world is done: its ``init_process_group`` makes the group, its output goes to the
process's own streams, ``signal.signal`` and ``atexit`` are Python's, its command line
is the one given, and at its end nothing is put back (the process ends with it). What
it raised or passed to ``sys.exit`` is kept (``exception``) for the process to end the
same way.
"""

from __future__ import annotations

import builtins
import gc
import io
import logging
import os
import signal
import sys
import time
import traceback
import types
import warnings
from contextlib import contextmanager
from dataclasses import asdict

import torch

from dtlab.agent import job as jobs
from dtlab.agent import script_env, script_observe, step_observer
from dtlab.agent.script_job import Outcome, ScriptEnded, ScriptJob
from dtlab.agent.state import RANK

_real_signal = signal.signal


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
    """One run of one script on this rank (``plain``: in a process of its own, under a
    launcher; see the module's docstring)."""

    def __init__(
        self, path: str, argv: list[str], cwd: str | None, record: bool, plain: bool = False
    ):
        import greenlet

        self.plain = plain
        self.exception: BaseException | None = None  # plain: what ended it, if it raised
        self.cwd = os.path.abspath(cwd or os.getcwd())
        if not os.path.isdir(self.cwd):
            raise FileNotFoundError(f"--cwd {cwd!r} is not a folder on this rank")
        self.path = os.path.abspath(os.path.join(self.cwd, path))
        self.code = _compile(self.path)
        self.argv = [path, *(argv if plain else launcher_args(_source(self.path), argv))]
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
        # its sys.stdout and sys.stderr for its whole run (see the module's docstring);
        # ``streams`` are those it put in their place, if it did (a logger's tee)
        self.routes = (
            (sys.stdout, sys.stderr) if plain else (_Route(self, "stdout"), _Route(self, "stderr"))
        )
        self.streams: tuple | None = None
        self.capture: list[str] | None = None  # while stepped: what it prints goes here
        self.inside = 0  # > 0 while the script runs (``_inside``)
        self.request_out = None  # the engine's stdout as the script was last entered
        self.started_at = time.time()
        self.setup_s: float | None = None
        self.folder = os.path.dirname(self.path)
        # the rank's interactive namespace (%%dt cells): the engine's __main__ module
        self.engine_ns = {} if plain else getattr(sys.modules.get("__main__"), "__dict__", {})
        self._modules_before = set(sys.modules)
        self._not_own = _not_own_prefixes(self.folder)
        # (plain: the process ends with the script, nothing is put back)
        self._process_before = None if plain else _process_state()
        self.observer = step_observer.Observer(self._on_boundary, note=self.notes.append)
        self.observer.recording = record
        self.glet = greenlet.greenlet(self._main)
        sys.path.insert(0, self.folder)
        if not plain:
            script_env.install(self.notes, self.folder + os.sep)
        script_observe.install(self.observer)
        if not plain:
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

    def kill(self, why: str = "stopped by dtlab") -> None:
        if not self.glet.dead and self.glet:
            import greenlet

            with self._inside():
                try:
                    self.glet.throw(greenlet.GreenletExit)
                except BaseException:
                    pass
        if self.outcome is None:
            self.outcome = Outcome("exited", None, evalue=why)
            self._finish()

    def detached(self) -> None:
        """Its job was replaced by another attached job (``ScriptJob.release``): a paused
        script that nothing can step any more ends now, as ``stop`` ends it (its
        ``finally`` blocks run, the process is put back as before it). Not from inside
        the script itself (a script that attaches a job of its own runs on)."""
        import greenlet

        if self.plain or self.over or greenlet.getcurrent() is self.glet:
            return
        self.kill("stopped by dtlab: another job was attached")

    def _main(self) -> Outcome:
        try:
            exec(self.code, self.module.__dict__)
        except SystemExit as e:
            if self.plain:
                self.exception = e
            code = e.code
            if code is None or isinstance(code, int):
                return Outcome("exited", code or 0)
            return Outcome("exited", 1, evalue=str(code))
        except BaseException as e:  # noqa: BLE001 - the script's failure is its outcome
            import greenlet

            if isinstance(e, greenlet.GreenletExit):
                return Outcome("exited", None, evalue="stopped by dtlab")
            if self.plain:
                self.exception = e
            file, line = _script_line(e, self.path)
            return Outcome(
                "failed", None, type(e).__name__, str(e), _script_traceback(e), file, line
            )
        return Outcome("finished", 0)

    def _pause(self, event):
        if not self.plain:  # (no notebook reads them: not looked for at every step)
            self.engine_ns["script_locals"] = self._locals_here()
        return self.glet.parent.switch(event)

    def _locals_here(self) -> dict:
        """The locals of the frame of the script's own code that made this optimizer step:
        the innermost frame in a file of the script's folder (its training loop in
        ``main()``, or a ``Trainer.train_step`` in a module next to it), else the script's
        own innermost frame (a framework's loop, such as HF Trainer's, is not its code),
        else its globals: read, and mutate objects, from ``%%dt``."""
        return self._locals_from(sys._getframe())

    def locals_now(self) -> dict:
        """:meth:`_locals_here` from outside the script (its greenlet is paused): where a
        connected notebook reads its variables (:mod:`dtlab.agent.batch_engine`)."""
        return self._locals_from(self.glet.gr_frame)

    def frame_now(self):
        """The frame of the script's own code that is making the optimizer step, while its
        greenlet is paused (:meth:`_own_frame`; None once the script ended)."""
        return self._own_frame(self.glet.gr_frame)

    def _locals_from(self, frame) -> dict:
        own = self._own_frame(frame)
        return own.f_locals if own is not None else self.module.__dict__

    def _own_frame(self, frame):
        """The innermost frame in a file of the script's folder, else the script's own
        innermost frame, else None."""
        fallback = None
        while frame is not None:
            file = frame.f_code.co_filename
            if self.is_own(file):
                return frame
            if fallback is None and os.path.abspath(file) == self.path:
                fallback = frame
            frame = frame.f_back
        return fallback

    def is_own(self, file: str) -> bool:
        """Is ``file`` the script's own code: in its folder or below, and neither an
        installed library (a virtual environment kept in the project's folder) nor dtlab."""
        if not file or file.startswith("<"):  # <string>, <frozen ...>
            return False
        path = os.path.abspath(file)
        if not path.startswith(self.folder + os.sep) or path.startswith(self._not_own):
            return False
        parts = path[len(self.folder) + 1 :].split(os.sep)
        return "site-packages" not in parts and "dist-packages" not in parts

    def _on_boundary(self, kind: str, optimizer) -> None:
        """Called inside the script's greenlet, from the optimizer hooks."""
        if kind == "pre":
            self.setup_s = time.time() - self.started_at
            self.job = ScriptJob(self, optimizer)
            engine = self.job.engine
            if engine is not None and engine.global_steps:  # it loaded a DeepSpeed checkpoint
                self.job.step_count = int(engine.global_steps)  # and counts on from there
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
        self.request_out = engine[4]  # where its output goes when no step captures it
        sys.stdout, sys.stderr = self.streams if self.streams is not None else self.routes
        os.chdir(self.cwd)
        torch.set_grad_enabled(self.grad_enabled)
        self._slice_saved = {sig: _real_signal(sig, h) for sig, h in self.handlers.items()}
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1
            self.argv, self.cwd, self.grad_enabled = sys.argv, os.getcwd(), torch.is_grad_enabled()
            now = (sys.stdout, sys.stderr)
            replaced = now[0] is not self.routes[0] or now[1] is not self.routes[1]
            self.streams = now if replaced else None  # a tee it made stays its own
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
        if self.plain:  # the process ends with the script: only dtlab's hooks come off
            script_observe.uninstall()
            if self.job is not None:
                self.job.reached.close()
            return
        with self._inside():  # as at its process's end: its cwd, argv, __main__
            self.notes.extend(script_env.run_exit_handlers())
            # (after them: what they log still goes where the script sent it)
            self.notes.extend(_restore_process_state(self._process_before))
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
        for name in set(sys.modules) - self._modules_before:
            if self.is_own(getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]  # an edit of the script's own modules counts next run

    # --- what it says ------------------------------------------------------------------
    def describe_end(self) -> str:
        o = self.outcome
        step = self.job.step_count if self.job is not None else 0
        if o is None:
            return f"the script is paused at step {step}"
        if "optimizer" in self.observer.off:  # it ran on unpaused from there
            step = f"{step} (dtlab's step boundaries were off from there: see the notes)"
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


class _Route(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` as the script sees it for its whole run: each
    write goes where the output of that moment belongs (the module's docstring says
    where), so a handler or an object that took the stream at set-up reaches the notebook
    at every later step. Writes are passed on whole and at once, nothing is kept: the
    order of a rank's output is the order of its writes.

    Not routed: what C code writes to file descriptors 1 and 2 (a C++ library's
    ``std::cout``, NCCL's or gloo's logs, a child process that inherited them), as under
    any ipyparallel engine: those descriptors belong to the whole process (the engine's
    threads, the sidecar's, other libraries') and stay the engine's. Catching them would
    mean pointing them at a pipe while the script runs, read by a thread: C's stdio buffers
    and that thread's delay would put them out of order with the Python writes, and a
    script that writes more than the pipe holds without the thread would block."""

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, run: ScriptRun, name: str):
        self.run, self.name = run, name

    def _next(self):
        """Where a write goes now: the step's capture (a list), a stream, or None."""
        run = self.run
        if run.inside:
            return run.capture if run.capture is not None else run.request_out
        return getattr(sys, self.name)  # outside the script: the engine's of this moment

    def _target(self):
        route = self
        for _ in range(4):  # a route may lead to another run's route, never round in a loop
            target = route._next()
            if not isinstance(target, _Route):
                return target
            route = target
        return getattr(sys, f"__{self.name}__")

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        # dtlab's "output" observation: should routing fail, it is switched off (a note)
        # and this write, and every later one, goes to the process's own stream
        if self.run.observer.observe("output", self._send, text) is None:
            fallback = getattr(sys, f"__{self.name}__")
            if fallback is not None:
                fallback.write(text)
        return len(text)

    def _send(self, text: str) -> bool:
        target = self._target()
        if isinstance(target, list):
            target.append(text)
        elif target is not None:
            target.write(text)
        return True

    def flush(self) -> None:
        if "output" in self.run.observer.off:
            return
        target = self._target()
        if target is not None and not isinstance(target, list):
            target.flush()

    def fileno(self) -> int:  # faulthandler, subprocess: the engine's descriptor, if any
        stream = getattr(sys, f"__{self.name}__")
        if stream is None:
            raise io.UnsupportedOperation("fileno")
        return stream.fileno()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        """Not closed by anyone (a handler or a ``with`` of the script): it serves on."""

    def reconfigure(self, **options) -> None:
        """``sys.stdout.reconfigure(line_buffering=True)``: every write goes out at once."""


# --- process-wide state restored at the script's end --------------------------------------


def _process_state() -> dict:
    """What of the process a script may change for good, and dtlab puts back at its end
    (under torchrun all of it dies with the script's process; an engine lives on)."""
    root = logging.getLogger()
    return {
        "root_handlers": list(root.handlers),
        "root_level": root.level,
        "root_disabled": root.disabled,
        "logging_disable": logging.root.manager.disable,
        "warnings_captured": getattr(logging, "_warnings_showwarning", None) is not None,
        "showwarning": warnings.showwarning,
        "warning_filters": list(warnings.filters),
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        # the list object and its entries: a script that inserts its own folders, or
        # rebinds sys.path, leaves the engine's as it was
        "sys_path": (sys.path, list(sys.path)),
        # torch's intra-op threads (dtlab gives each rank its share of the host's cores:
        # a script's set_num_threads(k) left behind oversubscribes them). Inter-op threads
        # cannot be put back: torch lets a process set them once, before its first
        # inter-op work (a second call raises), so a script's set_num_interop_threads
        # holds for the engine's life, and the same call in a later script raises
        "torch_threads": torch.get_num_threads(),
        "environ": dict(os.environ),
    }


def _restore_process_state(before: dict) -> list[str]:
    """Put back what ``_process_state`` read; -> a note for each part that could not be."""
    notes = []
    for what, restore in (
        ("the root logger and the warning filters", _restore_logging),
        ("the garbage collector's settings", _restore_gc),
        ("sys.path", _restore_sys_path),
        ("torch's thread count", _restore_threads),
        ("the environment variables", _restore_environ),
    ):
        try:
            restore(before)
        except Exception as e:  # noqa: BLE001 - the rest of the clean-up must happen
            notes.append(f"dtlab could not put back {what} as before the script: {e!r}")
    return notes


def _restore_logging(before: dict) -> None:
    root = logging.getLogger()
    added = [h for h in root.handlers if h not in before["root_handlers"]]
    root.handlers[:] = before["root_handlers"]
    for handler in added:  # as logging.shutdown() would at the script's process's end
        try:
            handler.flush()
            handler.close()
        except Exception:  # noqa: BLE001 - a handler of the script's that fails to close
            pass
    root.setLevel(before["root_level"])
    root.disabled = before["root_disabled"]
    logging.disable(before["logging_disable"])
    if not before["warnings_captured"]:
        logging.captureWarnings(False)
    warnings.showwarning = before["showwarning"]
    warnings.filters[:] = before["warning_filters"]
    for name in ("_filters_mutated", "_filters_mutated_lock_held"):  # as catch_warnings does
        mutated = getattr(warnings, name, None)
        if mutated is not None:
            mutated()
            break


def _restore_gc(before: dict) -> None:
    gc.set_threshold(*before["gc_threshold"])
    (gc.enable if before["gc_enabled"] else gc.disable)()


def _restore_sys_path(before: dict) -> None:
    path, entries = before["sys_path"]
    path[:] = entries
    sys.path = path


def _restore_threads(before: dict) -> None:
    if torch.get_num_threads() != before["torch_threads"]:
        torch.set_num_threads(before["torch_threads"])


def _restore_environ(before: dict) -> None:
    """Variables the script added are removed, those it changed or removed are as they
    were (through ``os.environ``, so the C library's environment follows)."""
    saved = before["environ"]
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _not_own_prefixes(folder: str) -> tuple[str, ...]:
    """Folders whose files are not a script's own code though they may lie in its folder
    (a virtual environment there, dtlab's own checkout): those not holding the folder."""
    dtlab_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for place in (dtlab_dir, sys.prefix, sys.base_prefix, sys.exec_prefix):
        prefix = os.path.abspath(place) + os.sep
        if not (folder + os.sep).startswith(prefix):
            found.append(prefix)
    return tuple(found)


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


LOCAL_RANK_OPTIONS = ("--local_rank", "--local-rank")
DEEPSPEED_OPTIONS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config")


def launcher_args(source: str, argv: list[str]) -> list[str]:
    """The script's arguments as the ``deepspeed`` launcher gives them: a command line
    with DeepSpeed's own options (``--deepspeed``, ``--deepspeed_config``) to a script
    that declares ``--local_rank`` gets ``--local_rank=<LOCAL_RANK>`` first, unless it
    has one already; scripts written for that launcher read it (e.g.
    ``torch.cuda.set_device(args.local_rank)``, where its default -1 fails). Any other
    command line is the script's own, as under torchrun (which sets LOCAL_RANK only)."""
    options = {arg.split("=", 1)[0] for arg in argv}
    if not options & set(DEEPSPEED_OPTIONS) or options & set(LOCAL_RANK_OPTIONS):
        return list(argv)
    declared = [o for o in LOCAL_RANK_OPTIONS if f'"{o}"' in source or f"'{o}'" in source]
    if not declared:
        return list(argv)
    return [f"{declared[0]}={os.environ.get('LOCAL_RANK', '0')}", *argv]


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

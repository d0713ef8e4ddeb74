"""A notebook's way into a job started by ``torchrun ... -m dtlab.run``: each rank is an
ipyparallel engine, served on a thread of its own, and the job holds at a step boundary
when a connected notebook asks.

Why a thread: the script owns the main thread (it is never paused unless asked), so the
engine's event loop runs beside it and answers at once, even while a rank is inside a
step (where it is, its stacks). What touches the script's state waits for a hold: every
rank stops after the same optimizer step (``hold_at``), its main thread waiting in
:func:`boundary` while the notebook reads and changes the script's variables through the
engine (``%%dt`` code runs on the engine's thread while the script's waits).

The controller: rank 0 starts one with ipyparallel's own launcher
(``ipp.Cluster.start_controller``), its profile in ``<job folder>/ipython`` (owner-only),
listening where ``--listen`` says (loopback by default); the engines' connection file goes
to the other ranks through the job's store (no shared file system needed), each rank's
copy owner-only in its own folder. Rank 0 stops it as it ends (a rank 0 killed
outright leaves it running: its pid is in ``<job folder>/ipython/security/cluster-job.json``).

A hold is leased: a notebook renews it (every call, and a thread of its own); one that
stops answering for ``LEASE_S`` lets the job go on by itself. One notebook at a time
holds the job (``claim``); another is refused until the first disconnects or its lease
ends. Nothing here may break the script: a failure to start the engine is said once and
the job runs on unconnectable.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE = "ipython"  # the controller's profile folder in the job folder
CLUSTER_ID = "job"
CLIENT_FILE = f"security/ipcontroller-{CLUSTER_ID}-client.json"
ENGINE_FILE = f"security/ipcontroller-{CLUSTER_ID}-engine.json"
STORE_KEY = "dtlab/run/engine-connection"
ENGINE_START_S = 60.0  # how long the first step waits for its engine to register
LEASE_S = 60.0  # a hold or a claim nobody renews for this long ends by itself
WAIT_POLL_S = 0.5
HELD_STACK = "Script held after step"  # how stacks() starts while the rank holds


@dataclass
class Hold:
    """What the connected notebook asked of this rank, and where its script is (read by
    the engine's thread, written under ``cond``)."""

    step: int = 0  # the last optimizer step this rank finished
    at: int | None = None  # hold after this step (None: run freely)
    held: int | None = None  # the step the main thread is holding after, while it does
    lease_until: float = 0.0  # the hold ends by itself then, unless renewed
    owner: str | None = None  # the connected notebook's token
    locals: Any = None  # the script's variables while held
    module: Any = None  # the script's module (its globals) while held
    frame: Any = None  # the script's innermost frame while held (its greenlet's)
    record: Any = None  # the StepRecord of the last step (what %dt_run --until reads)
    # the connected notebook's names: what %%dt cells defined and %dt_push bound (new for
    # each notebook that connects)
    names: dict = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)


HOLD = Hold()


class EngineStart:
    """The rank's engine, started on a thread at the job's first step."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.error: str | None = None
        self.app: Any = None
        self.cluster: Any = None  # rank 0's controller
        self.guard: subprocess.Popen | None = None  # rank 0's guard of it


def start(folder: Path, rank: int, listen: str, store: Any) -> EngineStart:
    """Rank 0 starts the controller; every rank starts its engine and waits (bounded) for
    it to register. Raises what went wrong (the caller runs on without)."""
    started = EngineStart()
    profile = folder / PROFILE
    if rank == 0:
        started.cluster = _start_controller(profile, listen)
        started.guard = _guard(profile)  # kept: a Popen dropped while it runs warns
        text = _wait_for(profile / ENGINE_FILE)
        if store is not None:
            store.set(STORE_KEY, text)
    else:
        if store is None:
            raise RuntimeError("no process group store to get the controller's address from")
        store.wait([STORE_KEY], _timedelta(ENGINE_START_S))
        text = store.get(STORE_KEY).decode()
    own = folder / f"rank-{rank}" / ".engine.json"
    _write_private(own, text)
    saved = _process_state()
    thread = threading.Thread(
        target=_serve, args=(str(own), started), name="dtlab-engine", daemon=True
    )
    thread.start()
    ready = started.ready.wait(ENGINE_START_S)
    _restore(saved)  # what initialising a kernel changes, put back for the script
    if not ready:
        raise TimeoutError(f"the engine did not register within {ENGINE_START_S:g} s")
    if started.error is not None:
        raise RuntimeError(started.error)
    return started


def _start_controller(profile: Path, listen: str):
    import ipyparallel as ipp

    profile.mkdir(parents=True, exist_ok=True)
    os.chmod(profile, 0o700)
    cluster = ipp.Cluster(
        profile_dir=str(profile),
        cluster_id=CLUSTER_ID,
        controller_ip=listen,
        n=0,
        log_level=40,
        shutdown_atexit=False,  # stopped by :func:`stop` (its atexit prints to stderr)
    )
    cluster.start_controller_sync()
    return cluster


def _guard(profile: Path) -> subprocess.Popen:
    """Start the controller's guard (:mod:`dtlab.agent.controller_guard`): it stops the
    controller should rank 0 die without doing so (``kill -9``)."""
    log = open(profile / "guard.log", "ab")  # noqa: SIM115 - the guard's, kept open by it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "dtlab.agent.controller_guard", str(os.getpid()),
             str(profile), CLUSTER_ID],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # a signal to the job's process group is not for it
            close_fds=True,
        )  # fmt: skip
    finally:
        log.close()


def _wait_for(path: Path, timeout_s: float = ENGINE_START_S) -> str:
    """The controller's connection file, once written whole."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            json.loads(text)
            os.chmod(path, 0o600)
            return text
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.05)
    raise TimeoutError(f"the controller wrote no {path.name} within {timeout_s:g} s")


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _process_state() -> tuple:
    """What an IPython kernel's start changes process-wide (``__main__``, hooks, streams,
    the environment, sys.path, warning filters)."""
    return (
        sys.modules.get("__main__"),
        sys.excepthook,
        sys.displayhook,
        sys.stdout,
        sys.stderr,
        dict(os.environ),
        list(sys.path),
        list(warnings.filters),
    )


def _restore(saved: tuple) -> None:
    main, excepthook, displayhook, out, err, environ, path, filters = saved
    if main is not None:
        sys.modules["__main__"] = main
    sys.excepthook, sys.displayhook, sys.stdout, sys.stderr = excepthook, displayhook, out, err
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    sys.path[:] = path
    warnings.filters[:] = filters


def _serve(url_file: str, started: EngineStart) -> None:
    """The engine's thread: its own event loop, its kernel's requests run here."""
    try:
        asyncio.set_event_loop(asyncio.new_event_loop())
        from ipyparallel.engine.app import IPEngine

        _signals_on_main_thread_only()
        app = started.app = IPEngine(url_file=url_file, enable_nanny=False, log_level=40)
        app.init_signal = lambda: None  # the script's signals stay the script's
        app.redirect_output = lambda iopub: None  # and so do its streams

        async def registered() -> None:
            while getattr(app, "kernel", None) is None:
                await asyncio.sleep(0.01)
            started.ready.set()

        app.initialize([])
        app.loop.add_callback(registered)
        app.start()
    except BaseException as e:  # noqa: BLE001 - said by the main thread, the job runs on
        started.error = f"{type(e).__name__}: {e}"
        started.ready.set()


def _signals_on_main_thread_only() -> None:
    """ipykernel sets SIGINT's handler around each request, which only the main thread
    may do: on this thread a request leaves signals alone."""
    from ipykernel import kernelbase

    kernel = kernelbase.Kernel
    if getattr(kernel, "_dtlab_thread_safe", False):
        return
    pre, post = kernel.pre_handler_hook, kernel.post_handler_hook

    def pre_handler_hook(self):
        if threading.current_thread() is threading.main_thread():
            pre(self)

    def post_handler_hook(self):
        if threading.current_thread() is threading.main_thread():
            post(self)

    kernel.pre_handler_hook = pre_handler_hook  # type: ignore[method-assign]
    kernel.post_handler_hook = post_handler_hook  # type: ignore[method-assign]
    kernel._dtlab_thread_safe = True  # type: ignore[attr-defined]


def stop(started: EngineStart | None) -> None:
    """As the rank ends: rank 0 stops the controller (the engines go with the process)."""
    if started is None or started.cluster is None:
        return
    try:
        started.cluster.stop_controller_sync()
    except Exception as e:  # noqa: BLE001 - the job's end is not changed by this
        _say(f"could not stop the job's controller: {e!r}")


# --- the main thread, after each optimizer step ------------------------------------------


def boundary(
    step: int, script: Any, writer: Any = None, watchdog: Any = None, record: Any = None
) -> None:
    """After step ``step``: hold here while the notebook asks (one comparison otherwise).
    ``writer`` (the rank's RankFolder) is flushed as the hold begins, so the notebook
    reads every step up to it from the folder; ``watchdog`` hears that a held rank is
    not a hung one; ``record`` is the step's StepRecord, kept for the notebook."""
    hold = HOLD
    hold.step, hold.record = step, record
    if hold.at is None or step < hold.at:
        return
    if writer is not None:
        try:
            writer.flush()
        except Exception as e:  # noqa: BLE001 - the hold goes on; the folder lags
            _say(f"rank {_rank()} could not flush its records before holding: {e!r}")
    with hold.cond:
        hold.held = step
        hold.locals = script.locals_now() if script is not None else None
        hold.module = getattr(script, "module", None)
        hold.frame = script.frame_now() if script is not None else None
        hold.cond.notify_all()
        while hold.at is not None and step >= hold.at:
            if time.monotonic() > hold.lease_until:
                hold.at, hold.owner = None, None
                _say(f"the notebook stopped answering; rank {_rank()} goes on after step {step}")
                break
            hold.cond.wait(WAIT_POLL_S)
            if watchdog is not None:
                watchdog.beat(step)
        hold.held = None
        hold.locals = hold.module = hold.frame = None
        hold.cond.notify_all()


# --- what the notebook asks (through agent/api.py, on the engine's thread) -----------------


@dataclass(frozen=True)
class Where:
    rank: int
    step: int  # the last step this rank finished
    held: int | None  # the step it holds after, if it does
    at: int | None  # the step it was asked to hold after
    owner: str | None


def where() -> Where:
    h = HOLD
    return Where(_rank(), h.step, h.held, h.at, h.owner)


def claim(token: str, lease_s: float = LEASE_S) -> Where:
    """Make ``token``'s notebook the one connected; PermissionError while another is."""
    h = HOLD
    with h.cond:
        if h.owner not in (None, token) and time.monotonic() < h.lease_until:
            raise PermissionError("another notebook is connected to this job")
        if h.owner != token:  # a new notebook: a hold the last one left (it died) ends
            if h.owner is not None and h.at is not None:  # (said as the lease's end says it)
                step = h.held if h.held is not None else h.step
                _say(
                    f"the notebook stopped answering; rank {_rank()} goes on after step "
                    f"{step} (another notebook connected)"
                )
            h.at, h.names = None, {}
            h.cond.notify_all()
        h.owner, h.lease_until = token, time.monotonic() + lease_s
    return where()


def hold_at(token: str, step: int | None, lease_s: float = LEASE_S) -> Where:
    """Hold after ``step`` (None: go on). -> where this rank is now."""
    h = HOLD
    with h.cond:
        _check_owner(token)
        h.at, h.lease_until = step, time.monotonic() + lease_s
        h.cond.notify_all()
    return where()


def renew(token: str, lease_s: float = LEASE_S) -> Where:
    h = HOLD
    with h.cond:
        _check_owner(token)
        h.lease_until = time.monotonic() + lease_s
    return where()


def release(token: str) -> None:
    """Go on, and leave the job to the next notebook."""
    h = HOLD
    with h.cond:
        if h.owner == token:
            h.at, h.owner = None, None
            h.cond.notify_all()


def run_code(token: str, code: str) -> tuple[str, str, str | None]:
    """``%%dt`` on a held rank: ``code`` run with the script's variables as
    ``script_locals``, its module as ``script`` (and ``rank``), in the connected
    notebook's namespace (what earlier cells defined stays); -> what it printed to stdout
    and stderr, and the repr of its last line when that is an expression (as a notebook
    cell shows it; None otherwise)."""
    h = HOLD
    with h.cond:
        namespace = _held_names(token)
        body = ast.parse(code, "<%%dt>")
        last = body.body.pop() if body.body and isinstance(body.body[-1], ast.Expr) else None
        out, err, result = io.StringIO(), io.StringIO(), None
        with redirect_stdout(out), redirect_stderr(err):  # the script's thread waits
            exec(compile(body, "<%%dt>", "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<%%dt>", "eval"), namespace)
                result = None if value is None else repr(value)
    return out.getvalue(), err.getvalue(), result


def pull(token: str, name: str) -> Any:
    """``%dt_pull NAME`` on a held rank: the value of ``name`` in the notebook's namespace
    there, else among the script's variables where it holds, else its module's."""
    h = HOLD
    with h.cond:
        namespace = _held_names(token)
        for scope in (namespace, h.locals or {}, vars(h.module) if h.module else {}):
            if name in scope:
                return scope[name]
    raise NameError(f"no variable {name!r} on rank {_rank()} (nor in script_locals)")


def push(token: str, values: dict) -> None:
    """``%dt_push``: bind ``values`` in the notebook's namespace on this rank."""
    h = HOLD
    with h.cond:
        _held_names(token).update(values)


def _held_names(token: str) -> dict:
    """The connected notebook's namespace, with the held script's variables bound
    (``h.cond`` held by the caller)."""
    h = HOLD
    _check_owner(token)
    if h.held is None:
        raise RuntimeError("the job is running: pause it first (dt.pause())")
    h.lease_until = time.monotonic() + LEASE_S
    h.names.update(script_locals=h.locals, script=h.module, rank=_rank())
    h.names.setdefault("__name__", "__dtlab__")
    return h.names


def last_record() -> Any:
    """The StepRecord of this rank's last step (None before its first)."""
    return HOLD.record


def stacks() -> str:
    """Every thread's Python stack (faulthandler's, as the hang report writes them); while
    the rank holds, first the script's own (held inside its optimizer step, in a greenlet
    no thread shows): ``HELD_STACK`` then its frames, most recent call last."""
    import faulthandler
    import tempfile
    import traceback

    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        threads = out.read()
    h = HOLD
    with h.cond:
        frame, held = h.frame, h.held
        script = "".join(traceback.format_stack(frame)) if frame is not None else ""
    if held is None or not script:
        return threads
    return f"{HELD_STACK} {held} (most recent call last):\n{script}\n{threads}"


def _check_owner(token: str) -> None:
    if HOLD.owner != token:
        raise PermissionError(
            "this notebook is not connected to the job (its lease ended or another "
            "notebook connected): connect again"
        )


def _rank() -> int:
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def _say(text: str) -> None:
    print(f"dtlab.run: {text}", file=sys.__stderr__ or sys.stderr, flush=True)

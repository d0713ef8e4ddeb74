"""Start N ipyparallel engines by forking them from one process that has imported torch.

Run by :class:`dtlab.control.launchers.ForkingEngineSetLauncher`, never by hand::

    python -m dtlab.control.forkserver --num-engines N -- <ipengine arguments>

Stages:
1. import the heavy modules once (torch, torch.distributed, torch._dynamo, the engine app);
   on 2 cores this is most of a rank's start-up, and forked children share it copy-on-write;
2. fork N children; child i sets DTLAB_ENGINE_INDEX=i and runs an ordinary ipengine;
3. reap children (and the nannies orphaned to it); forward SIGTERM / SIGINT to the engines;
   if the notebook kernel that launched it dies, stop the engines and the controller;
   exit when no descendant is left.

Engines die at once on SIGTERM (its default action) and otherwise leave through
``os._exit``: a torch-loaded interpreter spends seconds in teardown (8.4 s for 8 stock
engines here) that buys nothing.

Each engine's output (its file descriptors 1 and 2: what C++ writes, gloo's and c10d's
errors, "terminate called after throwing ...", NCCL's warnings among them) goes to a log
of its own, ``$DTLAB_ENGINE_LOGS/engine-<pid>.log``, which the notebook reads when the
engine dies (:mod:`dtlab.control.hangs`); the fork server repeats the end of a failed
engine's log in its own output (what a failed launch quotes). ipykernel points descriptor
2 at a pipe that a thread of the engine drains and forwards: the last words of an engine
that aborts were still in the pipe when it died (gloo's abort on live ranks reached no
log; a copy of that thread lost the message in 20 aborts of 20), so once ipykernel has
set up its streams the engine points descriptor 2 back at its log; Python's
``sys.stderr`` still reaches the notebook, and descriptor 1 stays ipykernel's.
Nothing here may create threads, zmq contexts or CUDA state before forking.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import signal
import sys
from typing import BinaryIO

ENGINE_INDEX_ENV = "DTLAB_ENGINE_INDEX"
EXIT_LOG_ENV = "DTLAB_EXIT_LOG"  # a file to note each engine's exit status in (JSON lines)
ENGINE_LOGS_ENV = "DTLAB_ENGINE_LOGS"  # a folder for each engine's stderr (engine-<pid>.log)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # DDP's constructor imports it lazily: ~1.1 s of CPU per rank otherwise
    "ipyparallel.engine.app",
    "ipyparallel.engine.nanny",
    "ipykernel.ipkernel",
    # what each engine would otherwise import after the fork, 8 times over
    "ipykernel.debugger",
    "IPython.extensions.storemagic",
    "IPython.core.completerlib",
    "IPython.core.oinspect",
    "sqlite3",
    "dtlab.agent.identity",
    "dtlab.agent.rendezvous",
)
PARENT_POLL_S = 0.5  # how often to check that the launching kernel is still alive
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):  # not Linux: signals are still forwarded
        pass


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child if the fork server dies: no orphaned ranks."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _NannyHandle:
    """What the engine keeps of its nanny: the read end of the pipe the nanny watches."""

    def __init__(self, pid: int, reader: BinaryIO):
        self.pid = pid
        self.reader = reader


def _fork_nanny(**kwargs):
    """Drop-in for ``ipyparallel.engine.nanny.start_nanny`` that forks instead of spawning.

    ipyparallel starts each nanny as a fresh interpreter (~0.3 s of CPU each, ~1.7 s of wall
    time for 8 engines on 2 cores); a fork of the engine costs milliseconds. The engine has
    zmq I/O threads at this point, so the child touches none of the engine's sockets: the
    nanny builds its own context and leaves through os._exit.
    """
    from ipyparallel.engine.nanny import KernelNanny

    kwargs["pid"] = os.getpid()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            os.setsid()  # like ipyparallel's nanny: signals to the engine's group skip it
            KernelNanny.main(pipe=os.fdopen(write_fd, "w", buffering=1), **kwargs)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    reader = os.fdopen(read_fd, "rb")
    nanny_url = reader.readline().decode("utf8").strip()
    if not nanny_url:
        raise RuntimeError(f"nanny {pid} of engine {os.getpid()} failed to start")
    return nanny_url, _NannyHandle(pid, reader)


def _init_signal(self):
    """Engine signal handlers: ipengine's for SIGINT, the OS default for SIGTERM.

    With the default action SIGTERM ends an engine at once, even one blocked inside a gloo
    collective where no Python handler could run; a graceful stop would only spend seconds
    tearing down a torch-loaded interpreter.
    """
    signal.signal(signal.SIGINT, self._signal_sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def engine_log(folder: str, pid: int) -> str:
    """The file engine ``pid`` writes its stderr to, in the folder ``$DTLAB_ENGINE_LOGS``."""
    return os.path.join(folder, f"engine-{pid}.log")


def _log_output() -> None:
    """This engine's descriptors 1 and 2 to its own log (none without $DTLAB_ENGINE_LOGS;
    ipykernel still sends what descriptor 1 gets to the notebook too)."""
    folder = os.environ.get(ENGINE_LOGS_ENV)
    if not folder:
        return
    try:
        fd = os.open(engine_log(folder, os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return  # the shared launcher output it was going to
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _wrap_redirect_output(redirect_output):
    """``IPEngine.redirect_output``, then descriptor 2 back to the engine's log: ipykernel
    points it at a pipe its own thread drains, and what a dying engine wrote last stays
    in that pipe (``sys.stderr`` still goes to the notebook)."""

    def redirect(self, *args, **kwargs):
        redirect_output(self, *args, **kwargs)
        log = getattr(sys.stderr, "_original_stdstream_copy", None)
        if log is not None and os.environ.get(ENGINE_LOGS_ENV):
            os.dup2(log, 2)

    return redirect


def _run_engine(index: int, engine_argv: list[str]) -> None:
    """Body of a forked child; never returns."""
    code = 1
    try:
        _die_with_parent()
        os.environ[ENGINE_INDEX_ENV] = str(index)
        sys.argv = ["ipengine", *engine_argv]  # what the engine's usage messages call it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _log_output()
        import ipyparallel.engine.app as engine_app

        engine_app.start_nanny = _fork_nanny
        engine_app.IPEngine.init_signal = _init_signal
        engine_app.IPEngine.redirect_output = _wrap_redirect_output(
            engine_app.IPEngine.redirect_output
        )
        engine_app.IPEngine.launch_instance(engine_argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forward(children: dict[int, int], stopping: list[int]):
    def handler(signum, frame):
        if signum == signal.SIGTERM:
            stopping.append(signum)
        for pid in list(children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    return handler


def serve(num_engines: int, engine_argv: list[str]) -> int:
    # Nannies outlive their engine by a moment; as subreaper we reap them, so when this
    # process exits every engine and nanny it made is gone (not left as a zombie of init).
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # as ipengine sets it
    for name in PRELOAD:
        importlib.import_module(name)
    # Keep the collector off the preloaded objects: a collection in a child would write to
    # every object it visits, copying the shared pages into each engine (Python's gc docs).
    gc.freeze()
    children: dict[int, int] = {}
    stopping: list[int] = []
    forward = _forward(children, stopping)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for index in range(num_engines):
        pid = os.fork()
        if pid == 0:
            _run_engine(index, engine_argv)
        children[pid] = index
    print(f"dtlab fork server {os.getpid()}: engines {sorted(children)}", flush=True)
    exit_code = 0
    parent = os.getppid()
    # sleep until a child exits (SIGCHLD) or PARENT_POLL_S passes, instead of spinning
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:  # until no descendant is left: engines, and the nannies reparented to us
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if os.getppid() != parent and not stopping:
                # the notebook kernel that launched us is gone (killed, crashed):
                # nobody can drive or stop these ranks any more
                print("dtlab fork server: launching process exited; stopping engines", flush=True)
                forward(signal.SIGTERM, None)
                _stop_orphaned_controller()
            signal.sigtimedwait({signal.SIGCHLD}, PARENT_POLL_S)
            continue
        if pid not in children:
            continue
        index = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not (stopping and code == -signal.SIGTERM):
            print(f"dtlab fork server: engine {index} (pid {pid}) exited with {code}", flush=True)
            _echo_last_lines(index, pid)
            exit_code = exit_code or (code if code > 0 else 128 - code)
            _note_exit(pid, index, code)
    return exit_code


def _echo_last_lines(index: int, pid: int, most: int = 2048) -> None:
    """The end of a failed engine's own log, in the fork server's output too: what a
    launch that fails quotes (an engine that refuses its arguments says why there)."""
    folder = os.environ.get(ENGINE_LOGS_ENV)
    if not folder:
        return
    try:
        with open(engine_log(folder, pid), "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - most))
            tail = log.read(most).decode("utf-8", "replace").splitlines()[-12:]
    except OSError:
        return
    for line in tail:
        print(f"  engine {index}: {line}", flush=True)


def _note_exit(pid: int, index: int, code: int) -> None:
    """For the notebook's "rank 3 died: killed by SIGKILL" (it is not the engines' parent)."""
    path = os.environ.get(EXIT_LOG_ENV)
    if path:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as log:
                log.write(json.dumps({"pid": pid, "index": index, "code": code}) + "\n")
        except OSError:
            pass  # the report says "cause unknown" instead


def _stop_orphaned_controller() -> None:
    """SIGTERM this cluster's controller, found through ipyparallel's cluster file."""
    cluster_id = os.environ.get("IPP_CLUSTER_ID", "")
    path = os.path.join(
        os.environ.get("IPP_PROFILE_DIR", ""), "security", f"cluster-{cluster_id}.json"
    )
    try:
        with open(path) as f:
            pid = json.load(f)["controller"]["state"]["pid"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except (OSError, KeyError, TypeError, ValueError):
        return
    if cluster_id and f"IPP_CLUSTER_ID={cluster_id}".encode() in environ:  # not a recycled pid
        os.kill(pid, signal.SIGTERM)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.control.forkserver")
    parser.add_argument("--num-engines", type=int, required=True)
    parser.add_argument("engine_argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    engine_argv = args.engine_argv
    if engine_argv[:1] == ["--"]:
        engine_argv = engine_argv[1:]
    return serve(args.num_engines, engine_argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the torch-loaded interpreter's teardown (~0.8 s here)

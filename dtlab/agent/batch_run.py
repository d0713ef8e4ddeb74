"""The rank side of ``torchrun ... -m dtlab.run train.py``: the script run as the launcher
would run it, unpaused, every step recorded into this rank's share of a job folder.

The script runs as under ``%dt_script`` (:mod:`dtlab.agent.script`: in a greenlet, its
optimizer steps seen through hooks, each made into a StepRecord by its ``ScriptJob``),
but ``plain``: the process is the script's, so it makes its own process group, prints to
the process's streams and has its own signal handlers and atexit functions. Where the
stepping channel would wait for the notebook between steps, ``run`` steps on at once
(``job.step()`` until ``JobEnded``, as ``%dt_continue`` does) and hands each record to a
:class:`dtlab.agent.rank_folder.RankFolder`.

The job folder: ``--run-dir`` as given, else ``$DTLAB_RUNS_DIR`` (or ``runs/``) /
``<script stem>-<rank 0's start time>``, named by rank 0 at its first step and read by the
others from the process group's store (the script's group is up by then; dtlab makes no
collective of its own).

The process ends as the script's would have: its exit code, its ``sys.exit`` message, its
uncaught exception through ``sys.excepthook`` (from the script's own frames), a
KeyboardInterrupt or a SIGTERM (from torchrun, when another rank failed) by the signal,
also when it comes while the rank waits in a collective that never returns
(:mod:`dtlab.agent.late_signal`). Records are flushed first, and ``outcome.json`` says how
the rank ended. dtlab never breaks the script: should its own recording fail, it says so
once and the script runs on.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtlab.agent import batch_engine
from dtlab.agent.late_signal import SignalWatch
from dtlab.agent.rank_folder import RankFolder, Watchdog
from dtlab.agent.rendezvous import FR_BUFFER_ENV, FR_BUFFER_SIZE
from dtlab.agent.state import RANK
from dtlab.records import job_folder as jf
from dtlab.records.run_folder import RUNS_DIR_ENV

FOLDER_KEY = "dtlab/run/job-folder"  # the store key rank 0 names the job folder under
DEFAULT_HANG_TIMEOUT_S = 600.0
DEFAULT_LISTEN = "127.0.0.1"  # where the job's controller listens: this host only


class RunDirInUse(RuntimeError):
    """``--run-dir`` already holds this rank's records of an earlier job."""


@dataclass
class Options:
    script: str
    argv: list[str] = field(default_factory=list)
    run_dir: str | None = None  # the job folder; None: a new one under runs/
    record: bool = True  # per-parameter statistics (--no-record: only what a step costs)
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S  # 0: no watchdog
    listen: str | None = DEFAULT_LISTEN  # the controller's address; None: not connectable
    started: float = field(default_factory=time.time)


@dataclass
class _Run:
    """What ``run`` holds while the script runs (the SIGTERM handler reads it)."""

    options: Options
    rank: int
    world: int
    folder: Path | None = None  # the job folder, once known
    writer: RankFolder | None = None
    watchdog: Watchdog | None = None
    engine: Any = None  # batch_engine.EngineStart, once the rank's engine is up
    script: Any = None  # the ScriptRun
    pid: int = field(default_factory=os.getpid)  # the rank's (not a worker it forked)
    fatal: Any = None  # the open fatal.txt faulthandler writes into
    term: SignalWatch | None = None  # SIGTERM while the main thread waits in a C call
    ended: bool = False  # outcome written


def run(options: Options) -> int:
    """Run the script on this rank; -> its exit code (or end the process its way)."""
    from dtlab.agent.script import ScriptRun

    rank = _env_int("RANK", 0)
    state = _Run(options, rank, _env_int("WORLD_SIZE", 1))
    # torch's Flight Recorder keeps each group's last collectives for a hang report (read
    # when the script makes its group; a size the launcher set stays)
    os.environ.setdefault(FR_BUFFER_ENV, FR_BUFFER_SIZE)
    if options.run_dir is not None:
        state.folder = Path(options.run_dir).absolute()
        _claim(state)
    try:
        script = ScriptRun(options.script, list(options.argv), None, options.record, plain=True)
    except (ValueError, OSError) as e:  # not Python, not readable: as Python refuses it
        print(f"dtlab.run: {e}", file=sys.stderr)
        return 1
    state.script = RANK.script_run = script
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):  # (a handler someone set stays theirs)

        def on_term(signum, frame):
            _on_term(state, signum)

        signal.signal(signal.SIGTERM, on_term)
        # (one blocked in a collective: a thread ends the rank in its stead)
        state.term = SignalWatch(signal.SIGTERM, on_term, lambda signum: _finish(state, signum))
        state.term.start()
    try:
        _drive(state)
    finally:
        _finish(state, None)
    return _end_as_the_script(script)


def _drive(state: _Run) -> None:
    """Step the script to its end, recording each step (recording that fails is dropped,
    the script goes on)."""
    from dtlab.agent.job import JobEnded
    from dtlab.agent.script_job import ScriptFailed

    script = state.script
    try:
        script.resume()  # to its first optimizer step (the job is made there) or its end
    except JobEnded:
        return
    job = script.job
    try:
        _open(state, job)
    except Exception as e:  # noqa: BLE001 - dtlab's failure, not the script's
        _say(f"recording is off for this run on rank {state.rank}: {e!r}")
        state.writer = None
    if state.options.listen is not None:
        _connectable(state)
    writer, watchdog = state.writer, state.watchdog
    while True:
        try:
            rec = job.step()
        except (JobEnded, ScriptFailed):
            return
        except Exception as e:  # noqa: BLE001 - dtlab's own step failed: run on unwatched
            _say(f"dtlab stopped recording on rank {state.rank} at step {job.step_count}: {e!r}")
            _run_on(script)
            return
        if writer is not None:
            try:
                writer.add(rec)
            except Exception as e:  # noqa: BLE001
                _say(f"dtlab stopped writing records on rank {state.rank}: {e!r}")
                writer = state.writer = None
        if watchdog is not None:
            watchdog.beat(rec.step)
        if state.engine is not None:
            batch_engine.boundary(job.step_count, script, writer, watchdog, rec)


def _connectable(state: _Run) -> None:
    """At the first step: this rank an ipyparallel engine (rank 0 starts the controller),
    so a notebook can connect (``dtlab.connect``); if that fails the job runs on."""
    if state.folder is None:
        return
    try:
        state.engine = batch_engine.start(
            state.folder, state.rank, state.options.listen or DEFAULT_LISTEN, _store(state)
        )
    except Exception as e:  # noqa: BLE001 - the job runs on, unconnectable
        _say(f"rank {state.rank} cannot be connected to (the job runs on): {e}")
        return
    if state.rank == 0:
        _say(f"connect with dtlab.connect({str(state.folder)!r}) or %dt_connect")


def _store(state: _Run):
    """The process group's store (the script's group is up at its first step), if any."""
    import torch.distributed as dist

    if state.world > 1 and dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    return None


def _run_on(script) -> None:
    """Let the script run to its end with nothing recorded."""
    from dtlab.agent import script_observe
    from dtlab.agent.job import JobEnded

    script_observe.set_recording(False)
    while True:
        try:
            script.resume()
        except JobEnded:
            return


def _open(state: _Run, job) -> None:
    """At the first step: the job folder (agreed now if not given), this rank's header,
    the watchdog."""
    options = state.options
    if state.folder is None:
        state.folder = _agree_folder(state)
        if state.rank == 0:
            _say(f"recording every step of every rank in {_shown(state.folder)}")
    folder = jf.rank_folder(state.folder, state.rank)
    state.writer = RankFolder(folder, state.rank)
    state.writer.open(job.info_now(), _rank_meta(state, job), options.started)
    state.watchdog = Watchdog(state.writer, options.hang_timeout_s)
    state.watchdog.start()
    state.fatal = _on_fatal(folder)


def _on_fatal(folder: Path):
    """A fatal signal (an abort in gloo or NCCL, a segfault) ends the process with no word
    of Python's: faulthandler writes every thread's stack into ``fatal.txt`` then. Left
    alone when the script (or its launcher) enabled faulthandler itself."""
    if faulthandler.is_enabled():
        return None
    try:
        out = open(folder / jf.FATAL_FILE, "w")  # noqa: SIM115 - open until the process ends
        faulthandler.enable(file=out, all_threads=True)
    except (OSError, ValueError) as e:
        _say(f"rank {folder.name}: no stack will be kept on a fatal signal: {e}")
        return None
    return out


def _finish(state: _Run, signum: int | None) -> None:
    """Flush, the header as the job ends (observations switched off since), outcome.json;
    then rank 0 stops the controller (a notebook connecting meanwhile finds the outcome
    and opens the folder read-only)."""
    if state.ended:
        return
    state.ended = True
    if state.watchdog is not None:
        state.watchdog.stop(wait_s=1.0)
    try:
        _write_the_end(state, signum)
    finally:
        batch_engine.stop(state.engine)


def _write_the_end(state: _Run, signum: int | None) -> None:
    script = state.script
    job = getattr(script, "job", None)
    writer = state.writer
    if writer is None and state.folder is not None and state.options.run_dir is not None:
        writer = RankFolder(jf.rank_folder(state.folder, state.rank), state.rank)  # no step
    if writer is None:
        return
    try:
        writer.flush(timeout=-1 if signum is None else 1.0)
        if writer.opened and job is not None and job.info_now() != job.info:
            writer.write_header(job.info_now(), _rank_meta(state, job), state.options.started)
    except Exception as e:  # noqa: BLE001 - the outcome is still worth writing
        _say(f"could not finish rank {state.rank}'s records: {e!r}")
    step = job.step_count if job is not None else 0
    writer.write_outcome(_outcome(script, step, signum))


def _outcome(script, step: int, signum: int | None) -> dict:
    if signum is not None:
        return {"kind": "killed", "code": signum, "step": step, "time": time.time()}
    o = getattr(script, "outcome", None)
    if o is None:
        return {"kind": "failed", "step": step, "ename": "unknown", "time": time.time()}
    found = asdict(o)
    for name in ("file", "line"):
        found.pop(name, None)
    return {**found, "step": step, "time": time.time()}


def _on_term(state: _Run, signum: int) -> None:
    """SIGTERM (torchrun stops the other ranks when one failed): records flushed, the
    outcome said, then the process ends by the signal, as it would have. In a process the
    script forked (a DataLoader worker, which inherits the handler), only the latter."""
    if state.term is not None:
        state.term.handled()
    try:
        if os.getpid() == state.pid:
            _finish(state, signum)
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _end_as_the_script(script) -> int:
    """The exit code the script's process would have had; a SystemExit or an exception
    of the script's ends this process the same way."""
    e = script.exception
    if e is None:
        o = script.outcome
        return 0 if o is None or o.code is None else int(o.code)
    if isinstance(e, SystemExit):
        raise SystemExit(e.code)
    tb = e.__traceback__
    here = os.path.abspath(sys.modules[type(script).__module__].__file__ or "")
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next
    e.__traceback__ = tb  # (Python's hook prints the exception's own traceback)
    sys.stdout.flush()
    try:
        sys.excepthook(type(e), e, tb)
    except Exception:  # noqa: BLE001 - as Python does when its hook fails
        traceback.print_exception(type(e), e, tb)
    if isinstance(e, KeyboardInterrupt):  # Python ends by the signal: 130 in a shell
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return 1


# --- the job folder -------------------------------------------------------------------------


def _claim(state: _Run) -> None:
    """``--run-dir`` given: refuse one holding this rank's records of an earlier job;
    rank 0 writes ``job.json``."""
    assert state.folder is not None
    folder = jf.rank_folder(state.folder, state.rank)
    if (folder / "trace.json").exists() or (folder / jf.OUTCOME_FILE).exists():
        raise RunDirInUse(
            f"{state.folder} already holds rank {state.rank}'s records of an earlier job: "
            "give another --run-dir, or leave it out for a new folder under "
            f"${RUNS_DIR_ENV} (default runs/)"
        )
    if state.rank == 0:
        state.folder.mkdir(parents=True, exist_ok=True)
        _write_job(state)


def _agree_folder(state: _Run) -> Path:
    """The default job folder: made by rank 0, its name passed to the others through the
    process group's store (no collective); a job without one names it by TORCHELASTIC_RUN_ID."""
    import torch.distributed as dist

    if state.world > 1 and dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        if state.rank == 0:
            folder = _new_job_folder(state)
            store.set(FOLDER_KEY, str(folder))
            return folder
        return Path(store.get(FOLDER_KEY).decode())
    if state.world > 1:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if run_id and run_id != "none":
            folder = _base() / f"{Path(state.options.script).stem}-{run_id}"
            folder.mkdir(parents=True, exist_ok=True)
            if state.rank == 0:
                _write_job(state, folder)
            return folder
        _say(f"rank {state.rank} has no process group: its records go to a folder of its own")
    return _new_job_folder(state)


def _base() -> Path:
    return Path(os.environ.get(RUNS_DIR_ENV) or "runs").absolute()


def _new_job_folder(state: _Run) -> Path:
    stem = Path(state.options.script).stem
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(state.options.started))
    base = _base()
    for k in range(1000):
        folder = base / (f"{stem}-{stamp}" if k == 0 else f"{stem}-{stamp}-{k}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        _write_job(state, folder)
        return folder
    raise FileExistsError(f"no free job folder name under {base}")


def _write_job(state: _Run, folder: Path | None = None) -> None:
    options = state.options
    folder = folder or state.folder
    assert folder is not None
    jf.write_json(
        folder / jf.JOB_FILE,
        {
            "format": jf.FORMAT,
            "created": options.started,
            "world_size": state.world,
            "script": os.path.abspath(options.script),
            "argv": list(options.argv),
            "cwd": os.getcwd(),
            "record": options.record,
            "hang_timeout_s": options.hang_timeout_s,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "other",
        },
    )


def _rank_meta(state: _Run, job) -> dict:
    """What the rank's header keeps beside its JobInfo: how it was launched (RankInfo),
    its fingerprints before step 1, its host's cores."""
    from dtlab.agent.identity import _num_cpus

    meta: dict = {"script": os.path.abspath(state.options.script), "rank": state.rank}
    try:
        meta["rank_info"] = asdict(_rank_info(state, job))
        meta["num_cpus"] = _num_cpus()
    except Exception as e:  # noqa: BLE001 - the environment check says "not checked"
        _say(f"rank {state.rank} could not describe its launch: {e!r}")
    if job.initial is not None:
        meta["initial"] = asdict(job.initial)
    return meta


def _rank_info(state: _Run, job):
    import torch.distributed as dist

    from dtlab.agent.identity import describe_rank
    from dtlab.records import RankPlan

    up = dist.is_available() and dist.is_initialized()
    plan = RankPlan(
        rank=state.rank,
        world_size=state.world,
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        master_addr=os.environ.get("MASTER_ADDR", ""),
        master_port=_env_int("MASTER_PORT", 0),
        backend=str(dist.get_backend()) if up else "none",
        cuda_device=None,
        num_threads=0,
        timeout_s=0.0,
    )
    return describe_rank(plan, str(job.device), -1)  # -1: the launch's sum, not checked here


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else default


def _shown(folder: Path) -> str:
    try:
        return os.path.relpath(folder)
    except ValueError:
        return str(folder)


def _say(text: str) -> None:
    print(f"dtlab.run: {text}", file=sys.__stderr__ or sys.stderr, flush=True)

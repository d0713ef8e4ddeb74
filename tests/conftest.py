"""Shared fixtures for tests that start real ipyparallel clusters.

Every process-starting test has a hard timeout (pytest-timeout) and cleans up: a live
session is reused across tests (relaunching an idle one takes milliseconds), and
whatever session is left is shut down at the end, checked by pid.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell

import dtlab
from dtlab.agent.threads import common_threads
from dtlab.control import lifecycle
from dtlab.control.cluster import running
from dtlab.control.rankmap import threads_per_rank


def quiet(phase, done, total):
    pass


def needs(problem: str | None, required_by: str = "DTLAB_REQUIRE_LAUNCHERS"):
    """A skip mark saying what is missing, or, where ``$required_by`` is 1 (CI), a failure:
    CI installs what these tests drive, so a skip there would hide a broken install."""
    if problem and os.environ.get(required_by) == "1":
        pytest.fail(f"{problem} (required here: {required_by}=1)", pytrace=False)
    return pytest.mark.skipif(problem is not None, reason=problem or "")


def rank_threads(session) -> int:
    """The thread count every rank of ``session`` computes at (one count, or an error)."""
    return common_threads({r: i.num_threads for r, i in session.infos.items()})


def default_threads(ranks_on_host: int) -> int:
    """The thread count a default launch gives each rank on this machine."""
    return threads_per_rank(None, len(os.sched_getaffinity(0)), ranks_on_host)


def pytest_configure(config):
    """Ctrl-C is KeyboardInterrupt here, as in a notebook kernel, even when the suite was
    started in the background of a non-interactive shell: that starts it with SIGINT
    ignored, Python then leaves it ignored, and so does every process the tests start (an
    ignored signal stays ignored across exec). The tests that press Ctrl-C would see
    nothing happen."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # DeepSpeed builds its CPU ops on first use, under one lock per build folder; the
    # default folder (~/.cache) is shared by every virtual environment, and two of them
    # (two clones) rebuild it in turn for their own include paths. One folder per venv
    # path (a venv reached through a symlink from a second checkout builds with other
    # include paths: its own folder too), inherited by the ranks and by torchrun.
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, f"torch_extensions-{key}")
    )


BUILD_TIMEOUT_S = 1500  # DeepSpeed's two CPU ops, compiled once per venv (minutes)
TIMING_FINDINGS = ("straggler",)  # kinds that judge how fast ranks are


def untimed(findings):
    """The findings about correctness, without those about speed (a straggler, a rank
    waiting for data): on a machine other jobs share, one rank can really be slower for a
    while, whatever the script does. Tests that a healthy script is clean use this; the
    timing checks are tested on their own, with planted slow ranks."""
    return [
        f
        for f in findings
        if f.kind not in TIMING_FINDINGS and not f.summary.startswith("waiting for data")
    ]


# torch 2.13's gloo can abort a process that ends with a process group still alive (held
# by DDP, say) after its script finished: a gloo worker thread frees the last allreduce
# work, its tensors' decref takes the GIL while Python finalizes, the thread is unwound
# through a noexcept destructor and std::terminate aborts the process (read from a core
# dump: ProcessGroupGloo::runLoop > ~AsyncAllreduceWork > gil_scoped_acquire >
# PyThread_exit_thread). It is torch's, under plain torchrun as under dtlab, and struck 8
# runs in 25 of a 4-rank DDP script on this machine under load; the runs are
# deterministic, so a run that ends so is run again.
GLOO_TEARDOWN = "terminate called without an active exception"
TEARDOWN_TRIES = 6


def gloo_teardown_abort(done: subprocess.CompletedProcess, log_dir=None) -> bool:
    """Whether a failed torchrun run is the abort above (in its stderr, or in the ranks'
    own stderr logs under ``log_dir`` when it ran with ``--redirects``)."""
    if done.returncode == 0:
        return False
    if GLOO_TEARDOWN in (done.stderr or ""):
        return True
    logs = [] if log_dir is None else Path(log_dir).glob("*/attempt_*/*/stderr.log")
    return any(GLOO_TEARDOWN in log.read_text(errors="replace") for log in logs)


def run_torchrun(cmd: list, timeout: float, log_dir=None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` of a torchrun command, again while it ends in gloo's
    teardown abort (at most TEARDOWN_TRIES runs); the last run is returned either way."""
    for _ in range(TEARDOWN_TRIES):
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
        if not gloo_teardown_abort(done, log_dir):
            return done
    return done


def signal_when_exists(paths, pid: int, sig: int, timeout: float = 300) -> threading.Thread:
    """Send ``sig`` to ``pid`` once ``paths`` (one or a list) all exist (ranks write them
    when they are busy). The thread's ``sent`` is True once the signal went."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)

    def wait_then_signal():
        deadline = time.monotonic() + timeout
        while not all(map(os.path.exists, paths)) and time.monotonic() < deadline:
            time.sleep(0.02)
        if all(map(os.path.exists, paths)):
            os.kill(pid, sig)
            thread.sent = True  # type: ignore[attr-defined]

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.sent = False  # type: ignore[attr-defined]
    thread.start()
    return thread


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="session", autouse=True)
def runs_dir(tmp_path_factory):
    """Run folders (traces) go to a temporary directory, not the working tree."""
    folder = tmp_path_factory.mktemp("runs")
    os.environ["DTLAB_RUNS_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def cluster_cleanup():
    yield
    session = lifecycle._current
    if session is not None and not session.closed:
        pids = session.pids()
        session.shutdown()
        assert running(pids) == [], "processes left after the last test"


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed's CPU ops (the shared-memory comm op every rank builds in
    init_distributed, and the CPU Adam that "AdamW" in a ds_config uses), built once
    before the tests that run DeepSpeed, in the venv's own folder (TORCH_EXTENSIONS_DIR,
    set above): without it the first test's ranks would all wait on one rank's compile."""
    build = (
        "from deepspeed.accelerator import get_accelerator\n"
        "for name in ('ShareMemCommBuilder', 'FusedAdamBuilder'):\n"
        "    get_accelerator().create_op_builder(name).load()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", build], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def ip():
    """An IPython shell with the extension loaded, driven as a notebook would drive it."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dtlab")
    return shell


@pytest.fixture
def live2(cluster_cleanup):
    """A healthy 2-rank session (reused if the last test left one, else started)."""
    return dtlab.launch(2, progress=quiet)


@pytest.fixture
def live4(cluster_cleanup):
    """A healthy 4-rank session (reused if the last test left one, else started)."""
    return dtlab.launch(4, progress=quiet)


@pytest.fixture
def no_leftovers(cluster_cleanup):
    """Fails the test if it leaves any process of its own running (dtlab's or not)."""
    before = child_pids()
    yield
    current = lifecycle._current
    keep = set(current.pids()) if current is not None and not current.closed else set()
    left = running(sorted(child_pids() - before - keep))
    assert left == [], f"processes left behind: {left}"

"""SIGTERM while the main thread waits in a C call that never returns (as a rank blocked in
a collective does): the watch's thread writes what the handler would have and the process
ends by the signal; a SIGTERM to a process forked from it is not taken for its own.

A real process each time; its main thread blocks in ``pthread_mutex_lock`` on a mutex it
already holds (a wait that signals do not end, like gloo's and NCCL's)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mutex"),
]

PROGRAM = textwrap.dedent(
    """
    import ctypes, os, signal, sys, time
    from dtlab.agent.late_signal import SignalWatch

    said = sys.argv[1]

    def write(text):
        with open(said, "a") as f:
            f.write(text + "\\n")

    def handler(signum, frame):
        watch.handled()
        write(f"handler {os.getpid() == parent}")
        os._exit(3)

    parent = os.getpid()
    signal.signal(signal.SIGTERM, handler)
    watch = SignalWatch(signal.SIGTERM, handler, lambda s: write(f"stuck {s}"), grace_s=0.05)
    assert watch.start()
    ready, up = os.pipe()
    child = os.fork()
    if child == 0:  # a worker the script forked, stopped by SIGTERM: its own handler runs
        os.write(up, b"up")
        time.sleep(120)  # (ends by itself, should the test fail)
        os._exit(0)
    os.read(ready, 2)  # (a signal before the child's Python is up is dropped by Python)
    os.kill(child, signal.SIGTERM)
    os.waitpid(child, 0)
    if sys.argv[2:] == ["theirs"]:  # the script's own handler, installed after dtlab's
        signal.signal(signal.SIGTERM, lambda signum, frame: write("theirs"))
    mutex = ctypes.create_string_buffer(64)  # zeroed: glibc's default mutex
    libc = ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    print("blocking on", ctypes.addressof(mutex), flush=True)
    libc.pthread_mutex_lock(mutex)  # never returns; the GIL is released
    write("returned")
    """
)


def blocked(proc: subprocess.Popen) -> None:
    """Wait until the program's main thread waits on its mutex (its futex call's first
    argument, read from /proc): a signal sent before would find it in Python."""
    assert proc.stdout is not None
    said = proc.stdout.readline().split()
    assert said[:2] == ["blocking", "on"], said
    address = int(said[2])
    deadline = time.monotonic() + 60
    syscall = Path(f"/proc/{proc.pid}/task/{proc.pid}/syscall")
    while True:
        fields = syscall.read_text().split()
        if len(fields) > 1 and fields[1].startswith("0x") and int(fields[1], 16) == address:
            return
        assert time.monotonic() < deadline, f"never blocked on its mutex: {fields}"
        time.sleep(0.01)


def test_sigterm_while_blocked_in_a_c_call_is_handled_by_the_watch(tmp_path):
    said = tmp_path / "said.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(said)], stdout=subprocess.PIPE, text=True
    )
    try:
        blocked(proc)
        # the child's SIGTERM (taken by the child's handler) is not the parent's: the
        # parent lives on well past the watch's grace
        with pytest.raises(psutil.TimeoutExpired):
            psutil.Process(proc.pid).wait(timeout=2)
        assert said.read_text().splitlines() == ["handler False"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # by the signal, as it would have
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    # the handler never ran in the parent; the watch did its work instead
    assert said.read_text().splitlines() == ["handler False", f"stuck {signal.SIGTERM}"]


def test_a_handler_the_script_installed_after_dtlab_is_left_to_run_when_it_can(tmp_path):
    """torchtitan and HF Trainer install their own SIGTERM handlers (a checkpoint on
    preemption): the watch must not end the process in their stead."""
    said = tmp_path / "said.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(said), "theirs"], stdout=subprocess.PIPE, text=True
    )
    try:
        blocked(proc)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(psutil.TimeoutExpired):  # well past the watch's grace
            psutil.Process(proc.pid).wait(timeout=2)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert said.read_text().splitlines() == ["handler False"]  # the child's only


def test_a_wakeup_fd_set_by_another_is_left_alone():
    program = textwrap.dedent(
        """
        import signal, socket
        from dtlab.agent.late_signal import SignalWatch

        theirs, _ = socket.socketpair()
        theirs.setblocking(False)
        signal.set_wakeup_fd(theirs.fileno())
        assert not SignalWatch(signal.SIGTERM, print, print).start()
        assert signal.set_wakeup_fd(-1) == theirs.fileno()
        print("left alone")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "left alone", done.stderr

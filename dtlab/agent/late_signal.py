"""A signal the main thread cannot take in time.

Python runs a signal's handler in the main thread, between two bytecodes. A rank whose main
thread waits inside a C call (a collective blocked in gloo or NCCL: the very hang a job is
cancelled for) runs it only when that call returns, which may be never; the launcher (or
Slurm) then kills the process with SIGKILL after its grace, and the rank's ending goes
unsaid. Python's C-level handler also writes the signal's number to the wakeup fd, from
whichever thread took the signal: :class:`SignalWatch` reads it in a thread of its own and,
when the main thread has not handled the signal within ``grace_s``, runs ``on_stuck`` there
and ends the process by the signal, as it would have ended.

A wakeup fd set by someone else (asyncio's loop in the main thread) is left alone: the watch
does not start. A process forked from this one (a DataLoader worker) drops the fd, so its
signals are not taken for the parent's.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable

_ACTIVE: list[SignalWatch] = []  # the watch of this process (the at-fork hook reads it)


class SignalWatch:
    """``handler``: the Python handler installed for ``signum`` (it calls :meth:`handled`
    first); ``on_stuck(signum)``: its work, done from the watch's thread. A handler the
    script installs later is the script's: the watch then leaves the signal to it."""

    def __init__(
        self,
        signum: int,
        handler: Callable,
        on_stuck: Callable[[int], None],
        grace_s: float = 2.0,
    ):
        self.signum = signum
        self.grace_s = grace_s
        self._handler = handler
        self._on_stuck = on_stuck
        self._handled = threading.Event()
        self._read: socket.socket | None = None
        self._write: socket.socket | None = None

    def start(self) -> bool:
        """From the main thread, with the handler installed -> whether the watch runs."""
        read, write = socket.socketpair()
        write.setblocking(False)
        try:
            previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            previous = None
        if previous != -1:  # another's fd (now restored) or none could be set
            if previous is not None:
                signal.set_wakeup_fd(previous)
            read.close()
            write.close()
            return False
        self._read, self._write = read, write
        _ACTIVE[:] = [self]
        threading.Thread(target=self._watch, name="dtlab-signal-watch", daemon=True).start()
        return True

    def handled(self) -> None:
        """The main thread took the signal (its handler calls this first)."""
        self._handled.set()

    def _watch(self) -> None:
        assert self._read is not None
        while True:
            try:
                got = self._read.recv(64)
            except OSError:
                return
            if not got:
                return
            if self.signum not in got or self._handled.wait(self.grace_s):
                continue
            if signal.getsignal(self.signum) is self._handler:  # (not the script's own)
                try:
                    self._on_stuck(self.signum)
                finally:
                    die_by(self.signum)


def die_by(signum: int) -> None:
    """End this process by ``signum``'s default action, from any thread (``signal.signal``
    is the main thread's only, so the C library's is called)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(5)
    finally:  # (the signal ends the process before this; should it not)
        os._exit(128 + signum)


def _forget_in_child() -> None:
    if not _ACTIVE:
        return
    _ACTIVE.clear()
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # (forked from a thread that is not the child's main one)
        pass


os.register_at_fork(after_in_child=_forget_in_child)

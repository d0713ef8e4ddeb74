"""Wait for per-rank requests without ever hanging the notebook.

One request per rank is in flight (an ipyparallel AsyncResult each). ``gather`` returns
``{rank: value}`` when all succeed, and otherwise raises one error that names the ranks:

- an exception on some ranks is reported a short grace period after the first one, not
  when the slowest rank finishes (a rank waiting in a collective for a failed peer would
  otherwise hold the cell until the process-group timeout);
- a dead engine arrives from ipyparallel's nanny within ~0.05 s as ``EngineError``;
- on failure, timeout or Ctrl-C the unfinished ranks get SIGINT, and the error says which
  stopped and which are still busy (a rank blocked in a gloo collective ignores SIGINT);
- a request the engine aborted (right after an interrupt) is sent once more;
- a Ctrl-C while the requests go out is held until all are out, then acts: one that cut
  the sending short left a rank running that nobody knew to interrupt (under load a rank
  can start, and be seen busy, before the request for the next rank has left).
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from ipyparallel.error import RemoteError, TaskAborted

from dtlab.control.errors import RankError, RankTimeoutError
from dtlab.records import RemoteFailure

POLL_S = 0.05
CHECK_EVERY_S = 0.5  # how often ``check`` (is the cluster still there?) runs while waiting
FAILURE_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks
INTERRUPT_GRACE_S = 2.0  # after SIGINT, how long to wait before calling a rank stuck

# ranks -> {rank: AsyncResult} (an ipyparallel AsyncResult is a concurrent.futures.Future)
Submit = Callable[[list[int]], Mapping[int, concurrent.futures.Future]]


def to_failure(exc: BaseException) -> RemoteFailure:
    if isinstance(exc, RemoteError):
        return RemoteFailure(exc.ename or "Error", str(exc.evalue), exc.traceback or "")
    return RemoteFailure(type(exc).__name__, str(exc))


class _Round:
    """The state of one gather: what finished, what failed, what is still out."""

    def __init__(self, submit: Submit):
        self.submit = submit
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.values: dict[int, object] = {}
        self.failures: dict[int, RemoteFailure] = {}
        self.resent: set[int] = set()
        self.resend_aborted = True

    def send(self, ranks: list[int]) -> None:
        with held_interrupts():
            self.pending.update(self.submit(ranks))

    def collect(self) -> None:
        aborted = []
        for rank, ar in list(self.pending.items()):
            if not ar.done():
                continue
            exc = ar.exception()
            if isinstance(exc, TaskAborted) and self.resend_aborted and rank not in self.resent:
                aborted.append(rank)
            elif exc is not None:
                self.failures[rank] = to_failure(exc)
            else:
                self.values[rank] = ar.result()
            del self.pending[rank]
        if aborted:  # at once: the other ranks may be waiting for these in a collective
            self.resent.update(aborted)
            self.send(aborted)

    def wait(self, timeout: float) -> None:
        if self.pending and timeout > 0:
            concurrent.futures.wait(
                list(self.pending.values()),
                timeout=timeout,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        self.collect()


def gather(
    submit: Submit,
    ranks: list[int],
    *,
    what: str,
    timeout: float | None = None,
    interrupt: Callable[[list[int]], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    check: Callable[[], None] | None = None,
) -> dict[int, object]:
    """Run ``submit(ranks)`` and wait as described in the module docstring.

    ``check`` is called every CHECK_EVERY_S while waiting and may raise to give up (the
    controller died: no reply will ever come).
    """
    state = _Round(submit)
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure = None
    reason = None
    last_check = time.monotonic()
    try:
        state.send(ranks)
        while state.pending:
            now = time.monotonic()
            if check is not None and now - last_check >= CHECK_EVERY_S:
                last_check = now
                check()
            if deadline is not None and now >= deadline:
                reason = f"timed out after {timeout:g} s"
                break
            state.wait(POLL_S if deadline is None else min(POLL_S, deadline - now))
            if progress:
                progress(len(ranks) - len(state.pending), len(ranks))
            if state.failures and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > FAILURE_GRACE_S:
                break
    except KeyboardInterrupt:
        reason = "interrupted"
    unfinished = list(state.pending)
    stuck = _interrupt(state, interrupt)
    ranks_after = dict(
        finished=[r for r in state.values if r not in unfinished],
        stopped=[r for r in unfinished if r not in stuck],
        stuck=stuck,
    )
    if reason is not None:
        raise RankTimeoutError(what, reason, state.failures, **ranks_after)
    if state.failures:
        raise RankError(what, state.failures, **ranks_after)
    return dict(sorted(state.values.items()))


def _interrupt(state: _Round, interrupt) -> list[int]:
    """SIGINT what is still out, wait a little; return the ranks that did not stop."""
    if not state.pending or interrupt is None:
        return list(state.pending)
    state.resend_aborted = False
    try:
        interrupt(list(state.pending))
    except Exception:  # a dead engine cannot be signalled; it is reported as stuck
        pass
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while state.pending and time.monotonic() < deadline:
        state.wait(POLL_S)
    return sorted(state.pending)


@contextmanager
def counted_interrupts() -> Iterator[list[int]]:
    """Inside the block Ctrl-C (SIGINT) only counts the presses (``presses[0]``), so a
    message being sent or read is never cut in half. Off the main thread there is no
    Ctrl-C to count."""
    presses = [0]
    if threading.current_thread() is not threading.main_thread():
        yield presses
        return

    def count(signum, frame):
        presses[0] += 1

    old = signal.signal(signal.SIGINT, count)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def held_interrupts() -> Iterator[None]:
    """A Ctrl-C inside the block is raised as KeyboardInterrupt when the block ends."""
    with counted_interrupts() as presses:
        yield
    if presses[0]:
        raise KeyboardInterrupt

"""The rank end of the stepping channel: steps on command, paused together, reported live.

Why a channel of its own: one ipyparallel call to 8 engines costs ~20 ms here, a bare zmq
round trip well under 1 ms (docs/design.md), and a step of the demo job is tens of ms. The
socket is served by a ``ZMQStream`` on the engine's own main-thread event loop, so steps
run on the main thread *between* ipyparallel requests, never beside a ``%%dt`` cell.

Protocol: the typed messages of :mod:`dtlab.records.wire` (a ``RunRequest`` or a
``PauseRequest`` in; ``RankReply`` frames out: hello, progress, done or error), one JSON
frame each, every frame carrying the session ``key``.

Ranks stay in step: every ``agree_every`` steps of a run (every step when a condition is
watched; spaced by the cadence in :mod:`dtlab.records.wire`, the notebook's too) all
ranks all-reduce (MAX) one small tensor ``[pause asked, condition met, a rank failed,
fingerprint, -fingerprint]`` on a gloo group of their own, so every rank stops after the
same step, and "diverged" means the fingerprints were not all equal.
"""

from __future__ import annotations

import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dtlab.agent import job as jobs
from dtlab.agent.groups import control_group
from dtlab.agent.jobs_base import RankJob
from dtlab.agent.state import RANK
from dtlab.analysis.conditions import condition_holds
from dtlab.records import Condition, RemoteFailure, StepRecord
from dtlab.records.packed import pack
from dtlab.records.wire import (
    PauseRequest,
    RankReply,
    ReplyKind,
    RunRequest,
    decode_request,
    frames,
    identity,
    key_token,
    next_agree_every,
)

AGREE_AFTER_ERROR_S = 5.0  # a failed rank waits this long for peers at the step boundary
AGREE_POLL_S = 0.0005  # polling the agreement keeps SIGINT deliverable


def serve(
    address: str, key: str, rank: int, relay: int | None = None, upstream: str | None = None
) -> int:
    """Connect this rank to the notebook's channel (replacing an older connection).
    Called on every rank at once, so the control group is made here (a collective).
    ``relay``: the rank whose relay this host's ranks reach the notebook through (this
    rank runs it if it is that rank; :mod:`dtlab.agent.relay`); None: straight.
    ``upstream``: where this rank's relay sends up, a group relay's address (None: the
    notebook; a group relay opened by :func:`open_group_relay` for this channel is kept)."""
    opened = RANK.relay if _opened_for(key, rank) else None
    stop_serving(keep_relay=opened is not None)
    control_group(rebuild=True)
    if relay == rank and opened is None:
        from dtlab.agent.relay import Relay

        RANK.relay = Relay(upstream or address, key, rank)
    if relay is not None:
        from dtlab.agent.relay import local_address

        address = local_address(key, relay)
    RANK.step_server = StepServer(address, key, rank)
    return jobs.attach_count()


def open_group_relay(address: str, key: str, rank: int) -> str:
    """Start this rank's host relay as a group relay (other hosts' relays send up through
    it; :func:`serve` keeps it); returns the address they connect to."""
    from dtlab.agent.relay import Relay

    stop_serving()
    relay = RANK.relay = Relay(address, key, rank, listen=True)
    assert relay.remote is not None  # (listen=True binds one)
    return relay.remote


def _opened_for(key: str, rank: int) -> bool:
    relay = RANK.relay
    return (
        relay is not None
        and relay.key == key
        and relay.rank == rank
        and bool(relay.remote)
        and relay.alive()
    )


def stop_serving(keep_relay: bool = False) -> None:
    if RANK.step_server is not None:
        RANK.step_server.close()
        RANK.step_server = None
    if RANK.relay is not None and not keep_relay:
        RANK.relay.close()
        RANK.relay = None


def _combined_fingerprint(rec: StepRecord) -> int:
    # halved so that -fp fits in int64 too (hash() may return -2**63)
    return hash((rec.grad_fingerprint, rec.param_fingerprint)) >> 1


@dataclass(frozen=True)
class Agreement:
    pause: bool = False  # some rank was asked to pause
    hit: bool = False  # the condition held on some rank
    failed: bool = False  # some rank failed in this step
    differ: bool = False  # the ranks' fingerprints are not all equal
    step_s: float = 0.0  # the slowest rank's seconds per step since the last agreement


def agree(
    pause: bool,
    hit: bool,
    fp: int,
    *,
    failed: bool = False,
    seq: int = 0,
    timeout_s: float | None = None,
    step_s: float = 0.0,
) -> Agreement:
    """What all ranks say together (one all-reduce). ``seq`` numbers the agreement: ranks
    that disagree on it are out of step (RuntimeError). The wait polls, so SIGINT can break
    it; with ``timeout_s`` a rank stops waiting for peers (TimeoutError). ``step_s``: this
    rank's seconds per step since the last agreement; every rank gets the slowest's."""
    import torch.distributed as dist

    group = control_group()
    if group is None:
        return Agreement(pause, hit, failed)
    flags = torch.tensor(
        [int(pause), int(hit), int(failed), fp, -fp, seq, -seq, int(step_s * 1e6)],
        dtype=torch.int64,
    )
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not work.is_completed():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"peers did not reach the step boundary within {timeout_s:g} s")
        time.sleep(AGREE_POLL_S)
    work.wait()  # raises the collective's own error, if it had one
    some_pause, some_hit, some_failed, top, neg_bottom, seq_top, neg_seq_bottom, us = flags.tolist()
    if seq_top != -neg_seq_bottom:
        raise RuntimeError(
            "ranks are out of step in their agreements (a leftover of a failed run); the "
            "notebook rebuilds their control group before the next run"
        )
    return Agreement(
        bool(some_pause), bool(some_hit), bool(some_failed), top != -neg_bottom, us / 1e6
    )


@contextmanager
def _interruptible():
    """The engine ignores SIGINT outside its own requests; let it interrupt a run."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@dataclass
class _RunState:
    """One run command as this rank works through it."""

    msg_id: int
    steps: int
    until: Condition | None
    agree_every: int
    report_s: float
    record: bool = True
    pending: list = field(default_factory=list)
    stopped: str = "steps"
    hit: bool = False
    index: int = 0  # the iteration being worked on
    agreed_at: int = -1  # the last iteration whose agreement this rank entered
    next_at: int = -1  # the iteration of the next agreement (in a plain run)

    def __post_init__(self):
        self.next_at = self.agree_every - 1

    @classmethod
    def from_request(cls, req: RunRequest) -> _RunState:
        return cls(req.id, req.steps, req.until, req.agree_every, req.report_s)

    def must_agree(self, index: int) -> bool:
        """The same answer on every rank (it depends on the message only)."""
        if self.until is not None:
            return True  # stop exactly at the step the condition held
        return index < self.steps - 1 and index == self.next_at

    def agreed(self, index: int, step_s: float) -> None:
        """After the agreement at ``index``: the next one twice as many steps later, up to
        about AGREE_S later by the step time every rank was told (the cadence both ends
        share: :func:`dtlab.records.wire.next_agree_every`)."""
        self.agree_every = next_agree_every(self.agree_every, step_s)
        self.next_at = index + self.agree_every

    def seq(self, index: int) -> int:
        return self.msg_id * 2**24 + index

    def next_agreement(self) -> int | None:
        """The iteration at which the peers next agree, seen from a rank that failed now."""
        start = self.index + 1 if self.agreed_at == self.index else self.index
        if self.until is not None:
            return start if start < self.steps else None
        return self.next_at if start <= self.next_at <= self.steps - 2 else None


def _check_condition(state: _RunState) -> None:
    until = state.until
    if until is not None and until.kind in ("diverged", "nonfinite") and not state.record:
        raise ValueError(
            f"--until {until.kind} reads the gradient fingerprints and counts: "
            "turn recording on (leave out --no-record)"
        )


class StepServer:
    """A DEALER socket (identity = rank) on the engine's event loop."""

    def __init__(self, address: str, key: str, rank: int):
        import zmq
        from zmq.eventloop.zmqstream import ZMQStream

        self.key = key
        self.token = key_token(key)  # names, not the secret
        self.rank = rank
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity(rank))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.stream = ZMQStream(self.socket)
        self.stream.on_recv(self._on_message)
        self._send(ReplyKind.HELLO, None)

    def close(self) -> None:
        self.stream.close()

    def _send(self, kind: ReplyKind, msg_id, **fields) -> None:
        import zmq

        reply = RankReply(kind, msg_id, self.rank, **fields)
        try:  # never block the engine on a notebook that went away
            self.socket.send_multipart(frames(reply, self.key), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _on_message(self, frames) -> None:
        msg = decode_request(frames[-1], self.key)  # None: not from our notebook, ignored
        if isinstance(msg, RunRequest):
            self._run(msg)
        # a pause that arrives between runs is stale: nothing to pause

    def _pause_asked(self) -> bool:
        import zmq

        asked = False
        while self.socket.poll(0, zmq.POLLIN):
            msg = decode_request(self.socket.recv(), self.key)
            asked = asked or isinstance(msg, PauseRequest)
        return asked

    # --- one run -----------------------------------------------------------------------
    def _run(self, msg: RunRequest) -> None:
        job, state = None, None
        try:
            state = _RunState.from_request(msg)
            if msg.regroup:
                control_group(rebuild=True)  # the last run ended in an error
            job = jobs.current()
            state.record = job.record if msg.record is None else msg.record
            _check_condition(state)
            watch = msg.watch or (state.until is not None and state.until.kind == "nonfinite")
            job.watch_modules(watch)
            job.record_outputs(msg.outputs)
            try:
                with _interruptible():
                    self._loop(job, state)
            finally:
                job.watch_modules(False)
                job.record_outputs(False)
            self._report(ReplyKind.DONE, state, job, stopped=state.stopped, hit=state.hit)
        except BaseException as e:  # KeyboardInterrupt too: it must not reach the event loop
            self._fail(e, job, state, msg.id)

    def _loop(self, job: RankJob, state: _RunState) -> None:
        last_report = last_agreed = time.monotonic()
        for index in range(state.steps):
            state.index = index
            try:
                rec = job.step(state.record)
            except jobs.JobEnded:  # a script job whose script is over: a clean stop
                state.stopped = "ended"
                return
            state.pending.append(rec)
            if job.autosave is not None and job.step_count % job.autosave[1] == 0:
                from dtlab.agent.checkpoint import save  # every rank: the same step

                save(job.autosave[0], f"auto-{self.token}-{state.msg_id}", tag="auto")
            state.hit = condition_holds(state.until, rec)
            if state.must_agree(index):
                pause = self._pause_asked()
                now = time.monotonic()
                step_s = (now - last_agreed) / (index - state.agreed_at)
                state.agreed_at = index
                said = agree(
                    pause,
                    state.hit,
                    _combined_fingerprint(rec),
                    seq=state.seq(index),
                    step_s=step_s,
                )
                state.agreed(index, said.step_s)
                last_agreed = now
                met = said.hit
                if state.until is not None and state.until.kind == "diverged":
                    state.hit = met = said.differ
                if said.failed or met or said.pause:
                    state.stopped = "error" if said.failed else "until" if met else "pause"
                    return
            elif state.hit:
                state.stopped = "until"
                return
            first = index == 0 < state.steps - 1  # at once (not in a one-step run: done says
            # it): a rank that dies a few steps later has said where it was
            if first or time.monotonic() - last_report >= state.report_s:
                self._report(ReplyKind.PROGRESS, state, job)
                last_report = time.monotonic()

    def _fail(self, e: BaseException, job, state: _RunState | None, msg_id) -> None:
        """Say what went wrong first, then meet the peers at the step boundary where they
        next agree (bounded), so they stop there too instead of waiting for this rank."""
        pending = state.pending if state is not None else []
        error = RemoteFailure(
            getattr(e, "ename", type(e).__name__),  # a script's
            str(e),
            getattr(e, "script_traceback", None) or traceback.format_exc(),
        )
        self._send(
            ReplyKind.ERROR,
            msg_id,
            step=job.step_count if job is not None else 0,
            attach=jobs.attach_count(),
            rows=self._rows(pending),
            error=error,
            output=_output_of(job),
        )
        at = state.next_agreement() if state is not None else None
        if at is None:
            return  # no peer will wait for this rank in an agreement
        try:
            with _interruptible():
                agree(
                    False, False, 0, failed=True, seq=state.seq(at), timeout_s=AGREE_AFTER_ERROR_S
                )
        except BaseException:
            pass  # peers are elsewhere (e.g. in DDP's all-reduce); the notebook regroups

    def _rows(self, records: list[StepRecord]) -> bytes:
        return pack(self.rank, [r.summary() for r in records]).to_bytes() if records else b""

    def _report(self, kind: ReplyKind, state: _RunState, job, **fields) -> None:
        rows, state.pending = self._rows(state.pending), []
        self._send(
            kind,
            state.msg_id,
            step=job.step_count,
            attach=jobs.attach_count(),
            rows=rows,
            output=_output_of(job),
            **fields,
        )


def _output_of(job: RankJob | None) -> str:
    """What a script job printed since the last reply (other jobs print nothing here)."""
    return job.take_output() if job is not None else ""

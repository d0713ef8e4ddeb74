"""The rank end of the stepping channel: steps on command, paused together, reported live.

Why a channel of its own: one ipyparallel call to 8 engines costs ~18 ms here, a bare zmq
round trip ~0.4 ms (FACTS.md), and a step of the demo job is tens of ms. The socket is
served by a ``ZMQStream`` on the engine's own main-thread event loop, so steps run on the
main thread *between* ipyparallel requests, never at the same time as a ``%%dt`` cell.

Protocol, one JSON frame per message, every message carries the session ``key``:

- notebook -> rank: ``{"op": "run", "id", "steps", "until": {"kind", "value"} | null,
  "record": bool | null, "report_s"}`` and ``{"op": "pause"}``;
- rank -> notebook: ``{"kind": "hello" | "progress" | "done" | "error", "id", "rank",
  "step", "attach", "records": [one steps.jsonl line per StepRecord], "stopped": "steps" | "until" |
  "pause", "hit": bool, "error": {"ename", "evalue", "traceback"}}``.

Ranks stay in step: after every step of a multi-step run all ranks all-reduce (MAX) one
small tensor ``[pause asked, condition met, fingerprint, -fingerprint]`` on a gloo group of
their own, so every rank stops after the same step, and "diverged" means the ranks'
fingerprints were not all equal.
"""

from __future__ import annotations

import json
import math
import signal
import time
import traceback
from contextlib import contextmanager

import torch

from dtlab.agent import job as jobs
from dtlab.records import Condition, StepRecord, step_record_to_dict

_server: StepServer | None = None
_control: dict = {}  # {"world": the default group it was made for, "group": gloo group}


def serve(address: str, key: str, rank: int) -> int:
    """Connect this rank to the notebook's channel (replacing an older connection)."""
    global _server
    if _server is not None:
        _server.close()
    _server = StepServer(address, key, rank)
    return jobs.attach_count()


def stop_serving() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def condition_holds(cond: Condition | None, rec: StepRecord) -> bool:
    """Does this rank's step meet ``cond``? ("diverged" is decided across ranks instead.)"""
    if cond is None or cond.kind == "diverged":
        return False
    if cond.kind == "step":
        return rec.step >= cond.value
    if cond.kind == "loss_above":
        return rec.loss > cond.value
    if cond.kind == "loss_below":
        return rec.loss < cond.value
    if cond.kind == "nonfinite":
        return not math.isfinite(rec.loss) or rec.num_nonfinite > 0
    raise ValueError(f"unknown condition kind {cond.kind!r}")


def _combined_fingerprint(rec: StepRecord) -> int:
    """One signed 64-bit number for all of a step's fingerprints (ints hash the same in
    every process, unlike str)."""
    return hash((rec.grad_fingerprint, rec.param_fingerprint))


def _control_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _control.get("world") is not dist.group.WORLD:  # the process group was rebuilt
        _control["world"] = dist.group.WORLD
        _control["group"] = dist.new_group(backend="gloo")  # CPU tensors, NCCL jobs too
    return _control["group"]


def agree(pause: bool, hit: bool, fp: int) -> tuple[bool, bool, bool]:
    """(someone asked to pause, condition met on some rank, fingerprints differ)."""
    import torch.distributed as dist

    group = _control_group()
    if group is None:
        return pause, hit, False
    flags = torch.tensor([int(pause), int(hit), fp, -fp], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    some_pause, some_hit, top, neg_bottom = flags.tolist()
    return bool(some_pause), bool(some_hit), top != -neg_bottom


@contextmanager
def _interruptible():
    """The engine ignores SIGINT outside its own requests; let it interrupt a run."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class StepServer:
    """A DEALER socket (identity = rank) on the engine's event loop."""

    def __init__(self, address: str, key: str, rank: int):
        import zmq
        from zmq.eventloop.zmqstream import ZMQStream

        self.key = key
        self.rank = rank
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.stream = ZMQStream(self.socket)
        self.stream.on_recv(self._on_message)
        self._send("hello", None)

    def close(self) -> None:
        self.stream.close()

    def _send(self, kind: str, msg_id, **fields) -> None:
        reply = {"key": self.key, "kind": kind, "id": msg_id, "rank": self.rank, **fields}
        self.socket.send(json.dumps(reply).encode())

    def _read(self) -> dict | None:
        try:
            msg = json.loads(self.socket.recv())
        except ValueError:
            return None
        return msg if isinstance(msg, dict) and msg.get("key") == self.key else None

    def _on_message(self, frames) -> None:
        try:
            msg = json.loads(frames[-1])
        except ValueError:
            return
        if not isinstance(msg, dict) or msg.get("key") != self.key:
            return  # not from our notebook: never act on it
        if msg.get("op") == "run":
            self._run(msg)
        # a "pause" that arrives between runs is stale: nothing to pause

    def _pause_asked(self) -> bool:
        import zmq

        asked = False
        while self.socket.poll(0, zmq.POLLIN):
            msg = self._read()
            asked = asked or (msg is not None and msg.get("op") == "pause")
        return asked

    def _run(self, msg: dict) -> None:
        msg_id = msg.get("id")
        steps = int(msg.get("steps", 1))
        until = Condition(**msg["until"]) if msg.get("until") else None
        report_s = float(msg.get("report_s", 0.25))
        record = msg.get("record")
        pending: list[StepRecord] = []
        job = None
        try:
            job = jobs.current()
            if until is not None and until.kind == "diverged" and not (record or job.record):
                raise ValueError("--until diverged compares fingerprints: turn recording on")
            must_agree = steps > 1 or (until is not None and until.kind == "diverged")
            stopped, hit, last_report = "steps", False, time.monotonic()
            with _interruptible():
                for _ in range(steps):
                    rec = job.step(record)
                    pending.append(rec)
                    hit = condition_holds(until, rec)
                    if must_agree:
                        pause, any_hit, differ = agree(
                            self._pause_asked(), hit, _combined_fingerprint(rec)
                        )
                        if until is not None and until.kind == "diverged":
                            hit = any_hit = differ
                        if any_hit or pause:
                            stopped = "until" if any_hit else "pause"
                            break
                    elif hit:
                        stopped = "until"
                        break
                    if time.monotonic() - last_report >= report_s:
                        self._report("progress", msg_id, job, pending)
                        pending, last_report = [], time.monotonic()
            self._report("done", msg_id, job, pending, stopped=stopped, hit=hit)
        except BaseException as e:  # KeyboardInterrupt too: it must not reach the event loop
            self._send(
                "error",
                msg_id,
                step=job.step_count if job is not None else 0,
                attach=jobs.attach_count(),
                records=self._lines(pending),
                error={
                    "ename": type(e).__name__,
                    "evalue": str(e),
                    "traceback": traceback.format_exc(),
                },
            )

    def _lines(self, records: list[StepRecord]) -> list[str]:
        return [json.dumps(step_record_to_dict(self.rank, r.summary())) for r in records]

    def _report(self, kind: str, msg_id, job, pending, **fields) -> None:
        self._send(
            kind,
            msg_id,
            step=job.step_count,
            attach=jobs.attach_count(),
            records=self._lines(pending),
            **fields,
        )

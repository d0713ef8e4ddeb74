"""A thread on every rank that says what the rank is doing, even while it is stuck.

A rank blocked in a collective, a sleep or a long computation cannot answer through its
engine (the main thread is busy); this daemon thread can, because gloo and NCCL waits,
sleeps and most torch kernels release the GIL (and a pure-Python loop yields it every few
ms). On request it sends, out of band:

- the main thread's Python stack (file, line, function, code);
- the last collectives of each process group from torch's Flight Recorder (enabled by
  ``TORCH_FR_BUFFER_SIZE``, which the rendezvous sets): sequence number, op, input sizes,
  and whether it completed;
- the attached job's step counter.

Protocol: its own DEALER socket (identity = rank) to the notebook's ROUTER; the messages
are typed in :mod:`dtlab.records.wire`: a ``ReportRequest`` in, a ``SidecarHello`` on
connecting and a ``SidecarReport`` (stack, collectives, step) for each request out.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback

from dtlab.agent.state import RANK
from dtlab.records.wire import (
    Message,
    SidecarHello,
    SidecarReport,
    decode_report_request,
    encode,
    identity,
)

KEEP_PER_GROUP = 6  # collectives reported per process group (the last ones)
POLL_MS = 200


def start(address: str, key: str, rank: int) -> None:
    """Start (or restart, for a new notebook channel) this rank's sidecar thread."""
    old = RANK.sidecar
    if old is not None:
        old.stopping.set()
        old.join(timeout=2)
    sidecar = Sidecar(address, key, rank, threading.main_thread().ident)
    sidecar.watermark = _last_record_id()  # entries of groups this rank had before
    RANK.sidecar = sidecar
    sidecar.start()


class Sidecar(threading.Thread):
    def __init__(self, address: str, key: str, rank: int, main_ident: int):
        super().__init__(name="dtlab-sidecar", daemon=True)
        self.address, self.key, self.rank, self.main_ident = address, key, rank, main_ident
        self.stopping = threading.Event()
        self.watermark = -1

    def run(self) -> None:
        import zmq

        socket = zmq.Context.instance().socket(zmq.DEALER)  # made here: owned by this thread
        socket.setsockopt(zmq.IDENTITY, identity(self.rank))
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        try:
            self._send(socket, SidecarHello(self.rank))
            while not self.stopping.is_set():
                if socket.poll(POLL_MS, zmq.POLLIN):
                    self._answer(socket, socket.recv())
        finally:
            socket.close()

    def _answer(self, socket, frame: bytes) -> None:
        request = decode_report_request(frame, self.key)
        if request is None:
            return  # not from our notebook: never act on it
        try:
            found = report(self.main_ident, self.watermark)
            answer = SidecarReport(request.id, self.rank, **found)
        except Exception as e:  # say so, and stay alive for the next question
            answer = SidecarReport(request.id, self.rank, error=f"{type(e).__name__}: {e}")
        self._send(socket, answer)

    def _send(self, socket, message: Message) -> None:
        import zmq

        try:
            socket.send(encode(message, self.key), zmq.NOBLOCK)
        except zmq.Again:
            pass


def report(main_ident: int, watermark: int = -1) -> dict:
    frame = sys._current_frames().get(main_ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    return {
        "stack": [[f.filename, f.lineno, f.name, f.line or ""] for f in stack],
        "collectives": collectives(watermark),
        "step": _step(),
    }


def _step() -> int | None:
    job = RANK.job  # once: the main thread may attach another meanwhile
    return job.step_count if job is not None else None


def _entries() -> list[dict]:
    """Flight Recorder entries: gloo's (and CPU's) generic recorder, plus NCCL's own."""
    import torch._C._distributed_c10d as c10d

    entries = json.loads(c10d._dump_fr_trace_json()).get("entries", [])
    if hasattr(c10d, "_dump_nccl_trace_json"):  # a CUDA build: NCCL records on its own
        entries += json.loads(c10d._dump_nccl_trace_json()).get("entries", [])
    return entries


def _last_record_id() -> int:
    try:
        return max((int(e.get("record_id", -1)) for e in _entries()), default=-1)
    except Exception:
        return -1


def _live_groups() -> dict[str, list[int]]:
    """``{group name: member ranks}`` of the process groups that exist now (a group
    replaced since, such as an old control group, is left out with its stale entries)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if not dist.is_initialized():
        return {}
    from dtlab.agent.groups import retired_groups

    return {
        name: dist.get_process_group_ranks(pg)
        for pg, name in _world.pg_names.items()
        if name not in retired_groups()
    }


def collectives(watermark: int = -1) -> list[dict]:
    """The last collectives of every live process group, oldest first (empty without a
    Flight Recorder); entries older than ``watermark`` belong to groups of an earlier
    launch on this engine."""
    try:
        entries, groups = _entries(), _live_groups()
    except Exception:  # no process group yet, or a torch without the recorder
        return []
    by_group: dict[str, list[dict]] = {}
    for e in entries:
        name, desc = (list(e.get("process_group", ["?", "?"])) + ["?"])[:2]
        if e.get("is_p2p") or name not in groups or int(e.get("record_id", 0)) <= watermark:
            continue
        by_group.setdefault(name, []).append(
            {
                "group": desc if desc not in ("", "undefined") else f"group {name}",
                "group_id": name,
                "members": groups[name],
                "seq": int(e.get("collective_seq_id", 0)),
                "op": str(e.get("profiling_name", "?")).split(":")[-1],
                "sizes": e.get("input_sizes", []),
                "dtypes": e.get("input_dtypes", []),
                "done": bool(e.get("retired")),
            }
        )
    return [call for calls in by_group.values() for call in calls[-KEEP_PER_GROUP:]]

"""The notebook end of the stepping channel: one ROUTER socket, ranks connect to it.

It carries two protocols: the stepping channel's (rank end :mod:`dtlab.agent.stepping`,
messages typed in :mod:`dtlab.records.wire`) and the sidecars' (:mod:`dtlab.agent.sidecar`).
Messages are JSON objects with a random session key (a stepping reply may add one frame of
packed step records, :mod:`dtlab.records.packed`): nothing received is unpickled or
executed, and a message without the key is dropped; what a reply means is its protocol's.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterable

import zmq

from dtlab.records.wire import Request


class Channel:
    """Send commands to ranks by rank number; receive their replies (JSON objects)."""

    def __init__(self, host: str = "127.0.0.1", advertised: str | None = None):
        """Listen on ``host`` ("*": every interface); ranks connect to ``advertised``."""
        self.key = secrets.token_hex(16)
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown rank -> error, not a drop
        port: int = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertised or host}:{port}"
        self.connected: set[int] = set()
        self._lock = threading.Lock()  # a zmq socket must not be used by two threads at once

    def send(self, ranks: Iterable[int], message: Request | dict) -> list[int]:
        """Send to each rank; returns the ranks it could not reach (not connected)."""
        payload = message if isinstance(message, dict) else message.to_dict()
        frame = json.dumps({"key": self.key, **payload}).encode()
        unreachable = []
        with self._lock:
            for rank in ranks:
                try:
                    self.socket.send_multipart([str(rank).encode(), frame], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.append(rank)
        return unreachable

    def receive(self, timeout: float) -> list[dict]:
        """Every reply that arrives within ``timeout`` s (returns early once one came).

        Holds the socket's lock while it waits: another thread's ``send`` (a pause) waits
        at most ``timeout``; zmq sockets must never be used by two threads at once."""
        return [reply for reply, _ in self.receive_with_rows(timeout)]

    def receive_with_rows(self, timeout: float) -> list[tuple[dict, bytes]]:
        """As :meth:`receive`, each reply with the frame of packed step records that came
        after its JSON (b"" when none did; the stepping channel's replies carry them)."""
        messages = []
        with self._lock:
            if self.socket.poll(int(timeout * 1000), zmq.POLLIN):
                while self.socket.poll(0, zmq.POLLIN):
                    messages.append(self.socket.recv_multipart())
        replies = []
        for parts in messages:
            if len(parts) not in (2, 3):  # identity, JSON, maybe rows
                continue
            try:
                reply = json.loads(parts[1])
            except ValueError:
                continue
            if not isinstance(reply, dict) or reply.get("key") != self.key:
                continue  # not from one of our ranks
            if reply.get("kind") == "hello" and isinstance(reply.get("rank"), int):
                self.connected.add(reply["rank"])
            else:
                replies.append((reply, parts[2] if len(parts) == 3 else b""))
        return replies

    def wait_connected(self, ranks: Iterable[int], timeout: float) -> set[int]:
        """Wait for each rank's hello; returns the ranks that never said it."""
        missing = set(ranks) - self.connected
        deadline = time.monotonic() + timeout
        while missing and time.monotonic() < deadline:
            self.receive(0.05)
            missing -= self.connected
        return missing

    def close(self) -> None:
        self.socket.close()

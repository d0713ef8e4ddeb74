"""The notebook end of the stepping channel: one ROUTER socket, ranks connect to it.

The rank end is :mod:`dtlab.agent.stepping`; the messages are :mod:`dtlab.records.wire`'s.
They are JSON and carry a random session key: nothing received is unpickled or executed,
and a message without the key is dropped.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable

import zmq

from dtlab.records.wire import RankReply, Request, decode_reply, encode


class Channel:
    """Send commands to ranks by rank number; receive their typed replies."""

    def __init__(self, host: str = "127.0.0.1", advertised: str | None = None):
        """Listen on ``host`` ("*": every interface); ranks connect to ``advertised``."""
        self.key = secrets.token_hex(16)
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown rank -> error, not a drop
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertised or host}:{port}"
        self.connected: set[int] = set()
        self._lock = threading.Lock()  # a zmq socket must not be used by two threads at once

    def send(self, ranks: Iterable[int], message: Request) -> list[int]:
        """Send to each rank; returns the ranks it could not reach (not connected)."""
        frame = encode(message, self.key)
        unreachable = []
        with self._lock:
            for rank in ranks:
                try:
                    self.socket.send_multipart([str(rank).encode(), frame], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.append(rank)
        return unreachable

    def receive(self, timeout: float) -> list[RankReply]:
        """Every reply that arrives within ``timeout`` s (returns early once one came).

        Holds the socket's lock while it waits: another thread's ``send`` (a pause) waits
        at most ``timeout``; zmq sockets must never be used by two threads at once."""
        frames = []
        with self._lock:
            if self.socket.poll(int(timeout * 1000), zmq.POLLIN):
                while self.socket.poll(0, zmq.POLLIN):
                    frames.append(self.socket.recv_multipart()[-1])
        replies = []
        for frame in frames:
            reply = decode_reply(frame, self.key)  # None: not from one of our ranks
            if reply is not None and reply.kind == "hello":
                self.connected.add(reply.rank)
            elif reply is not None:
                replies.append(reply)
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

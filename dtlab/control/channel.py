"""The notebook end of the stepping channel: one ROUTER socket, ranks connect to it.

It carries two protocols, both typed, encoded and read by :mod:`dtlab.records.wire`: the
stepping channel's (rank end :mod:`dtlab.agent.stepping`) and the sidecars'
(:mod:`dtlab.agent.sidecar`).
Ranks connect straight to it, or through their host's relay (:mod:`dtlab.agent.relay`):
the channel learns each rank's route from its hello, then sends a command once per relay
(naming its ranks: :func:`~dtlab.records.wire.addressed`) and takes a relay's message apart
(:func:`~dtlab.records.wire.read_relayed`): its replies, and one frame of their packed rows
(:class:`~dtlab.records.wire.HostRows`) to be read in one pass.
Messages are JSON objects with a random session key (a stepping reply may add one frame of
packed step records, :mod:`dtlab.records.packed`): nothing received is unpickled or
executed, and a message without the key is dropped; what a reply means is its protocol's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import NamedTuple

import zmq

from dtlab.records.wire import (
    MAX_RECEIVED,
    RECEIVE_AT_MOST,
    DoneGroup,
    Envelope,
    HostRows,
    Message,
    Relayed,
    ReplyKind,
    addressed,
    encode,
    identity,
    naming,
    new_key,
    read_direct,
    read_relayed,
)


class Received(NamedTuple):
    """What :meth:`Channel.receive_with_rows` got."""

    replies: list[tuple[dict, bytes]]  # each reply, with the packed rows sent after it
    rows: list[HostRows]  # relayed hosts' rows, one frame per relay's message
    done: list[DoneGroup]  # relayed hosts' plain done replies, as columns


class Channel:
    """Send commands to ranks by rank number; receive their replies (JSON objects)."""

    def __init__(self, host: str = "127.0.0.1", advertised: str | None = None):
        """Listen on ``host`` ("*": every interface); ranks connect to ``advertised``."""
        self.key = new_key()
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown rank -> error, not a drop
        # a larger frame is no rank's (records/wire.py: MAX_FRAME): refused from its header
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_RECEIVED)
        port: int = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertised or host}:{port}"
        self.connected: set[int] = set()
        self.routes: dict[int, bytes] = {}  # rank -> the identity of its host's relay
        self.relayed: dict[bytes, set[int]] = {}  # a relay's identity -> the ranks it relays
        # (ranks sent to, the routes then) -> (ranks sent straight, each relay's "to" suffix)
        self._sends: tuple[tuple, dict, list[int], dict[bytes, tuple[list[int], bytes]]] | None
        self._sends = None
        self._lock = threading.Lock()  # a zmq socket must not be used by two threads at once

    def send(self, ranks: Iterable[int], message: Message) -> list[int]:
        """Send a message of :mod:`dtlab.records.wire` to each rank (once per relay for
        relayed ranks, naming them); returns the ranks it could not reach (not connected,
        or their relay is gone)."""
        frame = encode(message, self.key)
        direct, relayed = self._routes_of(tuple(ranks))
        unreachable = []
        with self._lock:
            for rank in direct:
                try:
                    self.socket.send_multipart([identity(rank), frame], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.append(rank)
            for route, (targets, names) in relayed.items():  # the frame, its ranks named
                try:
                    self.socket.send_multipart([route, addressed(frame, names)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.extend(targets)
        return unreachable

    def _routes_of(
        self, ranks: tuple[int, ...]
    ) -> tuple[list[int], dict[bytes, tuple[list[int], bytes]]]:
        """The ranks sent to straight, and each relay's ranks with the JSON that names them
        (worked out again only when the ranks or their routes changed)."""
        if self._sends is not None and self._sends[0] == ranks and self._sends[1] == self.routes:
            return self._sends[2], self._sends[3]
        direct: list[int] = []
        targets: dict[bytes, list[int]] = {}
        for rank in ranks:
            route = self.routes.get(rank)
            if route is None:
                direct.append(rank)
            else:
                targets.setdefault(route, []).append(rank)
        relayed = {route: (mine, naming(mine)) for route, mine in targets.items()}
        self._sends = (ranks, dict(self.routes), direct, relayed)
        return direct, relayed

    def receive(self, timeout: float) -> list[dict]:
        """Every reply that arrives within ``timeout`` s (returns early once one came),
        relayed hosts' plain done replies (DoneGroups) included, each as its reply.

        Holds the socket's lock while it waits: another thread's ``send`` (a pause) waits
        at most ``timeout``; zmq sockets must never be used by two threads at once."""
        got = self.receive_with_rows(timeout)
        groups = [
            {"key": self.key, **reply.to_dict()} for group in got.done for reply in group.replies()
        ]
        return [reply for reply, _ in got.replies] + groups

    def receive_with_rows(self, timeout: float) -> Received:
        """As :meth:`receive`, each reply with the frame of packed step records that came
        after its JSON (b"" when none did; the stepping channel's replies carry them), the
        rows of relayed hosts' replies, one frame per relay's message, and their plain done
        replies as DoneGroups."""
        # each message checked as it is read: only those with the session key are kept, and
        # a receive reads RECEIVE_AT_MOST at most (the rest wait in zmq for the next one)
        messages: list[tuple[bytes, Relayed | Envelope]] = []
        with self._lock:
            if self.socket.poll(int(timeout * 1000), zmq.POLLIN):
                for _ in range(RECEIVE_AT_MOST):
                    if not self.socket.poll(0, zmq.POLLIN):
                        break
                    route, *body = self.socket.recv_multipart()  # (identity, then frames)
                    read = read_relayed(body, self.key) or read_direct(body, self.key)
                    if read is not None:
                        messages.append((route, read))
        got = Received([], [], [])
        replies = got.replies
        for route, read in messages:
            if isinstance(read, Relayed):
                if read.joined:
                    self._take_joined(route, read, got)
                else:  # (BATCH) each reply as its rank sent it
                    for reply in read.replies:
                        self._take(reply.data, reply.rows, route, replies)
            else:
                self._take(read.data, read.rows, None, replies)
        return got

    def _take_joined(self, route: bytes, relayed: Relayed, got: Received) -> None:
        kept = len(got.replies)
        for reply in relayed.replies:
            self._take(reply.data, b"", route, got.replies)
        ranks = {reply["rank"] for reply, _ in got.replies[kept:]}
        for group in relayed.done or ():
            if (group := group.only(self.relayed.get(route, ()))).ranks:
                got.done.append(group)
                ranks.update(group.ranks)
        if relayed.rows:  # kept for the ranks whose replies were taken (and only those)
            got.rows.append(HostRows(frozenset(ranks), relayed.rows))

    def _take(
        self, reply: dict, rows: bytes, route: bytes | None, replies: list[tuple[dict, bytes]]
    ) -> None:
        """A reply whose key was checked: a hello sets the rank's route; anything else is
        kept, unless a relay sent it for a rank that is not its own."""
        rank = reply.get("rank")
        if reply.get("kind") == ReplyKind.HELLO and isinstance(rank, int):
            self.connected.add(rank)
            before = self.routes.pop(rank, None)
            if before is not None:
                self.relayed[before].discard(rank)
            if route is not None:
                self.routes[rank] = route
                self.relayed.setdefault(route, set()).add(rank)
        elif isinstance(rank, int) and (route is None or self.routes.get(rank) == route):
            replies.append((reply, rows))

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

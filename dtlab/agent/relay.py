"""One connection to the notebook per host: the host's first rank relays for the others.

At hundreds of ranks the notebook's cost of a step is mostly per message: each command is
sent rank by rank and each reply received on its own. With relays (jobs of at least
``DTLAB_RELAY_AT`` ranks, 64 by default) the notebook sends a command once per host and
gets a finished run's replies back as one message per host (progress replies are held
only while a finished reply of the run is: otherwise they go up at once). Each reply
inside is still checked and handed to its run in Python: relays save the sends and
receives, not that.

A relay is a thread of the host's lowest rank with two sockets:

- up: a DEALER connected to the notebook's Channel (identity ``relay:<rank>``);
- down: a ROUTER on ``ipc://<tmp>/dtlab-<token>-<rank>.sock`` that the host's ranks
  (itself included) connect their stepping sockets to, exactly as they would to the
  notebook: a rank does not know whether it is relayed.

Down: a command names its ranks (``"to"``); the relay forwards it to each. A rank it
cannot reach (its socket is gone: a killed engine) comes back as an ``unreachable`` reply,
so the run stops waiting for it as it would for a rank the notebook could not send to.

Up: replies travel joined, ``[b"DTRJ", json, rows]``: the JSON lists the replies (each
checked for the session key here, and sent without it; plain ``done`` replies, nearly all
of them, as columns: a DoneGroup per run, its ranks and their steps), and ``rows`` is one frame of
packed records, every reply's rows rank after rank (records.packed.concat), so the notebook
parses one JSON object and reads one frame a host. It checks the message's key, takes
only replies of ranks this relay serves (their hello came through it), and keeps the rows of
those ranks alone. If a rank's rows are not a valid frame (or a reply names no rank),
the message goes as ``[b"DTRB", json, rows, json, rows, ...]`` instead, each reply's frames as
the rank sent them, and the notebook reports the bad rows as it does for an unrelayed rank.
A ``done`` or ``error`` reply is held until every local rank of that run has sent one, or for
HOLD_S at most (a dead rank does not hold up the others); everything else goes at once
with whatever else is waiting. What is held goes up before it would pass JOIN_BUDGET
(records/wire.py), so no joined message is larger than the notebook's socket takes.

A *group relay* (``listen=True``; control/relays.py says which) is a host relay that other
hosts' relays send up through, over TCP on the address it reaches the notebook from
(:attr:`Relay.remote`). To them it is the notebook; to the notebook it is one relay whose
ranks are all theirs. It learns which relay serves a rank from the hello that came through
it, forwards a command to each relay naming that relay's ranks, and joins their JOINED
messages (replies, done groups, rows) with its own ranks' into one: a run's replies wait
until every rank of the group finished, or GROUP_HOLD_S. A relay's message it cannot join
(rows that are not a frame of that relay's ranks) goes up on its own, with only the
replies of that relay's ranks and its rows as they came: the notebook keeps those ranks'
rows alone and says whose it drops.

Every message here is built and read by :mod:`dtlab.records.wire` (the protocol's one
home): a relay forwards the replies of its ranks as they parsed, and the replies it makes
itself (``unreachable``, RelayError) are typed :class:`~dtlab.records.wire.RankReply`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
import traceback
from urllib.parse import urlsplit

from dtlab.records.packed import Frame, concat, read_frame
from dtlab.records.ranks import RemoteFailure
from dtlab.records.wire import (
    ENDS,
    FINISHED,
    JOIN_BUDGET,
    MAX_FRAME,
    MAX_RECEIVED,
    RECEIVE_AT_MOST,
    DoneGroup,
    Envelope,
    RankReply,
    ReplyKind,
    addressees,
    batch_message,
    checked,
    done_groups,
    identity,
    is_relay,
    joined_message,
    key_token,
    merged_groups,
    plain_done,
    read_direct,
    read_relayed,
    readdressed,
    relay_identity,
    relay_reply,
    run_of,
    unkeyed,
)

HOLD_S = 0.05  # a finished run's replies wait this long at most for the host's other ranks
# ... and in a group relay for the group's other ranks: 8 hosts finish further apart than one
# host's ranks, and the wait costs a run nothing while a rank is still stepping (the run
# ends with its last rank); only a rank that never replies (dead) holds the others back
GROUP_HOLD_S = 0.5
HEARTBEAT_MS = 2000  # TCP links between hosts: a silent peer is dropped after 5 of these
POLL_MS = 50  # how often the thread looks at its stop flag


def local_address(key: str, relay_rank: int) -> str:
    """The ipc endpoint of ``relay_rank``'s relay (the same on every rank of its host)."""
    return f"ipc://{tempfile.gettempdir()}/dtlab-{key_token(key)}-{relay_rank}.sock"


class Relay:
    """The relay thread of one host (see the module's description)."""

    def __init__(self, upstream: str, key: str, rank: int, *, listen: bool = False):
        """``upstream``: the notebook's channel, or the group relay's :attr:`remote`;
        ``listen``: be a group relay (other hosts' relays connect to :attr:`remote`)."""
        import zmq  # (the agent layer imports zmq only where it is used)

        self.key, self.rank = key, rank
        self.remote: str | None = None
        self.local = local_address(key, rank)
        context = zmq.Context.instance()
        self.up = context.socket(zmq.DEALER)
        self.up.setsockopt(zmq.IDENTITY, relay_identity(rank))
        self.up.setsockopt(zmq.LINGER, 0)
        self.up.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)  # a peer gone without a word
        self.up.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * HEARTBEAT_MS)  # (its host down): dropped
        # frames larger than any legitimate one (records/wire.py: MAX_FRAME) are refused from
        # their header, their sender disconnected: a rank's reply down here, a relay's
        # joined message (within JOIN_BUDGET, or one rank's reply re-framed) from other hosts
        self.up.setsockopt(zmq.MAXMSGSIZE, MAX_RECEIVED)
        self.down = context.socket(zmq.ROUTER)
        self.down.setsockopt(zmq.LINGER, 0)
        self.down.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a rank gone -> an error, not a drop
        self.down.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self._path = self.local.removeprefix("ipc://")
        # a group relay's: other hosts' relays (a socket of its own: no identity of theirs
        # can shadow a local rank's)
        self.hosts = context.socket(zmq.ROUTER) if listen else None
        try:
            self.down.bind(self.local)  # (libzmq replaces a stale file of a killed relay)
            if self.hosts is not None:  # on the interface this host reaches the notebook by
                self.hosts.setsockopt(zmq.LINGER, 0)
                self.hosts.setsockopt(zmq.MAXMSGSIZE, MAX_RECEIVED)
                self.hosts.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a relay gone: unreachable
                self.hosts.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
                self.hosts.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * HEARTBEAT_MS)
                ip = facing_ip(upstream)
                self.remote = f"tcp://{ip}:{self.hosts.bind_to_random_port(f'tcp://{ip}')}"
            self.up.connect(upstream)
        except (zmq.ZMQBaseError, OSError) as e:
            for sock in (self.up, self.down, self.hosts):
                if sock is not None:
                    sock.close()
            where = f"{self.local} and TCP" if listen else self.local
            raise RuntimeError(
                f"rank {rank} could not start its host's relay at {where}: {e} "
                "(a TMPDIR path too long for a socket? set TMPDIR shorter on the ranks)"
            ) from e
        self._stop = threading.Event()
        self._waiting: dict[int, set[int]] = {}  # run id -> local ranks not finished yet
        self._held: list[Envelope] = []  # replies not sent up yet
        self._held_runs: set[int] = set()  # runs with a finished reply among them
        self._held_since = 0.0
        self._held_bytes = 0  # the frames' bytes of what is held (within JOIN_BUDGET)
        self._ranks: set[int] = set()  # the ranks that said hello (through it or a relay)
        self._via: dict[int, bytes] = {}  # a rank behind another host's relay -> that relay
        # held from other hosts' relays' joined messages: replies (without the key), rows
        # (checked frames) and done groups
        self._joined: list[dict] = []
        self._frames: list[Frame] = []
        self._groups: list[DoneGroup] = []
        self._thread = threading.Thread(target=self._serve, name="dtlab-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the thread --------------------------------------------------------------------
    def _serve(self) -> None:
        import zmq  # (the agent layer imports zmq only where it is used)

        poller = zmq.Poller()
        poller.register(self.up, zmq.POLLIN)
        poller.register(self.down, zmq.POLLIN)
        if self.hosts is not None:
            poller.register(self.hosts, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._timeout_ms()))
                if self.up in events:
                    self._from_notebook()
                if self.down in events:
                    self._from_ranks()
                if self.hosts is not None and self.hosts in events:
                    self._from_hosts()
                if self._holding() and self._ready():
                    self._send_up()
        except Exception as e:  # a bug here must not leave the host's ranks silent
            self._fail(e)
        finally:
            self.up.close(linger=1000)  # a failure's report still goes out
            self.down.close()
            if self.hosts is not None:
                self.hosts.close()
            with contextlib.suppress(FileNotFoundError):  # (the notebook's close may have)
                os.unlink(self._path)

    def _fail(self, error: Exception) -> None:
        """Say the relay failed, as an error reply of each rank a run still waits for
        (of every local rank when none does), so the notebook's run ends naming it
        instead of waiting."""
        failure = RemoteFailure(
            "RelayError",
            f"the relay of rank {self.rank}'s host failed: {error!r}; "
            "the next run connects the ranks again with new relays",
            traceback.format_exc(),
        )
        runs = [(run, ranks) for run, ranks in self._waiting.items() if ranks] or [(None, set())]
        self._held += [
            relay_reply(RankReply(ReplyKind.ERROR, run, rank, error=failure), self.key)
            for run, ranks in runs
            for rank in sorted(ranks if run is not None else self._ranks)
        ]
        self._send_up()

    def _hold_s(self) -> float:
        return HOLD_S if self.hosts is None else GROUP_HOLD_S

    def _holding(self) -> bool:
        return bool(self._held or self._joined or self._frames or self._groups)

    def _timeout_ms(self) -> int:
        if not self._holding():
            return POLL_MS
        left = self._held_since + self._hold_s() - time.monotonic()
        return max(0, min(POLL_MS, int(left * 1000) + 1))

    def _from_notebook(self) -> None:
        import zmq  # (the agent layer imports zmq only where it is used)

        while self.up.poll(0, zmq.POLLIN):
            parts = self.up.recv_multipart()
            data = checked(parts[-1], self.key)
            if data is None:
                continue  # not from our notebook
            targets, run = addressees(data), run_of(data)
            if run is not None:  # one run at a time: older ones are over
                self._waiting = {run: set(targets)}
            unreachable = []
            relayed: dict[bytes, list[int]] = {}
            for rank in targets:
                if (via := self._via.get(rank)) is not None:
                    relayed.setdefault(via, []).append(rank)
                    continue
                try:
                    self.down.send_multipart([identity(rank), parts[-1]], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.append(rank)
            for via, ranks in relayed.items():  # the command, naming that relay's ranks
                try:
                    assert self.hosts is not None  # (only a group relay learns such routes)
                    self.hosts.send_multipart([via, readdressed(data, ranks)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    unreachable.extend(ranks)
            for rank in unreachable:  # (sent at once: the run's other ranks are stepping)
                reply = relay_reply(RankReply(ReplyKind.UNREACHABLE, run, rank), self.key)
                self._hold(reply, rank, run, finished=False)
                self._waiting.get(run, set()).discard(rank)

    def _from_ranks(self) -> None:
        import zmq  # (the agent layer imports zmq only where it is used)

        for _ in range(RECEIVE_AT_MOST):  # (a flood of strangers' does not starve the rest)
            if not self.down.poll(0, zmq.POLLIN):
                break
            _, *body = self.down.recv_multipart()  # identity, json, maybe rows
            if (reply := read_direct(body, self.key)) is None:
                continue
            data = reply.data
            run, rank, kind = data.get("id"), data.get("rank"), data.get("kind")
            finished = kind in ENDS and type(run) is int and type(rank) is int
            if kind == ReplyKind.HELLO and type(rank) is int:
                self._ranks.add(rank)
                self._via.pop(rank, None)  # a local rank now
            self._hold(reply, rank, run, finished)

    def _from_hosts(self) -> None:
        import zmq  # (the agent layer imports zmq only where it is used)

        assert self.hosts is not None  # (polled only when there is one)
        for _ in range(RECEIVE_AT_MOST):
            if not self.hosts.poll(0, zmq.POLLIN):
                break
            via, *body = self.hosts.recv_multipart()  # identity, JOINED or BATCH, ...
            if is_relay(via):
                self._from_relay(via, body)

    def _from_relay(self, via: bytes, body: list[bytes]) -> None:
        """Another host's relay's message: held to be joined, its hellos giving its ranks'
        route; one this cannot join goes up on its own (:meth:`_forward`)."""
        relayed = read_relayed(body, self.key)
        if relayed is None:
            return  # not from one of our relays
        if not relayed.joined:  # (BATCH) each reply as its rank sent it
            if self._holding():  # (rare) its rows must not come up before those held
                self._send_up()
            for reply in relayed.replies:
                self._relayed(via, reply)
            return
        done = relayed.done
        if done is None:
            return  # not from one of our relays
        # (without the key, as they are held to be joined)
        replies = [r.data for r in relayed.replies if type(r.data.get("rank")) is int]
        for data in replies:  # hellos first: the rows below may be of ranks new here
            if data.get("kind") == ReplyKind.HELLO:
                self._via[data["rank"]] = via
                self._ranks.add(data["rank"])
        try:
            joined = read_frame(relayed.rows) if relayed.rows else None
            theirs = {p.rank for p in joined.parts} if joined is not None else set()
            theirs |= {r for g in done for r in g.ranks} | {d["rank"] for d in replies}
            if any(self._via.get(r) != via for r in theirs):
                raise ValueError("rows or replies of ranks that relay does not serve")
        except ValueError:
            self._forward(via, relayed.rows, replies, done)
            return
        self._within_budget(sum(map(len, body)))
        self._start_holding()
        for data in replies:
            self._joined.append(data)
            if data.get("kind") in FINISHED and type(data.get("id")) is int:
                self._finished(data["id"], (data["rank"],))
        if joined is not None:
            self._start_holding()
            self._frames.append(joined)
        for group in done:
            self._start_holding()
            self._groups.append(group)
            self._finished(group.id, group.ranks)

    def _relayed(self, via: bytes, reply: Envelope) -> None:
        """A reply another host's relay sent up (checked for the key): held as a rank's."""
        data = reply.data
        rank, run = data.get("rank"), data.get("id")
        if type(rank) is not int:
            return
        if data.get("kind") == ReplyKind.HELLO:
            self._via[rank] = via
            self._ranks.add(rank)
        elif self._via.get(rank) != via:
            return  # not one of that relay's ranks
        finished = data.get("kind") in FINISHED and type(run) is int
        self._hold(reply, rank, run, finished)

    def _forward(self, via: bytes, rows: bytes, replies: list[dict], done: list[DoneGroup]) -> None:
        """Another relay's message this cannot join (its rows are not a frame of its own
        ranks): up after what is held (replies stay in order), with only the replies and
        done groups of that relay's ranks, and its rows as they came; the notebook keeps
        the rows of those ranks alone, and says whose it drops."""
        import zmq  # (the agent layer imports zmq only where it is used)

        if self._holding():
            self._send_up()
        replies = [d for d in replies if self._via.get(d["rank"]) == via]
        theirs = {r for r, served_by in self._via.items() if served_by == via}
        done = [g for g in (g.only(theirs) for g in done) if g.ranks]
        try:
            self.up.send_multipart(joined_message(self.key, replies, done, rows), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the notebook is gone or not keeping up: its run notices the silence
        finished = [(g.id, g.ranks) for g in done] + [
            (d["id"], (d["rank"],))
            for d in replies
            if d.get("kind") in FINISHED and type(d.get("id")) is int
        ]
        for run, ranks in finished:
            if (waiting := self._waiting.get(run)) is not None:
                waiting.difference_update(ranks)

    def _start_holding(self) -> None:
        if not self._holding():
            self._held_since = time.monotonic()

    def _within_budget(self, size: int) -> None:
        """Before holding ``size`` more bytes: send up what is held if they would take it
        past JOIN_BUDGET, so that no joined message is larger than a socket takes
        (records/wire.py: MAX_FRAME); what comes alone is one rank's reply, or one relay's
        message, re-framed."""
        if self._holding() and self._held_bytes + size > JOIN_BUDGET:
            self._send_up()
        self._held_bytes += size

    def _hold(self, reply: Envelope, rank, run, finished: bool) -> None:
        self._within_budget(len(reply.frame) + len(reply.rows))
        self._start_holding()
        self._held.append(reply)
        if finished:
            self._finished(run, (rank,))

    def _finished(self, run, ranks) -> None:
        waiting = self._waiting.get(run, set())
        waiting.difference_update(ranks)
        self._held_runs.add(run)

    def _ready(self) -> bool:
        """Send now? Not while a held run's other ranks may still finish (HOLD_S)."""
        if time.monotonic() - self._held_since >= self._hold_s():
            return True
        return not any(self._waiting.get(run) for run in self._held_runs)

    def _send_up(self) -> None:
        import zmq  # (the agent layer imports zmq only where it is used)

        try:
            for message in self._messages():
                self.up.send_multipart(message, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the notebook is gone or not keeping up: its run notices the silence
        for run in self._held_runs:
            if not self._waiting.get(run):
                self._waiting.pop(run, None)
        self._held_bytes = 0
        self._held, self._held_runs, self._joined, self._frames, self._groups = (
            [],
            set(),
            [],
            [],
            [],
        )

    def _messages(self) -> list[list[bytes]]:
        """What is held as one joined message; if some rank's rows are not valid, those
        replies go as BATCH and what other relays joined as a joined message of its own."""
        try:
            return [self._message()]
        except Exception:  # (any: this must not fail) the notebook says whose rows it drops
            batch = batch_message(self._held)
            if not (self._joined or self._frames or self._groups):
                return [batch]
            self._held = []  # what other relays joined stays joined
            try:
                return [batch, self._message()]
            except Exception:  # (checked when they came: not expected) their replies still go
                self._frames, self._groups = [], []
                return [batch, self._message()]

    def _message(self) -> list[bytes]:
        """The held replies as one JOINED message (ValueError if some rows are not valid)."""
        if not all(isinstance(data.get("rank"), int) for data, _, _ in self._held):
            raise ValueError("a reply without a rank")
        with_rows = [(data["rank"], rows) for data, _, rows in self._held if rows]
        with_rows.sort(key=lambda held: held[0])  # rank after rank; stable: in order
        frames = [read_frame(rows, rank) for rank, rows in with_rows] + self._frames
        plain = [data for data, _, _ in self._held if plain_done(data)]
        replies = [unkeyed(data) for data, _, _ in self._held if not plain_done(data)]
        groups = merged_groups(done_groups(plain) + self._groups)
        rows = concat(frames) if frames else b""
        return joined_message(self.key, replies + self._joined, groups, rows)


def facing_ip(address: str) -> str:
    """This host's IP on the interface that reaches ``address`` (``tcp://host:port``; no
    packet is sent): where a group relay listens for the other hosts' relays."""
    return route_ip(urlsplit(address).hostname or "127.0.0.1")


def route_ip(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]

"""Every socket dtlab listens on is bounded to what a legitimate message can be (issue 39,
item 6), and the relays' ipc socket files do not outlive their sessions (item 9).

A stranger on the host (a real zmq socket in another process, without the session key)
sends 20 frames of 100 MB to the stepping channel, a relay's ipc socket, a group relay's
TCP socket and the sidecar channel: the listening process (this one) does not grow by
more than a small bound, and a legitimate rank's next message still arrives. A relay
joins no more than its budget into one message, so a legitimate host's many ranks are
never cut off. Socket files: a session with relays leaves none after its shutdown; a
relay killed with kill -9 leaves its file, which the next launch removes (and only it).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import zmq

from dtlab.agent import relay as relay_module
from dtlab.agent.relay import Relay, local_address
from dtlab.control import connection
from dtlab.control.channel import Channel
from dtlab.records import wire
from dtlab.records.packed import pack, read_frame
from dtlab.records.wire import RankReply, SidecarHello, encode, frames, key_token
from tests.fakes import step_record

pytestmark = pytest.mark.timeout(120)

FLOOD = 20  # frames
FLOOD_MB = 100  # each
GROWTH_MB = 80  # what the listening process may grow by (one 100 MB frame would pass it)

# the stranger: a DEALER without the key, 20 frames of 100 MB, each as its own message
STRANGER = """
import sys, time, zmq
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.setsockopt(zmq.SNDTIMEO, 2000)
socket.connect(sys.argv[1])
blob = b"x" * (int(sys.argv[3]) * 2**20)
sent = 0
for _ in range(int(sys.argv[2])):
    try:
        socket.send(blob)
        sent += 1
    except zmq.Again:
        pass
time.sleep(3)  # (the last frames are written out)
print(sent, flush=True)
"""


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def flood(address: str) -> float:
    """Run the stranger against ``address``; returns the most this process grew (MB) while
    it sent and a little after."""
    before, peak, done = rss_mb(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb() - before)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, address, str(FLOOD), str(FLOOD_MB)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = stranger.communicate(timeout=90)
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()
    time.sleep(0.5)
    done.set()
    watcher.join()
    assert stranger.returncode == 0, err[-2000:]
    return max(peak[0], rss_mb() - before)


class Rank:
    """A legitimate rank: a DEALER with the session key, identity = its rank."""

    def __init__(self, address: str, key: str, rank: int):
        self.key, self.rank = key, rank
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def say(self, kind: str, run, **fields) -> None:
        self.socket.send_multipart(frames(RankReply(kind, run, self.rank, **fields), self.key))

    def close(self) -> None:
        self.socket.close()


def got_reply(channel: Channel, rank: int, kind: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for reply in channel.receive(0.1):
            if reply.get("rank") == rank and reply.get("kind") == kind:
                return reply
    raise AssertionError(f"no {kind} reply of rank {rank} within {timeout_s} s")


def test_the_stepping_channel_holds_no_strangers_frames():
    channel = Channel()
    rank = Rank(channel.address, channel.key, 0)
    try:
        rank.say("hello", None)
        assert channel.wait_connected([0], timeout=10) == set()
        grew = flood(channel.address)
        assert grew < GROWTH_MB, f"the notebook grew by {grew:.0f} MB"
        rank.say("done", 1, step=1, stopped="steps")
        assert got_reply(channel, 0, "done")["id"] == 1
    finally:
        rank.close()
        channel.close()


def test_the_sidecar_channel_holds_no_strangers_frames():
    channel = Channel()  # (control/hangs.py's is a Channel too)
    sidecar = zmq.Context.instance().socket(zmq.DEALER)
    sidecar.setsockopt(zmq.IDENTITY, b"0")
    sidecar.setsockopt(zmq.LINGER, 0)
    sidecar.connect(channel.address)
    try:
        grew = flood(channel.address)
        assert grew < GROWTH_MB, f"the notebook grew by {grew:.0f} MB"
        sidecar.send(encode(SidecarHello(0), channel.key))
        assert channel.wait_connected([0], timeout=10) == set()
    finally:
        sidecar.close()
        channel.close()


def test_a_relays_socket_holds_no_strangers_frames():
    channel = Channel()
    relay = Relay(channel.address, channel.key, 0)
    rank = Rank(local_address(channel.key, 0), channel.key, 0)
    try:
        rank.say("hello", None)
        assert channel.wait_connected([0], timeout=10) == set()
        grew = flood(relay.local)
        assert grew < GROWTH_MB, f"the relay's process grew by {grew:.0f} MB"
        rank.say("done", 1, step=1, stopped="steps")
        assert got_reply(channel, 0, "done")["id"] == 1
        assert relay.alive()
    finally:
        rank.close()
        relay.close()
        channel.close()


def test_a_group_relays_tcp_socket_holds_no_strangers_frames():
    channel = Channel()
    group = Relay(channel.address, channel.key, 0, listen=True)
    try:
        assert group.remote is not None
        grew = flood(group.remote)
        assert grew < GROWTH_MB, f"the group relay's process grew by {grew:.0f} MB"
        assert group.alive()
    finally:
        group.close()
        channel.close()


def rows_of(rank: int, steps: int, samples: int) -> bytes:
    records = [
        step_record(step=s, rank=rank, indices=tuple(range(samples))) for s in steps_from(steps)
    ]
    return pack(rank, [r.summary() for r in records]).to_bytes()


def steps_from(n: int) -> range:
    return range(1, n + 1)


def test_a_large_legitimate_reply_passes_every_bound():
    """A rank's reply of 40 MB of rows (far more than 0.25 s of steps) arrives whole,
    straight and through a relay."""
    channel = Channel()
    relay = Relay(channel.address, channel.key, 0)
    straight = Rank(channel.address, channel.key, 1)
    relayed = Rank(local_address(channel.key, 0), channel.key, 0)
    try:
        straight.say("hello", None)
        relayed.say("hello", None)
        assert channel.wait_connected([0, 1], timeout=10) == set()
        rows = rows_of(0, 1000, 5000)
        assert 30 * 2**20 < len(rows) < wire.MAX_FRAME
        relayed.say("done", 1, step=1000, stopped="steps", rows=rows)
        straight.say("done", 1, step=1000, stopped="steps", rows=rows_of(1, 1000, 5000))
        found: dict[int, int] = {}
        deadline = time.monotonic() + 20
        while len(found) < 2 and time.monotonic() < deadline:
            got = channel.receive_with_rows(0.1)
            for reply, sent in got.replies:
                if sent:
                    found[reply["rank"]] = read_frame(sent).rows
            for host in got.rows:
                for part in read_frame(host.data).parts:
                    found[part.rank] = found.get(part.rank, 0) + part.stop - part.start
        assert found == {0: 1000, 1: 1000}
    finally:
        straight.close()
        relayed.close()
        relay.close()
        channel.close()


def test_a_relay_joins_no_more_than_its_budget(monkeypatch):
    """Four ranks' rows of ~0.6 MB each with a budget of 1 MB: more than one message,
    every row of every rank arrives."""
    monkeypatch.setattr(relay_module, "JOIN_BUDGET", 2**20)
    channel = Channel()
    relay = Relay(channel.address, channel.key, 0)
    ranks = [Rank(local_address(channel.key, 0), channel.key, r) for r in range(4)]
    try:
        for rank in ranks:
            rank.say("hello", None)
        assert channel.wait_connected(range(4), timeout=10) == set()
        for rank in ranks:
            rank.say("done", 1, step=200, stopped="steps", rows=rows_of(rank.rank, 200, 300))
        found: dict[int, int] = {}
        done: set[int] = set()
        messages = 0
        deadline = time.monotonic() + 20
        while (len(done) < 4 or sum(found.values()) < 800) and time.monotonic() < deadline:
            got = channel.receive_with_rows(0.1)
            messages += len(got.rows)
            done |= {r for group in got.done for r in group.ranks}
            done |= {reply["rank"] for reply, _ in got.replies if reply.get("kind") == "done"}
            for host in got.rows:
                assert len(host.data) <= 2**20 + 2**19
                for part in read_frame(host.data).parts:
                    found[part.rank] = found.get(part.rank, 0) + part.stop - part.start
        assert done == {0, 1, 2, 3}
        assert found == {0: 200, 1: 200, 2: 200, 3: 200}
        assert messages >= 2
    finally:
        for rank in ranks:
            rank.close()
        relay.close()
        channel.close()


def test_the_channel_keeps_no_unauthenticated_message(monkeypatch):
    """A flood of small strangers' messages: none is kept, a receive reads a bounded
    number (the rest wait in zmq), and the rank's reply still comes through."""
    from dtlab.control import channel as channel_module

    monkeypatch.setattr(channel_module, "RECEIVE_AT_MOST", 100)
    channel = Channel()
    rank = Rank(channel.address, channel.key, 0)
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(channel.address)
    try:
        rank.say("hello", None)
        assert channel.wait_connected([0], timeout=10) == set()
        for _ in range(5000):
            stranger.send(b'{"key": "wrong"}')
        time.sleep(0.5)
        assert channel.receive(1.0) == []
        assert channel.socket.poll(0, zmq.POLLIN)  # (read 100 of them: the rest wait)
        rank.say("done", 1, step=1, stopped="steps")
        assert got_reply(channel, 0, "done")["id"] == 1
    finally:
        stranger.close()
        rank.close()
        channel.close()


# --- ipc socket files -------------------------------------------------------------------
def socket_files(token: str | None = None) -> list[str]:
    folder = tempfile.gettempdir()
    prefix = f"dtlab-{token}-" if token else "dtlab-"
    return sorted(
        name for name in os.listdir(folder) if name.startswith(prefix) and name.endswith(".sock")
    )


HOLDER = """
import sys, time
from dtlab.agent.relay import Relay
relay = Relay("tcp://127.0.0.1:9", sys.argv[1], 7)
print(relay.local, flush=True)
time.sleep(600)
"""


def test_a_killed_relays_file_is_removed_at_the_next_launch_and_only_it():
    key = "k" * 32
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, key], stdout=subprocess.PIPE, text=True
    )
    live_channel = Channel()
    live = Relay(live_channel.address, live_channel.key, 3)
    other = os.path.join(tempfile.gettempdir(), f"dtlab-notours-{os.getpid()}.sock")
    try:
        assert holder.stdout is not None
        path = holder.stdout.readline().strip().removeprefix("ipc://")
        assert os.path.exists(path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert stat.S_ISSOCK(os.stat(path).st_mode)  # left behind by the kill
        with socket.socket(socket.AF_UNIX) as plain:  # a socket file of another name
            plain.bind(other)
        connection.remove_stale_sockets()
        assert not os.path.exists(path)
        assert os.path.exists(live.local.removeprefix("ipc://"))  # a live session's stays
        assert os.path.exists(other)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        live.close()
        live_channel.close()
        if os.path.exists(other):
            os.unlink(other)
    assert not os.path.exists(live.local.removeprefix("ipc://"))  # its close removed it


def test_the_socket_file_name_is_the_one_the_cleanup_knows():
    name = os.path.basename(local_address("a" * 32, 12).removeprefix("ipc://"))
    assert connection.SOCKET_NAME.fullmatch(name)


def test_closing_the_connection_removes_its_relays_files():
    """What a session's shutdown does (Stepper.reset -> Connection.close): the files of
    its channel's relays go, even when the ranks holding them leave by os._exit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "q" * 32], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        path = holder.stdout.readline().strip().removeprefix("ipc://")
        assert os.path.exists(path)
        conn = connection.Connection.__new__(connection.Connection)
        conn.channel = Channel()
        conn.channel.key = "q" * 32
        conn.close()
        assert not os.path.exists(path)
        assert socket_files(key_token("q" * 32)) == []
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_session_with_relays_leaves_no_socket_file(monkeypatch, cluster_cleanup):
    import dtlab
    from dtlab import demo
    from dtlab.control import lifecycle
    from tests.conftest import quiet

    old = lifecycle._current
    if old is not None and not old.closed:
        old.shutdown()
    monkeypatch.setenv("DTLAB_RELAY_AT", "2")
    dt = dtlab.launch(2, progress=quiet)
    try:
        demo.attach(dt)
        dt.step(2)
        token = key_token(dt.stepper.channel.key)
        assert socket_files(token), "the relay made no socket file"
    finally:
        dt.shutdown()
    assert socket_files(token) == []

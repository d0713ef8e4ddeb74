"""A host's relay (agent/relay.py) between the notebook's real Channel and ranks on real zmq
sockets: hellos give the channel each rank's route, a command goes out once per relay and
reaches each named rank, a finished run's replies come back as one message, a silent
rank holds the others back HOLD_S at most, and a rank the relay cannot reach is reported
(the run then stops waiting for it). No torch: the ranks here are DEALER sockets speaking
the stepping protocol, as agent/stepping.StepServer does."""

from __future__ import annotations

import json
import struct
import time

import pytest
import zmq

from dtlab.agent.relay import HOLD_S, Relay, local_address
from dtlab.control.channel import Channel
from dtlab.records.columns import ROW
from dtlab.records.packed import MAGIC, concat, pack, read_frame
from dtlab.records.trace import Trace
from dtlab.records.wire import (
    JOINED,
    DoneGroup,
    HostRows,
    RankReply,
    RunRequest,
    decode_request,
    frames,
    reply_from,
)
from tests.fakes import step_record

pytestmark = pytest.mark.timeout(60)


class Rank:
    """One fake rank: a DEALER on the relay's ipc endpoint, identity = its rank."""

    def __init__(self, key: str, rank: int, relay: int):
        self.key, self.rank = key, rank
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(local_address(key, relay))
        self.say("hello", None)

    def say(self, kind: str, run, **fields) -> None:
        self.socket.send_multipart(frames(RankReply(kind, run, self.rank, **fields), self.key))

    def request(self, timeout_s: float = 10.0):
        assert self.socket.poll(int(timeout_s * 1000)), f"rank {self.rank} got nothing"
        return decode_request(self.socket.recv(), self.key)

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def host():
    """A Channel, the relay of rank 0 and fake ranks 0-3 connected through it."""
    channel = Channel()
    relay = Relay(channel.address, channel.key, 0)
    ranks = [Rank(channel.key, r, 0) for r in range(4)]
    try:
        assert channel.wait_connected(range(4), timeout=10) == set()
        yield channel, relay, ranks
    finally:
        for rank in ranks:
            rank.close()
        relay.close()
        channel.close()


def replies(
    channel: Channel, want: int, timeout_s: float = 10.0, joined: list[HostRows] | None = None
) -> list[RankReply]:
    """Replies until ``want`` came (or the time is up); relayed rows go to ``joined``."""
    got: list[RankReply] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        received = channel.receive_with_rows(0.1)
        got += [r for d, rows in received.replies if (r := reply_from(d, rows))]
        got += [reply for group in received.done for reply in group.replies()]
        if joined is not None:
            joined += received.rows
    return got


def packed(rank: int, steps: range) -> bytes:
    return pack(rank, [step_record(step, rank, loss=float(rank)) for step in steps]).to_bytes()


def test_hellos_through_the_relay_give_each_rank_its_route(host):
    channel, _, _ = host
    assert channel.connected == {0, 1, 2, 3}
    assert set(channel.routes) == {0, 1, 2, 3} and set(channel.routes.values()) == {b"relay:0"}


def test_a_command_reaches_each_named_rank_once_and_the_rows_come_back_joined(host):
    channel, _, ranks = host
    assert channel.send([1, 2, 3], RunRequest(id=7, steps=2)) == []
    for rank in ranks[1:]:
        request = rank.request()
        assert isinstance(request, RunRequest) and (request.id, request.steps) == (7, 2)
    assert ranks[0].socket.poll(100) == 0  # not named: not sent
    for rank in ranks[1:]:
        rank.say("done", 7, step=2, rows=packed(rank.rank, range(1, 3)), stopped="steps")
    joined: list[HostRows] = []
    got = replies(channel, 3, joined=joined)
    assert sorted((r.rank, r.kind, r.id, r.rows) for r in got) == [
        (r, "done", 7, b"") for r in (1, 2, 3)
    ]
    assert [rows.ranks for rows in joined] == [frozenset({1, 2, 3})]  # one frame, their ranks
    trace = Trace({})
    trace.add_host(joined[0].data, joined[0].ranks)
    assert {r: [(rec.step, rec.loss) for rec in recs] for r, recs in trace.records.items()} == {
        r: [(1, float(r)), (2, float(r))] for r in (1, 2, 3)
    }


def test_rows_that_are_not_a_valid_frame_come_back_with_their_reply_as_sent(host):
    """The relay cannot join them: the batch goes as each rank sent it, and the notebook
    reports whose rows it drops, as for an unrelayed rank."""
    channel, _, ranks = host
    channel.send([1, 2], RunRequest(id=8, steps=1))
    for rank in ranks[1:3]:
        rank.request()
    ranks[1].say("done", 8, step=1, rows=b"rows of 1", stopped="steps")
    ranks[2].say("done", 8, step=1, rows=packed(2, range(1, 2)), stopped="steps")
    joined: list[HostRows] = []
    got = replies(channel, 2, joined=joined)
    assert joined == []
    assert sorted((r.rank, r.rows[:4]) for r in got) == [(1, b"rows"), (2, MAGIC)]


def test_a_relay_speaks_only_for_its_own_ranks():
    """Seen by the channel: a reply of a rank the relay does not serve (no hello came
    through it), or one that is not a rank's, is not taken from it, nor are its rows; a
    message without the session key is dropped whole."""
    channel = Channel()
    fake = zmq.Context.instance().socket(zmq.DEALER)  # a relay, as the channel sees one
    fake.setsockopt(zmq.IDENTITY, b"relay:0")
    fake.setsockopt(zmq.LINGER, 0)

    def send(*replies: dict, rows: bytes = b"", key: str = channel.key) -> None:
        header = {"key": key, "replies": list(replies)}
        fake.send_multipart([JOINED, json.dumps(header).encode(), rows])

    try:
        fake.connect(channel.address)
        send({"kind": "hello", "id": None, "rank": 0}, {"kind": "hello", "id": None, "rank": 1})
        assert channel.wait_connected([0, 1], timeout=10) == set()
        rows = concat([read_frame(packed(r, range(1, 2)), r) for r in (1, 9)])
        send(
            {"kind": "done", "id": 3, "rank": 9},
            {"kind": "done", "id": 3, "rank": [1]},  # not a rank: dropped, no crash
            {"kind": "done", "id": 3, "rank": 1},
            rows=rows,
        )
        joined: list[HostRows] = []
        assert [(r.rank, r.kind) for r in replies(channel, 1, joined=joined)] == [(1, "done")]
        assert [host.ranks for host in joined] == [frozenset({1})]  # rank 9's reply: not taken
        trace = Trace({})
        assert trace.add_host(joined[0].data, joined[0].ranks) == [9]  # its rows left out
        assert list(trace.records) == [1] and len(trace.columns) == 1
        send({"kind": "done", "id": 4, "rank": 1}, rows=packed(1, range(2, 3)), key="x" * 32)
        assert replies(channel, 1, 0.5, joined) == [] and len(joined) == 1
        group = {"id": 5, "stopped": "steps", "attach": 1, "ranks": [9, 0], "steps": [4, 4]}
        fake.send_multipart(
            [JOINED, json.dumps({"key": channel.key, "replies": [], "done": [group]}).encode(), b""]
        )
        deadline, got = time.monotonic() + 10, []
        while not got and time.monotonic() < deadline:
            got = channel.receive_with_rows(0.1).done
        assert got == [DoneGroup(5, "steps", 1, (0,), (4,))]  # rank 9 is not relay:0's
    finally:
        fake.close()
        channel.close()


def test_a_relay_whose_held_rows_cannot_be_read_still_reports_its_failure(host):
    """Rows the relay fails on (extras nested too deep to parse) go up as BATCH, and a
    fault after that still sends a RelayError for the ranks the run waits for."""
    channel, relay, ranks = host
    channel.send([0, 1], RunRequest(id=6, steps=1))
    for rank in ranks[:2]:
        assert rank.request().id == 6
    frame = packed(0, range(1, 2))
    deep = b"[" * 100_000 + b"]" * 100_000
    bad = frame[:4] + struct.pack("<III", 1, len(frame) - 16 - ROW.itemsize >> 3, len(deep))
    bad += frame[16:] + deep
    ranks[0].say("done", 6, step=1, rows=bad, stopped="steps")
    got = replies(channel, 1)
    assert [(r.rank, r.kind, r.rows == bad) for r in got] == [(0, "done", True)]  # as sent

    def broken() -> None:  # a fault planted in the relay's thread
        raise RuntimeError("planted")

    relay._from_ranks = broken  # type: ignore[method-assign]
    ranks[1].say("progress", 6, step=0)
    got = replies(channel, 1)
    assert [(r.rank, r.kind) for r in got] == [(1, "error")]
    assert got[0].error is not None and got[0].error.ename == "RelayError"


def test_a_finished_run_comes_up_as_one_message_and_a_silent_rank_holds_it_briefly():
    """Seen from a raw ROUTER (the notebook's socket): one batch for three done replies;
    with a fourth rank silent, the batch still comes, about HOLD_S later."""
    key = "k" * 32
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = Relay(f"tcp://127.0.0.1:{port}", key, 10)
    ranks = [Rank(key, r, 10) for r in (10, 11, 12, 13)]
    try:
        hellos = 0
        while hellos < 4:
            assert router.poll(10_000)
            hellos += len(json.loads(router.recv_multipart()[2])["replies"])
        for run, finishing in ((1, ranks[:3]), (2, ranks)):
            targets = [10, 11, 12] if run == 1 else [10, 11, 12, 13]
            request = {"key": key, **RunRequest(id=run, steps=1).to_dict(), "to": targets}
            router.send_multipart([b"relay:10", json.dumps(request).encode()])
            for rank in ranks:
                if rank.rank in targets:
                    assert rank.request().id == run
            started = time.monotonic()
            for rank in finishing if run == 1 else ranks[:3]:  # run 2: rank 13 stays silent
                rank.say("done", run, step=run, stopped="steps")
            assert router.poll(10_000)
            parts = router.recv_multipart()
            waited = time.monotonic() - started
            assert parts[1] == JOINED and len(parts) == 4, parts
            header = json.loads(parts[2])
            assert header["key"] == key
            assert header["replies"] == []  # plain done replies: one group, as columns
            assert [(g["id"], g["stopped"], sorted(g["ranks"])) for g in header["done"]] == [
                (run, "steps", [10, 11, 12])
            ]
            if run == 2:  # held for rank 13 until HOLD_S had passed, then sent
                assert waited >= HOLD_S * 0.9, waited
    finally:
        for rank in ranks:
            rank.close()
        relay.close()
        router.close()


def test_a_rank_the_relay_cannot_reach_is_reported_unreachable(host):
    channel, _, ranks = host
    ranks[2].close()  # its engine was killed: the relay's socket to it is gone
    deadline = time.monotonic() + 10
    unreachable: list[RankReply] = []
    while not unreachable and time.monotonic() < deadline:
        channel.send([2], RunRequest(id=9, steps=1))  # until the relay has seen it go
        unreachable = [r for r in replies(channel, 1, 0.5) if r.kind == "unreachable"]
    assert [(r.rank, r.id) for r in unreachable[:1]] == [(2, 9)]


def test_replies_without_the_session_key_go_no_further(host):
    channel, _, ranks = host
    ranks[1].socket.send_multipart(frames(RankReply("progress", 3, 1, step=1), "not the key"))
    ranks[3].say("progress", 3, step=1)
    got = replies(channel, 1)
    assert [(r.rank, r.kind) for r in got] == [(3, "progress")]
    assert replies(channel, 1, 0.3) == []


def test_the_relay_plan_picks_each_hosts_lowest_rank_from_the_size_on():
    from dtlab.control.relays import relay_plan
    from tests.fakes import rank_info

    hosts = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a", 5: "c"}
    infos = {r: rank_info(r, host=h) for r, h in hosts.items()}
    assert relay_plan(infos, at=7) == {}  # fewer ranks than the size: straight
    # host c has one rank: nothing to gather, it goes straight
    assert relay_plan(infos, at=6) == {0: 0, 2: 0, 4: 0, 1: 1, 3: 1}


def test_a_bad_relay_size_is_refused_with_what_to_give(monkeypatch):
    from dtlab.control.errors import OptionError
    from dtlab.control.relays import RELAY_AT, relay_at

    monkeypatch.delenv("DTLAB_RELAY_AT", raising=False)
    assert relay_at() == RELAY_AT
    monkeypatch.setenv("DTLAB_RELAY_AT", "8")
    assert relay_at() == 8
    for bad in ("1", "many"):
        monkeypatch.setenv("DTLAB_RELAY_AT", bad)
        with pytest.raises(OptionError, match="DTLAB_RELAY_AT=.*a number of ranks >= 2"):
            relay_at()


def test_a_relay_that_fails_says_so_for_each_of_its_ranks_instead_of_going_silent(host):
    channel, relay, ranks = host
    channel.send([0, 1], RunRequest(id=5, steps=1))
    for rank in ranks[:2]:
        assert rank.request().id == 5

    def broken() -> None:  # a fault planted in the relay's thread
        raise RuntimeError("planted")

    relay._from_ranks = broken  # type: ignore[method-assign]
    ranks[0].say("done", 5, step=1, stopped="steps")
    got = replies(channel, 2)
    assert sorted((r.rank, r.kind, r.id) for r in got) == [(0, "error", 5), (1, "error", 5)]
    assert got[0].error is not None and got[0].error.ename == "RelayError"
    assert "relay of rank 0's host failed: RuntimeError('planted')" in got[0].error.evalue

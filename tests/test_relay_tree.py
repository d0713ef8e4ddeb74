"""Group relays (agent/relay.py, ``listen=True``): other hosts' relays send up through one
host's relay over TCP, and the notebook's real Channel sees a single relay for all their
ranks. Hellos give every rank the group relay's route, a command reaches each named rank
once, a finished run comes up as one message with every rank's rows, a rank behind
another host's relay that cannot be reached is reported, a relay's message the group
relay cannot join goes up as it came, and a host relay's failure still reaches the
notebook. No torch: the ranks are DEALER sockets speaking the stepping protocol."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from dtlab.agent import relay as relay_module
from dtlab.agent.relay import Relay
from dtlab.control.channel import Channel
from dtlab.records.packed import concat, read_frame
from dtlab.records.trace import Trace
from dtlab.records.wire import JOINED, HostRows, RunRequest
from tests.test_relay import Rank, packed, replies

pytestmark = pytest.mark.timeout(60)

HOSTS = {0: range(0, 4), 4: range(4, 8), 8: range(8, 12)}  # relay rank -> its host's ranks


@pytest.fixture
def tree():
    """A Channel; rank 0's relay as the group relay; ranks 4 and 8's relays sending up
    through it; fake ranks 0-11, each on its host's relay."""
    channel = Channel()
    group = Relay(channel.address, channel.key, 0, listen=True)
    assert group.remote is not None and group.remote.startswith("tcp://127.0.0.1:")
    relays = [group] + [Relay(group.remote, channel.key, r) for r in (4, 8)]
    ranks = [Rank(channel.key, r, relay) for relay, local in HOSTS.items() for r in local]
    try:
        assert channel.wait_connected(range(12), timeout=20) == set()
        yield channel, relays, ranks
    finally:
        for rank in ranks:
            rank.close()
        for relay in relays:
            relay.close()
        channel.close()


def test_every_rank_behind_the_group_relay_has_its_route(tree):
    channel, _, _ = tree
    assert channel.routes == {r: b"relay:0" for r in range(12)}


def test_a_finished_run_of_every_host_comes_up_as_one_message(tree, monkeypatch):
    channel, _, ranks = tree
    monkeypatch.setattr(relay_module, "GROUP_HOLD_S", 10.0)  # no early send on a busy machine
    assert channel.send(range(12), RunRequest(id=3, steps=2)) == []
    for rank in ranks:
        request = rank.request()
        assert (request.id, request.steps) == (3, 2)
    for rank in ranks:
        assert rank.socket.poll(50) == 0  # once each
        rank.say("done", 3, step=2, rows=packed(rank.rank, range(1, 3)), stopped="steps")
    joined: list[HostRows] = []
    got = replies(channel, 12, joined=joined)
    assert sorted((r.rank, r.kind, r.id) for r in got) == [(r, "done", 3) for r in range(12)]
    assert [rows.ranks for rows in joined] == [frozenset(range(12))]  # one frame, one message
    trace = Trace({})
    assert trace.add_host(joined[0].data, joined[0].ranks) == []
    assert {r: [(rec.step, rec.loss) for rec in recs] for r, recs in trace.records.items()} == {
        r: [(1, float(r)), (2, float(r))] for r in range(12)
    }


def test_a_rank_behind_another_hosts_relay_that_cannot_be_reached_is_reported(tree):
    channel, _, ranks = tree
    ranks[6].close()  # rank 6 (on relay 4's host): its engine was killed
    deadline = time.monotonic() + 10
    unreachable = []
    while not unreachable and time.monotonic() < deadline:
        channel.send([6], RunRequest(id=9, steps=1))  # until relay 4 has seen it go
        unreachable = [r for r in replies(channel, 1, 0.5) if r.kind == "unreachable"]
    assert [(r.rank, r.id) for r in unreachable[:1]] == [(6, 9)]


def test_a_message_the_group_relay_cannot_join_goes_up_with_its_senders_replies_only(tree):
    """Rows and a reply naming a rank its sender does not serve (rank 1, the group
    relay's own): the group relay sends the message on its own, without that reply, and
    the notebook keeps only the rows of the sender's rank; then, all of its run's ranks
    having replied, a fault in the group relay is still reported."""
    channel, relays, ranks = tree
    fake = zmq.Context.instance().socket(zmq.DEALER)  # another host's relay, as seen
    fake.setsockopt(zmq.IDENTITY, b"relay:20")
    fake.setsockopt(zmq.LINGER, 0)

    def send(*replies_: dict, rows: bytes = b"") -> None:
        header = {"key": channel.key, "replies": list(replies_), "done": []}
        fake.send_multipart([JOINED, json.dumps(header).encode(), rows])

    try:
        fake.connect(relays[0].remote)
        send({"kind": "hello", "id": None, "rank": 20})
        assert channel.wait_connected([20], timeout=10) == set()
        assert channel.routes[20] == b"relay:0"
        assert channel.send([20], RunRequest(id=4, steps=1)) == []
        assert fake.poll(10_000)
        assert json.loads(fake.recv_multipart()[-1])["to"] == [20]
        rows = concat([read_frame(packed(r, range(1, 2)), r) for r in (1, 20)])
        send(
            {"kind": "done", "id": 4, "rank": 20, "step": 1, "stopped": "steps"},
            {"kind": "done", "id": 4, "rank": 1, "step": 1, "stopped": "steps"},  # not its
            rows=rows,
        )
        joined: list[HostRows] = []
        got = replies(channel, 2, 2.0, joined=joined)
        assert [(r.rank, r.kind) for r in got] == [(20, "done")]
        assert [rows.ranks for rows in joined] == [frozenset({20})]
        trace = Trace({})
        assert trace.add_host(joined[0].data, joined[0].ranks) == [1]  # rank 1's: left out
        assert list(trace.records) == [20]

        def broken() -> None:  # a fault planted in the group relay's thread
            raise RuntimeError("planted")

        relays[0]._from_ranks = broken  # type: ignore[method-assign]
        ranks[0].say("progress", 4, step=1)
        failed = replies(channel, 1)
        assert failed and {r.kind for r in failed} == {"error"}
        assert failed[0].error is not None and failed[0].error.ename == "RelayError"
    finally:
        fake.close()


def test_a_host_relay_that_fails_is_named_through_the_group_relay(tree):
    channel, relays, ranks = tree
    channel.send([4, 5], RunRequest(id=5, steps=1))
    for rank in ranks[4:6]:
        assert rank.request().id == 5

    def broken() -> None:  # a fault planted in relay 4's thread
        raise RuntimeError("planted")

    relays[1]._from_ranks = broken  # type: ignore[method-assign]
    ranks[4].say("done", 5, step=1, stopped="steps")
    got = replies(channel, 2)
    assert sorted((r.rank, r.kind, r.id) for r in got) == [(4, "error", 5), (5, "error", 5)]
    assert got[0].error is not None and "relay of rank 4's host failed" in got[0].error.evalue


def test_group_relays_join_runs_of_host_relays_by_rank():
    from dtlab.control.relays import relay_groups

    plan = {r: r - r % 4 for r in range(40)}  # 10 hosts of 4 ranks: relays 0, 4, ..., 36
    assert relay_groups(plan, 8) == {**{r: 0 for r in range(0, 32, 4)}, 32: 32, 36: 32}
    assert relay_groups(plan, 11) == {}  # fewer host relays than a group: none
    assert relay_groups(plan, 1) == {}
    three = relay_groups(plan, 3)  # the last run of one (relay 36) goes straight
    assert three == {0: 0, 4: 0, 8: 0, 12: 12, 16: 12, 20: 12, 24: 24, 28: 24, 32: 24}


def test_a_bad_fan_in_is_refused_with_what_to_give(monkeypatch):
    from dtlab.control.errors import OptionError
    from dtlab.control.relays import FAN_IN, fan_in

    monkeypatch.delenv("DTLAB_RELAY_FAN_IN", raising=False)
    assert fan_in() == FAN_IN
    monkeypatch.setenv("DTLAB_RELAY_FAN_IN", "1")
    assert fan_in() == 1
    for bad in ("0", "many"):
        monkeypatch.setenv("DTLAB_RELAY_FAN_IN", bad)
        with pytest.raises(OptionError, match="DTLAB_RELAY_FAN_IN=.*host relays >= 1"):
            fan_in()


def test_a_local_ranks_bad_rows_do_not_cost_another_hosts_rows_their_reply(tree, monkeypatch):
    """Rank 1's rows are not a frame, so the group relay sends its replies as BATCH; what
    relay 4 joined (rank 5's error and rows) still goes up joined, rows with their reply."""
    channel, _, ranks = tree
    monkeypatch.setattr(relay_module, "GROUP_HOLD_S", 10.0)  # one message, on a busy machine too
    channel.send([1, 5], RunRequest(id=6, steps=1))
    for rank in (ranks[1], ranks[5]):
        assert rank.request().id == 6
    ranks[5].say("error", 6, step=1, rows=packed(5, range(1, 2)))
    ranks[1].say("done", 6, step=1, rows=b"not a frame", stopped="steps")
    joined: list[HostRows] = []
    got = replies(channel, 2, joined=joined)
    assert sorted((r.rank, r.kind, r.rows[:11]) for r in got) == [
        (1, "done", b"not a frame"),  # as the rank sent it: the notebook says it drops it
        (5, "error", b""),
    ]
    assert [rows.ranks for rows in joined] == [frozenset({5})]
    trace = Trace({})
    assert trace.add_host(joined[0].data, joined[0].ranks) == []
    assert [rec.step for rec in trace.records[5]] == [1]


def test_a_malformed_message_on_the_group_relays_port_is_dropped(tree):
    """With the key but not a relay's (a done group whose ranks are lists), or from a peer
    that is not a relay: dropped, and the relay goes on."""
    channel, relays, ranks = tree
    peers = []
    for identity in (b"relay:30", b"1"):
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.IDENTITY, identity)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(relays[0].remote)
        peers.append(peer)
    bad = {"id": 2, "stopped": "steps", "attach": 1, "ranks": [[1]], "steps": [1]}
    odd = {"kind": "done", "id": 2, "rank": "one"}
    try:
        for peer in peers:
            header = {"key": channel.key, "replies": [odd, 5], "done": [bad, "x"]}
            peer.send_multipart([JOINED, json.dumps(header).encode(), b""])
            peer.send_multipart([JOINED, b"{not json", b""])
        odd_local = {"key": channel.key, "kind": "done", "id": 3, "rank": [1]}
        ranks[1].socket.send_multipart([json.dumps(odd_local).encode()])  # from a local rank
        time.sleep(0.2)  # (nothing to wait on: they are dropped) then the relay still works
        assert channel.send([1, 6], RunRequest(id=7, steps=1)) == []
        for rank in (ranks[1], ranks[6]):
            assert rank.request().id == 7
            rank.say("progress", 7, step=1)
        got = replies(channel, 2)
        assert sorted((r.rank, r.kind) for r in got) == [(1, "progress"), (6, "progress")]
    finally:
        for peer in peers:
            peer.close()


def test_ranks_that_never_connect_through_a_group_relay_are_told_that_link():
    from dtlab.control.connection import _not_connected

    relays = {0: 0, 1: 0, 2: 2, 3: 2}
    upstream = {2: "tcp://10.0.0.1:4000"}  # relay 2 sends up through rank 0's group relay
    said = _not_connected({2, 3}, "tcp://10.0.0.9:5000", relays, upstream)
    assert "ranks 2-3 send through the group relays at tcp://10.0.0.1:4000" in said
    assert "firewall" in said
    plain = _not_connected({1}, "tcp://10.0.0.9:5000", relays, upstream)
    assert "group relay" not in plain and "at tcp://10.0.0.9:5000" in plain


def test_how_the_ranks_reach_the_notebook_is_said_in_words():
    from dtlab.control.connection import Connection

    connection = Connection(world=None)
    assert connection.describe() is None  # not connected
    connection.channel = Channel()
    try:
        assert connection.describe() == "stepping: every rank straight to the notebook"
        relays = {r: r - r % 8 for r in range(64)}
        connection.plan = (relays, {})
        assert connection.describe() == "stepping: through 8 host relays"
        connection.plan = (relays, {r: 0 for r in range(0, 64, 8)})
        assert connection.describe() == "stepping: through 8 host relays, joined by 1 group relay"
    finally:
        connection.close()

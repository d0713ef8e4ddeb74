"""The stepping channel's messages: what one end encodes the other decodes to the same
typed message, and a frame that is not ours (wrong key, not JSON, odd fields) is dropped
instead of acted on."""

from __future__ import annotations

import json
import time

import pytest

from dtlab.records import Condition, RemoteFailure
from dtlab.records.wire import (
    PauseRequest,
    RankReply,
    RunRequest,
    decode_reply,
    decode_request,
    encode,
    frames,
    reply_from,
)

KEY = "k" * 32


@pytest.mark.parametrize(
    "message",
    [
        RunRequest(id=3, steps=5),
        RunRequest(
            id=4,
            steps=100000,
            report_s=0.5,
            until=Condition("loss_below", 0.25),
            record=False,
            agree_every=7,
            regroup=True,
            watch=True,
            outputs=True,
        ),
        RunRequest(id=5, steps=1, until=Condition("nonfinite"), record=True),
        PauseRequest(),
    ],
)
def test_a_request_reads_back_as_sent(message):
    assert decode_request(encode(message, KEY), KEY) == message


@pytest.mark.parametrize(
    "reply",
    [
        RankReply("hello", None, 2),
        RankReply("progress", 7, 1, step=12, attach=1, rows=b"DTR1...", output="hi\n"),
        RankReply("done", 7, 0, step=15, attach=1, stopped="until", hit=True),
        RankReply(
            "error",
            8,
            3,
            step=2,
            error=RemoteFailure("RuntimeError", "boom", "Traceback ...\n"),
        ),
    ],
)
def test_a_reply_reads_back_as_sent(reply):
    first, *rows = frames(reply, KEY)
    assert rows == ([reply.rows] if reply.rows else [])  # the records: a frame of their own
    assert b"DTR1" not in first
    assert decode_reply(first, KEY, *rows) == reply


def test_frames_that_are_not_ours_are_dropped():
    run = encode(RunRequest(id=1, steps=1), KEY)
    assert decode_request(run, "another key") is None
    assert decode_request(b"not json", KEY) is None
    assert decode_reply(b"[" * 100_000 + b"]" * 100_000, KEY) is None  # too deep to parse
    assert decode_request(json.dumps([KEY]).encode(), KEY) is None
    assert decode_request(json.dumps({"key": KEY, "op": "format_disk"}).encode(), KEY) is None
    assert decode_request(json.dumps({"key": KEY, "op": ["run"]}).encode(), KEY) is None
    odd = {"key": KEY, "op": "run", "id": "x", "steps": 1}
    assert decode_request(json.dumps(odd).encode(), KEY) is None
    assert decode_reply(json.dumps({"key": KEY, "kind": "done"}).encode(), KEY) is None
    assert decode_reply(json.dumps({"key": KEY, "kind": "exec", "rank": 0}).encode(), KEY) is None


def test_a_request_is_plain_json_with_the_key():
    frame = json.loads(encode(RunRequest(id=9, steps=2, until=Condition("step", 4)), KEY))
    assert frame["key"] == KEY and frame["op"] == "run"
    assert frame["until"] == {"kind": "step", "value": 4}


def test_the_channel_hands_each_reply_its_rows_and_drops_what_is_not_ours():
    import zmq

    from dtlab.control.channel import Channel
    from dtlab.records.packed import pack
    from tests.fakes import step_record

    channel = Channel()
    rank = zmq.Context.instance().socket(zmq.DEALER)
    rank.setsockopt(zmq.IDENTITY, b"1")
    rank.setsockopt(zmq.LINGER, 0)
    rank.connect(channel.address)
    try:
        rows = pack(1, [step_record(1, 1).summary()]).to_bytes()
        reply = RankReply("done", 3, 1, step=1, rows=rows, stopped="steps")
        rank.send_multipart(frames(RankReply("hello", None, 1), channel.key))
        rank.send_multipart([b"a", b"b", b"c"])  # too many frames
        rank.send_multipart(frames(reply, "not the key"))
        rank.send_multipart(frames(reply, channel.key))
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = channel.receive_with_rows(0.5)[0]
        assert channel.connected == {1}
        ((data, received),) = got
        assert received == rows and decode_reply(json.dumps(data).encode(), KEY) is None
        assert reply_from(data, received) == reply
    finally:
        rank.close()
        channel.close()


def test_done_groups_of_several_relays_merge_by_run_stop_and_attach_count():
    from dtlab.records.wire import DoneGroup, merged_groups

    merged = merged_groups(
        [
            DoneGroup(3, "steps", 1, (0, 1), (5, 5)),
            DoneGroup(3, "steps", 1, (8, 9), (5, 5)),
            DoneGroup(3, "pause", 1, (16,), (4,)),  # stopped otherwise: a group of its own
            DoneGroup(3, "steps", 1, (1, 17), (6, 5)),  # rank 1 again: its first kept
        ]
    )
    assert merged == [
        DoneGroup(3, "steps", 1, (0, 1, 8, 9, 17), (5, 5, 5, 5, 5)),
        DoneGroup(3, "pause", 1, (16,), (4,)),
    ]

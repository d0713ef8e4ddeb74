"""The stepping channel's messages: what one end encodes the other decodes to the same
typed message, and a frame that is not ours (wrong key, not JSON, odd fields) is dropped
instead of acted on."""

from __future__ import annotations

import json

import pytest

from dtlab.records import Condition, RemoteFailure
from dtlab.records.wire import (
    PauseRequest,
    RankReply,
    RunRequest,
    decode_reply,
    decode_request,
    encode,
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
        RankReply("progress", 7, 1, step=12, attach=1, records=('{"rank": 1}',), output="hi\n"),
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
    assert decode_reply(encode(reply, KEY), KEY) == reply


def test_frames_that_are_not_ours_are_dropped():
    run = encode(RunRequest(id=1, steps=1), KEY)
    assert decode_request(run, "another key") is None
    assert decode_request(b"not json", KEY) is None
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

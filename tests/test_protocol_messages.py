"""The protocol's one home (records/wire.py): every message kind encoded and decoded back
through it, the relays' framing taken apart as it was put together, the sidecars'
messages, the words the ends compare, the agreement cadence both ends follow, and the bytes
on the wire as they were when each end built them by hand. No sockets, no torch."""

from __future__ import annotations

import json

import pytest

from dtlab.records import CollectiveCall, Condition, RankReport, RemoteFailure
from dtlab.records.wire import (
    BATCH,
    JOINED,
    REPLY_KINDS,
    REQUESTS,
    STOPS,
    DoneGroup,
    Envelope,
    Op,
    PauseRequest,
    RankReply,
    ReplyKind,
    ReportRequest,
    RunRequest,
    SidecarHello,
    SidecarReport,
    Stop,
    addressed,
    addressees,
    agree_every,
    batch_message,
    checked,
    decode_reply,
    decode_report_request,
    decode_request,
    encode,
    failure_grace,
    frames,
    identity,
    is_relay,
    joined_message,
    naming,
    new_key,
    next_agree_every,
    read_direct,
    read_relayed,
    readdressed,
    relay_identity,
    relay_reply,
    report_from,
    run_of,
    unkeyed,
)

KEY = "k" * 32


def old(fields: dict) -> bytes:
    """A frame as the ends built it by hand before the protocol had one home."""
    return json.dumps({"key": KEY, **fields}).encode()


# --- every message kind, there and back --------------------------------------------------
@pytest.mark.parametrize(
    "message",
    [
        RunRequest(id=1, steps=3),
        RunRequest(id=2, steps=9, until=Condition("diverged"), record=True, agree_every=4),
        PauseRequest(),
    ],
)
def test_each_stepping_request_reads_back(message):
    assert decode_request(encode(message, KEY), KEY) == message
    assert decode_report_request(encode(message, KEY), KEY) is None  # not a sidecar's


@pytest.mark.parametrize("kind", REPLY_KINDS)
def test_each_reply_kind_reads_back_as_its_enum(kind):
    reply = RankReply(kind, 4, 2, step=7, attach=1, rows=b"rows", output="x")
    first, rows = frames(reply, KEY)
    back = decode_reply(first, KEY, rows)
    assert back == reply and back is not None and back.kind is kind


def test_a_reply_that_is_not_a_stepping_kind_is_dropped():
    assert decode_reply(old({"kind": ReplyKind.REPORT, "id": 1, "rank": 0}), KEY) is None


def test_the_sidecar_messages_read_back():
    request = ReportRequest(5)
    assert decode_report_request(encode(request, KEY), KEY) == request
    assert decode_request(encode(request, KEY), KEY) is None  # not for the stepping server
    assert decode_report_request(encode(request, KEY), "other") is None
    assert decode_report_request(old({"op": "report", "id": "x"}), KEY) == ReportRequest(None)

    hello = checked(encode(SidecarHello(3), KEY), KEY)
    assert hello == {"key": KEY, "rank": 3, "kind": "hello"}
    assert report_from(hello, 5) is None

    call = {
        "group": "default_pg",
        "group_id": "0",
        "members": [0, 1],
        "seq": 4,
        "op": "allreduce",
        "sizes": [[2, 3]],
        "dtypes": ["Float"],
        "done": False,
    }
    sent = SidecarReport(5, 3, [["train.py", 10, "step", "loss.backward()"]], [call], step=12)
    data = checked(encode(sent, KEY), KEY)
    assert data is not None
    assert report_from(data, 5) == RankReport(
        3,
        (("train.py", 10, "step", "loss.backward()"),),
        (CollectiveCall("default_pg", 4, "allreduce", ((2, 3),), False, "0", (0, 1), ("Float",)),),
        12,
    )
    assert report_from(data, 6) is None  # an answer to an earlier question

    failed = checked(encode(SidecarReport(5, 3, error="RuntimeError: no"), KEY), KEY)
    assert failed is not None and failed["error"] == "RuntimeError: no" and "step" not in failed
    assert report_from(failed, 5) == RankReport(3, ())


# --- relays --------------------------------------------------------------------------------
def test_a_command_names_its_ranks_for_a_relay():
    frame = addressed(encode(RunRequest(id=6, steps=2), KEY), naming([1, 2]))
    data = checked(frame, KEY)
    assert data is not None
    assert (addressees(data), run_of(data)) == ([1, 2], 6)
    assert decode_request(frame, KEY) == RunRequest(id=6, steps=2)  # ranks ignore "to"
    onward = checked(readdressed(data, [2]), KEY)
    assert onward is not None and addressees(onward) == [2] and run_of(onward) == 6
    pause = checked(addressed(encode(PauseRequest(), KEY), naming([3])), KEY)
    assert pause is not None and (addressees(pause), run_of(pause)) == ([3], None)
    assert addressees({"to": [1, "2", None, 3]}) == [1, 3] and addressees({"to": 1}) == []


def test_a_joined_message_reads_back():
    error = RankReply(ReplyKind.ERROR, 3, 1, error=RemoteFailure("E", "v", "tb"))
    replies = [unkeyed(checked(encode(error, KEY), KEY) or {})]
    groups = [DoneGroup(3, Stop.STEPS, 1, (0, 2), (5, 5))]
    body = joined_message(KEY, replies, groups, b"rows")
    assert body[0] == JOINED
    got = read_relayed(body, KEY)
    assert got is not None and got.joined and got.rows == b"rows"
    assert got.done == groups
    assert [r.data for r in got.replies] == replies
    assert RankReply.from_dict(got.replies[0].data) == error
    assert [g.replies() for g in got.done] == [
        [
            RankReply("done", 3, 0, step=5, attach=1, stopped="steps"),
            RankReply("done", 3, 2, step=5, attach=1, stopped="steps"),
        ]
    ]
    assert read_relayed(body, "other") is None
    assert read_relayed([JOINED, old({"replies": {}}), b""], KEY) is None
    no_groups = read_relayed([JOINED, old({"replies": []}), b""], KEY)
    assert no_groups is not None and no_groups.done is None  # (a group relay drops it)


def test_a_batch_message_reads_back_each_reply_as_sent():
    sent = [
        Envelope(checked(f[0], KEY) or {}, f[0], f[1] if len(f) > 1 else b"")
        for f in (
            frames(RankReply("done", 2, 0, step=1, rows=b"bad", stopped="steps"), KEY),
            frames(RankReply("progress", 2, 1, step=1), KEY),
        )
    ]
    body = batch_message(sent)
    assert body[0] == BATCH and len(body) == 5
    got = read_relayed(body, KEY)
    assert got is not None and not got.joined and got.replies == sent and got.done == []
    assert read_relayed(body[:-1], KEY) is None  # frames that do not pair
    stray = read_relayed([BATCH, json.dumps({"key": "x", "kind": "done"}).encode(), b""], KEY)
    assert stray is not None and stray.replies == []  # a reply without the key: dropped


def test_a_direct_reply_is_its_json_then_maybe_rows():
    first, rows = frames(RankReply("progress", 1, 0, rows=b"r"), KEY)
    assert read_direct([first, rows], KEY) == Envelope(checked(first, KEY) or {}, first, rows)
    assert read_direct([first], KEY) == Envelope(checked(first, KEY) or {}, first, b"")
    assert read_direct([first, rows, rows], KEY) is None
    assert read_direct([b"{not json"], KEY) is None and read_direct([], KEY) is None


def test_identities():
    assert identity(12) == b"12" and relay_identity(12) == b"relay:12"
    assert is_relay(relay_identity(3)) and not is_relay(identity(3))
    assert not is_relay(b"relay:3x") and len(new_key()) == 32 and new_key() != new_key()


# --- the bytes are those the ends built by hand --------------------------------------------
def test_the_bytes_on_the_wire_are_unchanged():
    run = RunRequest(id=3, steps=2, until=Condition("step", 9))
    assert encode(run, KEY) == old(
        {
            "op": "run",
            "id": 3,
            "steps": 2,
            "report_s": 0.25,
            "until": {"kind": "step", "value": 9},
            "record": None,
            "agree_every": 1,
            "regroup": False,
            "watch": False,
            "outputs": False,
        }
    )
    assert addressed(encode(PauseRequest(), KEY), naming([4, 5])) == old(
        {"op": "pause", "to": [4, 5]}
    )
    assert encode(ReportRequest(7), KEY) == old({"op": "report", "id": 7})
    # the sidecar's: key, rank, kind, then the fields
    assert encode(SidecarHello(2), KEY) == old({"rank": 2, "kind": "hello"})
    report = SidecarReport(7, 2, [["f.py", 1, "g", "x"]], [], step=4)
    assert encode(report, KEY) == old(
        {"rank": 2, "kind": "report", "id": 7, "stack": [["f.py", 1, "g", "x"]]}
        | {"collectives": [], "step": 4}
    )
    assert encode(SidecarReport(7, 2, error="E: x"), KEY) == old(
        {"rank": 2, "kind": "report", "id": 7, "stack": [], "collectives": [], "error": "E: x"}
    )
    # a rank's reply: every field
    done = RankReply(ReplyKind.DONE, 3, 1, step=2, attach=1, stopped=Stop.UNTIL, hit=True)
    assert frames(done, KEY) == [
        old(
            {"kind": "done", "id": 3, "rank": 1, "step": 2, "attach": 1, "stopped": "until"}
            | {"hit": True, "output": "", "error": None}
        )
    ]
    # the replies a relay makes itself: only what is not a default
    unreachable = relay_reply(RankReply(ReplyKind.UNREACHABLE, 3, 5), KEY)
    assert unreachable.frame == old({"kind": "unreachable", "id": 3, "rank": 5})
    assert unreachable.data == json.loads(unreachable.frame) and unreachable.rows == b""
    failure = RemoteFailure("RelayError", "gone", "tb")
    failed = relay_reply(RankReply(ReplyKind.ERROR, None, 5, error=failure), KEY).frame
    assert failed == old(
        {"kind": "error", "id": None, "rank": 5}
        | {"error": {"ename": "RelayError", "evalue": "gone", "traceback": "tb"}}
    )
    group = DoneGroup(3, "steps", None, (0,), (2,))
    assert joined_message(KEY, [{"kind": "progress"}], [group], b"") == [
        JOINED,
        old(
            {
                "replies": [{"kind": "progress"}],
                "done": [{"id": 3, "stopped": "steps", "attach": None, "ranks": [0], "steps": [2]}],
            }
        ),
        b"",
    ]


# --- words --------------------------------------------------------------------------------
def test_the_words_are_their_text():
    for word in (*ReplyKind, *Op, *Stop):
        assert word == word.value and str(word) == word.value and f"{word}" == word.value
        assert json.dumps(word) == json.dumps(word.value) and hash(word) == hash(word.value)
    assert REQUESTS["run"] is RunRequest and REQUESTS["pause"] is PauseRequest
    assert "until" in STOPS and ReplyKind.REPORT not in REPLY_KINDS
    assert ["done"] not in REPLY_KINDS  # (an unhashable kind in a reply: just not one)


# --- the agreement cadence ----------------------------------------------------------------
def test_the_cadence_both_ends_follow():
    assert agree_every(None) == 1  # no step timed yet: agree at every step
    assert agree_every(0.5) == 2 and agree_every(0.01) == 100 and agree_every(5.0) == 1
    assert agree_every(1e-6) == 1000  # at most MAX_AGREE_EVERY
    assert [next_agree_every(n, 0.01) for n in (1, 2, 64, 100)] == [2, 4, 100, 100]
    assert failure_grace(None, 1.0) == 1.0 and failure_grace(0.5, 1.0) == 2 * 3 * 0.5
    assert failure_grace(1e-4, 1.0) == 1.0

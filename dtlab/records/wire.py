"""The stepping channel's messages, typed, with one encoding used at both ends.

The notebook (control/stepper.py, through control/channel.py) sends a :class:`RunRequest`
or a :class:`PauseRequest` to the ranks; each rank (agent/stepping.py) answers with
:class:`RankReply` frames: ``hello`` once when it connects, ``progress`` during a run,
then ``done`` or ``error``. A message is one JSON object carrying the session ``key``; a
message without the right key, or that does not parse, is dropped (the decoders return
None), so a stray or hostile sender can never make a rank step.

A reply's step records (whole-step summaries: the per-parameter tuples stay on the rank)
travel as a second zmq frame after the JSON one: packed binary rows
(:mod:`dtlab.records.packed`), which the notebook takes in without a Python object per
record. :func:`frames` and :func:`reply_from` are the two ends.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar

from dtlab.records.ranks import RemoteFailure
from dtlab.records.steps import Condition

# "unreachable": a host's relay could not forward a command to this rank (agent/relay.py)
REPLY_KINDS = ("hello", "progress", "done", "error", "unreachable")
# the first frame of a relay's message (agent/relay.py): JOINED, the replies of its host's
# ranks as one JSON list and their packed rows as one frame; BATCH (when some rank's rows
# are not valid, so the notebook says whose), each reply's frames as the rank sent them
JOINED = b"DTRJ"
BATCH = b"DTRB"
# how a rank's run ended: all steps made, the condition met, a pause asked, a failure
# (its own or a peer's), or a script job whose script is over
STOPS = ("steps", "until", "pause", "error", "ended")


@dataclass(frozen=True)
class HostRows:
    """The packed rows of a relayed host's replies, joined by its relay into one frame
    (rank after rank): every row must be of one of ``ranks``, those the relay relays."""

    ranks: frozenset[int]
    data: bytes


@dataclass(frozen=True)
class DoneGroup:
    """Plain ``done`` replies of a relayed host's ranks to one run, as columns: each rank
    made its steps and stopped the same way (``stopped``), with nothing else to say (no
    output, no error, the condition not hit). A relay sends these instead of a reply each,
    so the notebook handles a host's finished ranks at once (:func:`plain_done`)."""

    id: int
    stopped: str
    attach: int | None
    ranks: tuple[int, ...]
    steps: tuple[int, ...]  # each rank's step count when it sent its reply

    def replies(self) -> list[RankReply]:
        """The group as the replies it stands for."""
        return [
            RankReply("done", self.id, rank, step=step, attach=self.attach, stopped=self.stopped)
            for rank, step in zip(self.ranks, self.steps, strict=True)
        ]

    def only(self, ranks: Collection[int]) -> DoneGroup:
        """The group, without the ranks not in ``ranks`` (itself when it has none)."""
        if all(rank in ranks for rank in self.ranks):
            return self
        pairs = [(r, s) for r, s in zip(self.ranks, self.steps, strict=True) if r in ranks]
        return DoneGroup(
            self.id,
            self.stopped,
            self.attach,
            tuple(r for r, _ in pairs),
            tuple(s for _, s in pairs),
        )

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "stopped": self.stopped,
            "attach": self.attach,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
        }

    @classmethod
    def from_dict(cls, data: object) -> DoneGroup | None:
        """The group, or None if ``data`` is not one (its fields checked, not trusted)."""
        if not isinstance(data, dict):
            return None
        run, stopped, attach = data.get("id"), data.get("stopped"), data.get("attach")
        ranks, steps = data.get("ranks"), data.get("steps")
        if not (
            type(run) is int
            and stopped in STOPS
            and (attach is None or type(attach) is int)
            and isinstance(ranks, list)
            and isinstance(steps, list)
            and len(ranks) == len(steps)
            and all(type(v) is int for v in ranks)
            and all(type(v) is int for v in steps)
            and len(set(ranks)) == len(ranks)  # (a rank twice: not what a relay sends)
        ):
            return None
        return cls(run, stopped, attach, tuple(ranks), tuple(steps))


_PLAIN = {"key", "kind", "id", "rank", "step", "attach", "stopped", "hit", "output", "error"}


def plain_done(data: dict) -> bool:
    """Is this reply (as a relay parsed it) a ``done`` that a DoneGroup can stand for?"""
    return (
        data.get("kind") == "done"
        and type(data.get("id")) is int
        and type(data.get("rank")) is int
        and type(data.get("step")) is int
        and data.get("stopped") in STOPS
        and not data.get("hit")
        and not data.get("output")
        and data.get("error") is None
        and (data.get("attach") is None or type(data.get("attach")) is int)
        and data.keys() <= _PLAIN
    )


def done_groups(replies: list[dict]) -> list[DoneGroup]:
    """Plain done replies (:func:`plain_done`) as groups, one per (run, how it stopped,
    attach count), ranks in the order the replies came."""
    found: dict[tuple[int, str, int | None], tuple[list[int], list[int]]] = {}
    for data in replies:
        ranks, steps = found.setdefault((data["id"], data["stopped"], data.get("attach")), ([], []))
        ranks.append(data["rank"])
        steps.append(data["step"])
    return [
        DoneGroup(run, stopped, attach, tuple(r), tuple(s))
        for (run, stopped, attach), (r, s) in found.items()
    ]


def merged_groups(groups: list[DoneGroup]) -> list[DoneGroup]:
    """Groups of the same (run, how it stopped, attach count) as one (a group relay joins
    its hosts' groups), ranks in order of arrival; a rank seen again is left out."""
    found: dict[tuple[int, str, int | None], tuple[list[int], list[int], set[int]]] = {}
    for group in groups:
        key = (group.id, group.stopped, group.attach)
        ranks, steps, seen = found.setdefault(key, ([], [], set()))
        for rank, step in zip(group.ranks, group.steps, strict=True):
            if rank not in seen:
                seen.add(rank)
                ranks.append(rank)
                steps.append(step)
    return [
        DoneGroup(run, stopped, attach, tuple(r), tuple(s))
        for (run, stopped, attach), (r, s, _) in found.items()
    ]


@dataclass(frozen=True)
class RunRequest:
    """Notebook -> rank: make up to ``steps`` steps, paused together at the end.

    ``until``: stop after the step where it holds (checked on every rank after every
    step); ``record``: per-parameter statistics on or off (None: the job's default);
    ``agree_every``: steps between the ranks' agreements at the start; ``regroup``: rebuild
    the control group first (the last run ended in an error); ``watch``: name the first
    module whose output is not finite; ``outputs``: fingerprint every module's output.
    """

    op: ClassVar[str] = "run"
    id: int
    steps: int
    report_s: float = 0.25  # send progress (and records) at most this often
    until: Condition | None = None
    record: bool | None = None
    agree_every: int = 1
    regroup: bool = False
    watch: bool = False
    outputs: bool = False

    def to_dict(self) -> dict:
        until = self.until
        return {
            "op": self.op,
            **self.__dict__,
            "until": {"kind": until.kind, "value": until.value} if until else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> RunRequest:
        until = data.get("until")
        record = data.get("record")
        return cls(
            id=int(data.get("id", 0)),
            steps=int(data.get("steps", 1)),
            report_s=float(data.get("report_s", 0.25)),
            until=Condition(str(until["kind"]), until.get("value")) if until else None,
            record=None if record is None else bool(record),
            agree_every=max(1, int(data.get("agree_every", 1))),
            regroup=bool(data.get("regroup")),
            watch=bool(data.get("watch")),
            outputs=bool(data.get("outputs")),
        )


@dataclass(frozen=True)
class PauseRequest:
    """Notebook -> rank: stop at the next step boundary the ranks agree on (a pause that
    arrives between runs is stale, and ignored)."""

    op: ClassVar[str] = "pause"

    def to_dict(self) -> dict:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, data: dict) -> PauseRequest:
        return cls()


Request = RunRequest | PauseRequest
REQUESTS: dict[str, type[RunRequest] | type[PauseRequest]] = {
    "run": RunRequest,
    "pause": PauseRequest,
}


@dataclass(slots=True)  # not frozen: that costs ~1.5 us a reply, 512 replies a step
class RankReply:
    """Rank -> notebook: where the rank stands in the run ``id`` (None: not in a run).
    Treated as immutable: nothing changes a reply once it is made."""

    kind: str  # one of REPLY_KINDS
    id: int | None
    rank: int
    step: int = 0  # the job's step count when sent
    attach: int | None = None  # how many jobs were attached on this rank so far
    rows: bytes = b""  # the steps made since the last reply, packed (records.packed)
    stopped: str | None = None  # done replies: one of STOPS
    hit: bool = False  # done replies: the condition held at the last step on this rank
    output: str = ""  # what a script job printed since the last reply
    error: RemoteFailure | None = None  # error replies

    def to_dict(self) -> dict:
        """The reply as JSON-able data, without its rows (they travel as their own frame)."""
        error = self.error
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "rows"}
        return {
            **fields,
            "error": (
                {"ename": error.ename, "evalue": error.evalue, "traceback": error.traceback}
                if error
                else None
            ),
        }

    @classmethod
    def from_dict(cls, data: dict, rows: bytes = b"") -> RankReply:
        error = data.get("error")
        msg_id = data.get("id")
        return cls(
            kind=str(data["kind"]),
            id=None if msg_id is None else int(msg_id),
            rank=int(data["rank"]),
            step=int(data.get("step") or 0),
            attach=data.get("attach"),
            rows=rows,
            stopped=data.get("stopped"),
            hit=bool(data.get("hit")),
            output=data.get("output") or "",
            error=(
                RemoteFailure(
                    str(error.get("ename", "Error")),
                    str(error.get("evalue", "")),
                    str(error.get("traceback", "")),
                )
                if error
                else None
            ),
        )


def encode(message: Request | RankReply, key: str) -> bytes:
    """The message as JSON with the session key (a reply's rows not included)."""
    return json.dumps({"key": key, **message.to_dict()}).encode()


def frames(message: Request | RankReply, key: str) -> list[bytes]:
    """The zmq frames of a message: its JSON, then a reply's packed rows if it has any."""
    first = encode(message, key)
    rows = getattr(message, "rows", b"")
    return [first, rows] if rows else [first]


def decode_request(frame: bytes, key: str) -> Request | None:
    """A request from the notebook, or None for a frame that is not one of ours."""
    data = checked(frame, key)
    if data is None:
        return None
    op = data.get("op")
    kind = REQUESTS.get(op) if isinstance(op, str) else None  # an unhashable op: dropped too
    try:
        return kind.from_dict(data) if kind is not None else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def decode_reply(frame: bytes, key: str, rows: bytes = b"") -> RankReply | None:
    """A rank's reply, or None for a frame that is not one of ours."""
    data = checked(frame, key)
    return reply_from(data, rows) if data is not None else None


def reply_from(data: dict, rows: bytes = b"") -> RankReply | None:
    """A reply from its JSON object (the key already checked) and the frame of packed rows
    that came with it, or None if it is not one."""
    if data.get("kind") not in REPLY_KINDS:
        return None
    try:
        return RankReply.from_dict(data, rows)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def checked(frame: bytes, key: str) -> dict | None:
    """The frame's JSON object if it carries the session key, else None."""
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError):  # (nested too deep to parse: not ours either)
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None

"""The protocol between the notebook and the ranks, in one place: every message typed, one
encoder and one reader used at both ends.

Three kinds of link carry it:

- the stepping channel: the notebook (control/stepper.py, through control/channel.py)
  sends a :class:`RunRequest` or a :class:`PauseRequest`; each rank (agent/stepping.py)
  answers with :class:`RankReply` frames: ``hello`` once when it connects, ``progress``
  during a run, then ``done`` or ``error`` (a relay adds ``unreachable`` for a rank it
  could not forward a command to);
- relays (agent/relay.py): a command once per relay, naming its ranks (:func:`addressed`),
  and the replies of a relay's ranks up as one message (:func:`joined_message`, or
  :func:`batch_message` when some rows are not a frame; :func:`read_relayed` takes either
  apart);
- the sidecars (agent/sidecar.py, control/rescue.py): a :class:`ReportRequest` in,
  a :class:`SidecarHello` once and a :class:`SidecarReport` per request out
  (:func:`report_from` reads one on the notebook's side).

The envelope: a message is one JSON object carrying the session ``key`` (:func:`seal`,
:func:`encode`); a frame without the right key, or that does not parse, is dropped
(:func:`checked` and the decoders return None), so a stray or hostile sender can never
make a rank step. Nothing received is unpickled or executed. A socket's identity is the
rank (:func:`identity`) or, for a relay, ``relay:<rank>`` (:func:`relay_identity`).

A reply's step records (whole-step summaries: the per-parameter tuples stay on the rank)
travel as a second zmq frame after the JSON one: packed binary rows
(:mod:`dtlab.records.packed`), which the notebook takes in without a Python object per
record. :func:`frames` and :func:`reply_from` are the two ends.

The agreement cadence (:func:`agree_every`, :func:`next_agree_every`,
:func:`failure_grace`) is here too: the notebook picks a run's first ``agree_every`` and
the ranks space their later agreements by the same rule.

Words the protocol compares (reply kinds, request ops, how a run stopped) are str enums
(:class:`ReplyKind`, :class:`Op`, :class:`Stop`): equal to their text, JSON as their text.
How to change the wire: docs/design.md, "How to add ... a wire change".
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

from dtlab.records.hangs import RankReport
from dtlab.records.ranks import RemoteFailure
from dtlab.records.steps import Condition
from dtlab.records.words import Word


class ReplyKind(Word):
    """What a reply says: HELLO to UNREACHABLE on the stepping channel (REPLY_KINDS),
    HELLO and REPORT from a sidecar."""

    HELLO = "hello"  # connected (each rank once per channel; its route, through a relay)
    PROGRESS = "progress"  # still stepping; the steps since the last reply
    DONE = "done"  # the run is over on this rank
    ERROR = "error"  # the run failed on this rank (or its relay failed: RelayError)
    UNREACHABLE = "unreachable"  # from a relay: it could not forward the command to the rank
    REPORT = "report"  # a sidecar's answer to a ReportRequest


class Op(Word):
    """What a request asks."""

    RUN = "run"  # RunRequest
    PAUSE = "pause"  # PauseRequest
    REPORT = "report"  # ReportRequest (to a sidecar)


class Stop(Word):
    """How a rank's run ended (a done reply's ``stopped``)."""

    STEPS = "steps"  # all steps made
    UNTIL = "until"  # the condition met
    PAUSE = "pause"  # a pause asked
    ERROR = "error"  # a failure, its own or a peer's
    ENDED = "ended"  # a script job whose script is over


REPLY_KINDS = (
    ReplyKind.HELLO,
    ReplyKind.PROGRESS,
    ReplyKind.DONE,
    ReplyKind.ERROR,
    ReplyKind.UNREACHABLE,
)
_REPLY_KIND = {kind.value: kind for kind in REPLY_KINDS}
STOPS = tuple(Stop)
ENDS = (ReplyKind.DONE, ReplyKind.ERROR)  # a rank's last reply to a run
# the last word of or about a rank in a run (a relay's "unreachable" included)
FINISHED = (ReplyKind.DONE, ReplyKind.ERROR, ReplyKind.UNREACHABLE)

# the first frame of a relay's message (agent/relay.py): JOINED, the replies of its host's
# ranks as one JSON list and their packed rows as one frame; BATCH (when some rank's rows
# are not valid, so the notebook says whose), each reply's frames as the rank sent them
JOINED = b"DTRJ"
BATCH = b"DTRB"

# The largest frame (one part of a zmq message) any dtlab socket takes in: zmq.MAXMSGSIZE
# on each (control/channel.py, agent/relay.py), so a stranger's larger frame is refused
# from its header (its peer disconnected) before a byte of it is held. The largest
# legitimate frame is a rank's reply's rows: the steps made since its last reply (ranks
# reply every REPORT_S = 0.25 s while stepping), a 255-byte row (records.row.ROW) and 8
# bytes per sample index each. 64 MiB is ~260,000 rows, or 7,900 steps of 1,024 samples
# in 0.25 s (32,000 steps a second): no job's; a JSON frame (a reply, a report, a script's
# output of 0.25 s) is far smaller. A relay joins its ranks' replies into one message of
# at most JOIN_BUDGET (agent/relay.py sends up what it holds before it would pass it), so
# a joined frame is either within that or one rank's reply re-framed (its rows or JSON
# plus a header of ~100 bytes: FRAME_SLACK), never cut off.
MAX_FRAME = 64 * 2**20  # what a relay takes from its host's ranks (zmq.MAXMSGSIZE)
FRAME_SLACK = 2**16
MAX_RECEIVED = MAX_FRAME + FRAME_SLACK  # what the channel and a group relay take
JOIN_BUDGET = MAX_FRAME // 2  # what a relay joins into one message (its frames' bytes)
# messages a receive reads before it returns (the rest wait, queued in zmq, for the next):
# more than a step brings at any size (one a rank when it is not relayed)
RECEIVE_AT_MOST = 16_384


# --- the envelope -------------------------------------------------------------------------
class Message(Protocol):
    """Anything that travels: a typed message as JSON-able data (without the key)."""

    def to_dict(self) -> dict: ...


def new_key() -> str:
    """A fresh session key (one per channel: the sidecars' is another)."""
    return secrets.token_hex(16)


def key_token(key: str) -> str:
    """A short name derived from the key, not the secret (socket paths, autosave names)."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def identity(rank: int) -> bytes:
    """The zmq identity of a rank's socket (stepping and sidecar): the notebook's ROUTER
    and a relay's address it by this."""
    return str(rank).encode()


def relay_identity(rank: int) -> bytes:
    """The zmq identity of the relay that ``rank`` runs (up to the notebook or a group
    relay)."""
    return f"relay:{rank}".encode()


_RELAY = re.compile(rb"^relay:\d+$")


def is_relay(sender: bytes) -> bool:
    """Is ``sender`` a relay's identity (a group relay takes only relays' messages)?"""
    return _RELAY.fullmatch(sender) is not None


def seal(fields: dict, key: str) -> bytes:
    """``fields`` as one JSON object, the session key first."""
    return json.dumps({"key": key, **fields}).encode()


def encode(message: Message, key: str) -> bytes:
    """The message as JSON with the session key (a reply's rows not included)."""
    return seal(message.to_dict(), key)


def frames(message: Message, key: str) -> list[bytes]:
    """The zmq frames of a message: its JSON, then a reply's packed rows if it has any."""
    first = encode(message, key)
    rows = getattr(message, "rows", b"")
    return [first, rows] if rows else [first]


def checked(frame: bytes, key: str) -> dict | None:
    """The frame's JSON object if it carries the session key, else None."""
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError):  # (nested too deep to parse: not ours either)
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def unkeyed(data: dict) -> dict:
    """A received JSON object without its key (as replies travel inside a relay's)."""
    return {k: v for k, v in data.items() if k != "key"}


class Envelope(NamedTuple):
    """One reply as it travels: its JSON object (the key checked), its JSON frame, and the
    frame of packed rows after it (b"": none)."""

    data: dict
    frame: bytes
    rows: bytes


def read_direct(body: list[bytes], key: str) -> Envelope | None:
    """A reply as a rank sends it (its frames after the sender's identity: its JSON, maybe
    its rows), or None if it is not one of ours."""
    if len(body) not in (1, 2) or (data := checked(body[0], key)) is None:
        return None
    return Envelope(data, body[0], body[1] if len(body) == 2 else b"")


# --- the stepping channel -----------------------------------------------------------------
@dataclass(frozen=True)
class RunRequest:
    """Notebook -> rank: make up to ``steps`` steps, paused together at the end.

    ``until``: stop after the step where it holds (checked on every rank after every
    step); ``record``: per-parameter statistics on or off (None: the job's default);
    ``agree_every``: steps between the ranks' agreements at the start (:func:`agree_every`);
    ``regroup``: rebuild the control group first (the last run ended in an error);
    ``watch``: name the first module whose output is not finite; ``outputs``: fingerprint
    every module's output.
    """

    op: ClassVar[Op] = Op.RUN
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

    op: ClassVar[Op] = Op.PAUSE

    def to_dict(self) -> dict:
        return {"op": self.op}

    @classmethod
    def from_dict(cls, data: dict) -> PauseRequest:
        return cls()


Request = RunRequest | PauseRequest
REQUESTS: dict[str, type[RunRequest] | type[PauseRequest]] = {
    Op.RUN: RunRequest,
    Op.PAUSE: PauseRequest,
}

# a reply's fields left out where they hold these (RankReply.to_dict(sparse=True))
_DEFAULTS = {"step": 0, "attach": None, "stopped": None, "hit": False, "output": "", "error": None}


@dataclass(slots=True)  # not frozen: that costs ~1.5 us a reply, 512 replies a step
class RankReply:
    """Rank -> notebook: where the rank stands in the run ``id`` (None: not in a run).
    Treated as immutable: nothing changes a reply once it is made."""

    kind: ReplyKind  # one of REPLY_KINDS
    id: int | None
    rank: int
    step: int = 0  # the job's step count when sent
    attach: int | None = None  # how many jobs were attached on this rank so far
    rows: bytes = b""  # the steps made since the last reply, packed (records.packed)
    stopped: str | None = None  # done replies: one of STOPS
    hit: bool = False  # done replies: the condition held at the last step on this rank
    output: str = ""  # what a script job printed since the last reply
    error: RemoteFailure | None = None  # error replies

    def to_dict(self, *, sparse: bool = False) -> dict:
        """The reply as JSON-able data, without its rows (they travel as their own frame);
        ``sparse``: without the fields at their defaults (the replies a relay makes)."""
        error = self.error
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "rows"}
        data = {
            **fields,
            "error": (
                {"ename": error.ename, "evalue": error.evalue, "traceback": error.traceback}
                if error
                else None
            ),
        }
        if sparse:
            return {k: v for k, v in data.items() if k not in _DEFAULTS or v != _DEFAULTS[k]}
        return data

    @classmethod
    def from_dict(cls, data: dict, rows: bytes = b"") -> RankReply:
        """The reply in ``data`` (KeyError: its kind is not one of REPLY_KINDS)."""
        error = data.get("error")
        msg_id = data.get("id")
        return cls(
            kind=_REPLY_KIND[data["kind"]],
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
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in _REPLY_KIND:
        return None
    try:
        return RankReply.from_dict(data, rows)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


# --- the agreement cadence (both ends) ----------------------------------------------------
AGREE_S = 1.0  # in a plain multi-step run, ranks agree (pause?) about this often: one
# agreement costs ~5 ms at 8 ranks on 2 cores, so agreeing at every step of a 30 ms job
# would add ~15%
MAX_AGREE_EVERY = 1000


def agree_every(step_s: float | None) -> int:
    """Steps between the ranks' agreements, so that they are ~AGREE_S apart at ``step_s``
    seconds a step (1 when the step time is not known yet). The notebook sends it as a
    run's first ``agree_every``; a rank spaces its later agreements by it too."""
    if step_s is None:
        return 1
    return max(1, min(MAX_AGREE_EVERY, int(AGREE_S / max(step_s, 1e-4))))


def next_agree_every(current: int, step_s: float) -> int:
    """A rank's steps to its next agreement, after one that said the slowest rank takes
    ``step_s`` seconds a step (the same on every rank, so they meet again): twice as many
    as ``current``, up to :func:`agree_every`. Doubling keeps the first steps of a new job
    watched closely (a failure there stops the peers within as many steps again) at
    log2(n) agreements."""
    return min(agree_every(step_s), 2 * current)


def failure_grace(step_s: float | None, least: float) -> float:
    """After a rank failed, how long the others may take to reach their next agreement
    (where they hear of it), at least ``least`` seconds."""
    if step_s is None:
        return least
    return max(least, 2 * (agree_every(step_s) + 1) * step_s)


# --- relays -------------------------------------------------------------------------------
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
            RankReply(
                ReplyKind.DONE, self.id, rank, step=step, attach=self.attach, stopped=self.stopped
            )
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
        data.get("kind") == ReplyKind.DONE
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


def naming(ranks: list[int]) -> bytes:
    """The end of a command's JSON that names the ranks its relay forwards it to ("to");
    the channel makes it once per relay and ranks."""
    return b', "to": %s}' % json.dumps(ranks).encode()


def addressed(frame: bytes, names: bytes) -> bytes:
    """A command's frame (:func:`encode`) naming its ranks (``names``: :func:`naming`)."""
    return frame[:-1] + names


def readdressed(command: dict, ranks: list[int]) -> bytes:
    """A command as received (key and all), naming ``ranks`` instead (a group relay
    forwards it to another host's relay)."""
    return json.dumps({**command, "to": ranks}).encode()


def addressees(command: dict) -> list[int]:
    """The ranks a command for a relay names."""
    to = command.get("to")
    return [r for r in to if type(r) is int] if isinstance(to, list) else []


def run_of(command: dict) -> int | None:
    """The run a command starts (None: it is not a run)."""
    run = command.get("id") if command.get("op") == Op.RUN else None
    return run if type(run) is int else None


def relay_reply(reply: RankReply, key: str) -> Envelope:
    """A reply a relay makes itself for a rank (``unreachable``, or ``error`` when the
    relay failed), as the rank's would travel; only its fields not at their defaults."""
    data = {"key": key, **reply.to_dict(sparse=True)}
    return Envelope(data, json.dumps(data).encode(), reply.rows)


def joined_message(
    key: str, replies: list[dict], groups: Iterable[DoneGroup], rows: bytes
) -> list[bytes]:
    """A relay's replies as one message: ``replies`` (JSON objects without the key:
    :func:`unkeyed`), plain done replies as ``groups``, and every reply's packed rows as
    one frame ``rows``, rank after rank (records.packed.concat; b"": none)."""
    header = seal({"replies": replies, "done": [group.to_dict() for group in groups]}, key)
    return [JOINED, header, rows]


def batch_message(replies: Iterable[Envelope]) -> list[bytes]:
    """A relay's replies each as its rank sent it (when some rows are not a frame)."""
    return [BATCH, *(part for reply in replies for part in (reply.frame, reply.rows))]


class Relayed(NamedTuple):
    """A relay's message taken apart (:func:`read_relayed`)."""

    joined: bool  # JOINED (else BATCH)
    # JOINED: each reply's JSON object, without the key (frame and rows b""); BATCH: each
    # reply whose key is right, as its rank sent it
    replies: list[Envelope]
    # JOINED: its plain done replies as groups (those that are valid), None when it had no
    # list of them; BATCH: []
    done: list[DoneGroup] | None
    rows: bytes  # JOINED: the replies' packed rows, one frame (b"": none); BATCH: b""


def read_relayed(body: list[bytes], key: str) -> Relayed | None:
    """A relay's message (its frames after the sender's identity), or None if it is not
    one: neither JOINED nor BATCH, frames that do not pair, or a JOINED header without
    the session key or a list of replies."""
    if len(body) == 3 and body[0] == JOINED:
        header = checked(body[1], key)
        found = header.get("replies") if header is not None else None
        if header is None or not isinstance(found, list):
            return None
        groups = header.get("done")
        done = (
            [g for g in map(DoneGroup.from_dict, groups) if g is not None]
            if isinstance(groups, list)
            else None
        )
        replies = [Envelope(data, b"", b"") for data in found if isinstance(data, dict)]
        return Relayed(True, replies, done, body[2])
    if len(body) > 2 and body[0] == BATCH and len(body) % 2 == 1:
        replies = [
            Envelope(data, frame, rows)
            for frame, rows in zip(body[1::2], body[2::2], strict=True)
            if (data := checked(frame, key)) is not None
        ]
        return Relayed(False, replies, [], b"")
    return None


# --- the sidecars -------------------------------------------------------------------------
@dataclass(frozen=True)
class ReportRequest:
    """Notebook -> a rank's sidecar: say what the rank is doing (answered by a
    :class:`SidecarReport` with the same ``id``)."""

    op: ClassVar[Op] = Op.REPORT
    id: int | None

    def to_dict(self) -> dict:
        return {"op": self.op, "id": self.id}


def decode_report_request(frame: bytes, key: str) -> ReportRequest | None:
    """A sidecar's request from the notebook, or None for a frame that is not one."""
    data = checked(frame, key)
    if data is None or data.get("op") != Op.REPORT:
        return None
    asked = data.get("id")
    return ReportRequest(asked if type(asked) is int else None)


@dataclass(frozen=True)
class SidecarHello:
    """A rank's sidecar -> notebook, once on connecting."""

    rank: int
    kind: ClassVar[ReplyKind] = ReplyKind.HELLO

    def to_dict(self) -> dict:
        return {"rank": self.rank, "kind": self.kind}


@dataclass(frozen=True)
class SidecarReport:
    """A rank's sidecar -> notebook: what the rank is doing (read as a
    :class:`~dtlab.records.hangs.RankReport` by :func:`report_from`)."""

    id: int | None  # the ReportRequest's
    rank: int
    stack: list = field(default_factory=list)  # [file, line, function, code], outermost first
    collectives: list[dict] = field(default_factory=list)  # the last ones of each group
    step: int | None = None  # the attached job's step counter
    error: str | None = None  # why the report could not be taken (then no step)
    kind: ClassVar[ReplyKind] = ReplyKind.REPORT

    def to_dict(self) -> dict:
        found = {"error": self.error} if self.error is not None else {"step": self.step}
        return {
            "rank": self.rank,
            "kind": self.kind,
            "id": self.id,
            "stack": self.stack,
            "collectives": self.collectives,
            **found,
        }


def report_from(data: dict, asked: int) -> RankReport | None:
    """The rank's report in a sidecar's reply (its JSON object, the key checked: as the
    Channel receives it) if it answers the ReportRequest ``asked``, else None."""
    if data.get("kind") != ReplyKind.REPORT or data.get("id") != asked:
        return None
    rank = data.get("rank")
    return RankReport.from_dict(rank, data) if isinstance(rank, int) else None

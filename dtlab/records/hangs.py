"""What a rank's sidecar says it is doing when asked (its stack and recent collectives),
and what the notebook makes of every rank's answer (a verdict, in a hang report)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as torch's Flight Recorder saw it on a rank."""

    group: str  # "default_pg", "dtlab_control", ... (a description: not unique)
    seq: int  # its number within the group (the same collective has the same on every rank)
    op: str  # "all_reduce", "broadcast", ...
    sizes: tuple  # input tensor shapes
    done: bool  # completed on this rank
    group_id: str = ""  # the group's name in torch.distributed: unique while it lives
    members: tuple[int, ...] = ()  # the group's ranks (empty: not known)
    dtypes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankReport:
    """What a rank was doing when asked, taken out of band (the main thread may be stuck)."""

    rank: int
    stack: tuple[tuple[str, int, str, str], ...]  # (file, line, function, code), outermost first
    collectives: tuple[CollectiveCall, ...] = ()  # oldest first, the last few per group
    step: int | None = None  # the attached job's step counter

    @classmethod
    def from_dict(cls, rank: int, data: Mapping) -> RankReport:
        return cls(
            rank,
            tuple((str(f), int(n), str(fn), str(code)) for f, n, fn, code in data.get("stack", ())),
            tuple(
                CollectiveCall(
                    c["group"],
                    int(c["seq"]),
                    c["op"],
                    tuple(tuple(s) for s in c.get("sizes", ())),
                    bool(c["done"]),
                    str(c.get("group_id", c["group"])),
                    tuple(int(r) for r in c.get("members", ())),
                    tuple(str(d) for d in c.get("dtypes", ())),
                )
                for c in data.get("collectives", ())
            ),
            data.get("step"),
        )


@dataclass(frozen=True)
class HangVerdict:
    summary: str
    collective: CollectiveCall | None = None  # the one ranks are blocked in
    waiting: tuple[int, ...] = ()  # ranks blocked in it
    missing: tuple[int, ...] = ()  # ranks that never entered it (or dead)
    mismatch: bool = False
    where: dict[int, str] = field(default_factory=dict)  # rank -> what it is doing


@dataclass(frozen=True)
class HangReport:
    """Every rank's stack and collectives, taken out of band, and the verdict."""

    verdict: HangVerdict
    reports: dict[int, RankReport | None]  # None: the rank did not answer
    dead: dict[int, str] = field(default_factory=dict)  # rank -> how it died
    taken: float = 0.0  # time.time()

    def summary(self) -> str:
        return self.verdict.summary

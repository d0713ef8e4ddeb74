"""Why ranks are stuck: a verdict from every rank's out-of-band report (pure).

Input: ``{rank: RankReport}`` (``None`` for a rank whose sidecar did not answer) and the
ranks known dead with how they died. In order:

1. a collective whose op or tensor shapes differ across ranks at the same sequence number
   of a group (gloo then returns garbage on some ranks and blocks others);
2. ranks blocked in collective #S of a group that other ranks never entered: those are
   named with where they are instead (a line of their code, idle, or dead);
3. otherwise no rank is inside a collective: where each rank is.
"""

from __future__ import annotations

from collections.abc import Mapping

from dtlab.analysis.ranks import label_ranks
from dtlab.records import CollectiveCall, HangVerdict, RankReport
from dtlab.records.job_folder import JobFolder

# frames of these are the machinery a rank waits in, not what it is doing
_MACHINERY = (
    "/asyncio/",
    "/selectors.py",
    "/zmq/",
    "/tornado/",
    "/ipykernel/",
    "/IPython/",
    "/ipyparallel/",
    "/threading.py",
    "/traitlets/",
    "/concurrent/",
    "/dtlab/control/forkserver.py",
    "<frozen",
)
# and of these (with dtlab's wrappers around a script's calls) what it calls
_LIBRARY = ("/site-packages/", "/lib/python3", "/dtlab/agent/script", "/dtlab/agent/hooks.py")
# ops whose every rank passes the same shapes (scatter, gather, all_to_all legitimately differ)
SAME_SHAPES = {
    "all_reduce",
    "allreduce",
    "broadcast",
    "reduce",
    "all_gather",
    "allgather",
    "_allgather_base",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "barrier",
}
GROUP_ROLES = {
    "default_pg": "the default group: DDP gradients and your collectives",
    "dtlab_control": "dtlab's step agreement",
}


SILENT = "did not answer (its sidecar is gone or the GIL is held)"


def where(report: RankReport | None, dead: str | None = None, silent: str = SILENT) -> str:
    """``in `train_step` (train.py:42: loss.backward())``, ``idle``, ``dead (...)``;
    ``silent`` for a rank with no report."""
    if dead is not None:
        return f"dead ({dead})"
    if report is None:
        return silent
    own = [f for f in report.stack if not any(m in f[0] for m in _MACHINERY)]
    if not own:
        return "idle (waiting for the notebook)"
    user = [f for f in own if not any(lib in f[0] for lib in _LIBRARY)] or own
    file, line, function, code = user[-1]
    text = f"in `{function}` ({file.rsplit('/', 1)[-1]}:{line}" + (f": {code})" if code else ")")
    inner = own[-1]
    if inner is not user[-1]:
        text += f", inside `{inner[2]}` ({inner[0].rsplit('/', 1)[-1]}:{inner[1]})"
    return text


def describe_call(call: CollectiveCall) -> str:
    role = GROUP_ROLES.get(call.group)
    return f"{call.op} #{call.seq} on {call.group}" + (f" ({role})" if role else "")


def diagnose(
    reports: Mapping[int, RankReport | None],
    dead: Mapping[int, str] | None = None,
    silent: str = SILENT,
) -> HangVerdict:
    dead = dict(dead or {})
    places = {
        r: where(reports.get(r), dead.get(r), silent) for r in sorted(set(reports) | set(dead))
    }
    found = _mismatch(reports) or _blocked(reports, dead, silent)
    if found is None:
        return HangVerdict(f"no rank is inside a collective: {_list(places)}", where=places)
    verdict, call, waiting, missing, mismatch = found
    return HangVerdict(verdict, call, waiting, missing, mismatch, places)


def _key(call: CollectiveCall) -> str:
    return call.group_id or call.group


def _calls(reports) -> dict[tuple[str, int], dict[int, CollectiveCall]]:
    by_key: dict[tuple[str, int], dict[int, CollectiveCall]] = {}
    for rank, report in reports.items():
        for call in report.collectives if report else ():
            by_key.setdefault((_key(call), call.seq), {})[rank] = call
    return by_key


# (verdict, the call, ranks waiting in it, ranks missing from it, a mismatch?)
_Found = tuple[str, CollectiveCall, tuple[int, ...], tuple[int, ...], bool]


def _mismatch(reports: Mapping[int, RankReport | None]) -> _Found | None:
    """The first collective, still pending on some rank, that ranks called differently."""
    for key, calls in sorted(_calls(reports).items(), key=lambda kv: kv[0][1]):
        if all(c.done for c in calls.values()):
            continue  # finished everywhere: history, not why anything is stuck now
        shapes: dict[tuple, list[int]] = {}
        for rank, call in calls.items():
            how = (call.sizes, call.dtypes) if call.op in SAME_SHAPES else ((), ())
            shapes.setdefault((call.op, *how), []).append(rank)
        if len(shapes) < 2:
            continue
        dtypes_differ = len({dtypes for _, _, dtypes in shapes}) > 1
        ordered = sorted(shapes.items(), key=lambda kv: len(kv[1]))
        parts = [
            f"{label_ranks(ranks)} passed {op} {_sizes(sizes)}"
            + (f" ({', '.join(dtypes)})" if dtypes_differ and dtypes else "")
            for (op, sizes, dtypes), ranks in ordered
        ]
        first = next(iter(calls.values()))
        text = (
            f"mismatched collective #{key[1]} on {first.group}: {'; '.join(parts)}; the "
            "ranks must pass the same op, shapes and dtypes (gloo then returns garbage to "
            "some ranks and blocks others)"
        )
        blocked = tuple(sorted(r for r, c in calls.items() if not c.done))
        fewest = min(shapes.values(), key=len)
        odd = tuple(sorted(fewest))
        return text, first, blocked, odd, True
    return None


def _blocked(
    reports: Mapping[int, RankReport | None], dead: Mapping[int, str], silent: str
) -> _Found | None:
    pending: dict[str, dict[int, CollectiveCall]] = {}  # group -> {rank: oldest not done}
    for rank, report in reports.items():
        for call in report.collectives if report else ():
            if not call.done:
                pending.setdefault(_key(call), {}).setdefault(rank, call)
    if not pending:
        return None
    # the job's own group first, then the group with the most ranks waiting
    group = max(
        pending,
        key=lambda g: (next(iter(pending[g].values())).group == "default_pg", len(pending[g])),
    )
    target = max(pending[group].values(), key=lambda c: c.seq)
    waiting = tuple(sorted(r for r, c in pending[group].items() if c.seq == target.seq))
    members = set(target.members) or set(reports) | set(dead)  # only ranks of that group
    missing = tuple(
        sorted(
            r for r in members if r not in waiting and _last_seq(reports.get(r), group) < target.seq
        )
    )
    text = (
        f"{label_ranks(waiting)} {'is' if len(waiting) == 1 else 'are'} in {describe_call(target)}"
    )
    if missing:
        places = {r: where(reports.get(r), dead.get(r), silent) for r in missing}
        text += f"; {label_ranks(missing)} never entered it: {_list(places)}"
    else:
        text += "; every rank entered it and none completed it"
    return text, target, waiting, missing, False


def _last_seq(report: RankReport | None, group: str) -> int:
    seqs = [c.seq for c in report.collectives if _key(c) == group] if report else []
    return max(seqs, default=-1)


def _list(places: Mapping[int, str]) -> str:
    by_place: dict[str, list[int]] = {}
    for rank, place in places.items():
        by_place.setdefault(place, []).append(rank)
    return "; ".join(f"{label_ranks(ranks)} {place}" for place, ranks in by_place.items())


def _sizes(sizes: tuple) -> str:
    return ", ".join("[" + ", ".join(str(n) for n in s) + "]" for s in sizes) or "[]"


def folder_verdict(job: JobFolder) -> HangVerdict | None:
    """The verdict on a job that ``-m dtlab.run`` left hung, from the reports its ranks'
    watchdogs wrote (a rank that stepped on since is left out) and how ranks ended; None
    when no rank is hung or no report holds a stack (written by an older dtlab)."""
    reports = {
        r: h.report for r, h in job.hangs.items() if h.resumed is None and h.report is not None
    }
    if not reports:
        return None
    dead = {r: o.describe().removeprefix(f"rank {r} ") for r, o in job.outcomes.items() if o.bad}
    for rank, text in job.fatal.items():
        if rank not in job.outcomes:
            dead[rank] = f"a fatal signal: {text.strip().splitlines()[0]}"
    return diagnose(reports, dead, silent="wrote no hang report (stepping, or gone)")

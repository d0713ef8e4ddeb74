"""Rank sets: parse what a user types (``0,3``, ``0-3``, ``even``) and print them back short."""

from __future__ import annotations

from collections.abc import Iterable

from dtlab.records.errors import InputError

_NAMED = {
    "all": lambda n: range(n),
    "even": lambda n: range(0, n, 2),
    "odd": lambda n: range(1, n, 2),
}


def parse_rank_spec(spec: str, world_size: int) -> tuple[int, ...]:
    """Ranks named by ``spec`` in a world of ``world_size``, sorted and unique.

    Accepts ``all``, ``even``, ``odd``, and comma-separated ranks and ranges: ``0,3``,
    ``0-3``, ``1,4-6``. Raises InputError naming the bad part and the valid ranks.
    """
    text = spec.strip().lower()
    valid = f"valid ranks are 0-{world_size - 1}" if world_size > 1 else "the only rank is 0"
    if text in _NAMED:
        return tuple(_NAMED[text](world_size))
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InputError(
                f"bad rank spec {spec!r}: {part!r} is not a rank or a range like 0-3; "
                "use e.g. 0,3 or 0-3 or all / even / odd"
            )
        first, last = int(lo), int(hi) if sep else int(lo)
        if first > last:
            raise InputError(f"bad rank range {part!r} in {spec!r}: write it low-high")
        if last >= world_size:
            raise InputError(f"rank {last} in {spec!r} does not exist: {valid}")
        ranks.update(range(first, last + 1))
    return tuple(sorted(ranks))


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0-3,5"``."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    start = prev = None
    for r in ordered:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(runs)


def label_ranks(ranks: Iterable[int]) -> str:
    """``"rank 3"`` or ``"ranks 0-3,5"`` (``"no rank"`` for none)."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {format_ranks(ordered)}"

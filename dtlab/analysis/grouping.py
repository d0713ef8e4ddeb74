"""Group identical per-rank values so eight ranks do not print eight copies."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

V = TypeVar("V", bound=Hashable)


def group_by_value(by_rank: Mapping[int, V]) -> list[tuple[tuple[int, ...], V]]:
    """``{0: "a", 1: "a", 2: "b"}`` -> ``[((0, 1), "a"), ((2,), "b")]``, by first rank."""
    groups: dict[V, list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    return sorted(((tuple(ranks), value) for value, ranks in groups.items()), key=lambda g: g[0])

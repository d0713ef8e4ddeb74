"""Cross-rank consistency of versions, settings and environment (combine step).

Collected on each rank as :class:`dtlab.records.RankInfo`; this module compares them.
Differences in these are a classic source of "metaphysical" distributed bugs: one rank on
another torch build, NCCL_* set in one shell but not the other, a different thread count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import label_ranks
from dtlab.records import RankInfo

COMPARED_FIELDS = (
    "python_version",
    "torch_version",
    "cuda_version",
    "nccl_version",
    "backend",
    "num_threads",
)
# Launchers that give each process one GPU set these per rank on purpose.
# set per rank on purpose (device and CPU pinning)
EXPECTED_PER_RANK = frozenset(
    {"CUDA_VISIBLE_DEVICES", "OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY"}
)
UNSET = None


@dataclass(frozen=True)
class Inconsistency:
    """One setting whose value is not the same on every rank."""

    name: str  # a RankInfo field, or "env NAME"
    groups: tuple[tuple[tuple[int, ...], str | None], ...]  # (ranks, value); None = unset
    expected_per_rank: bool = False

    def describe(self) -> str:
        parts = [
            f"{label_ranks(ranks)} = {'unset' if value is UNSET else repr(value)}"
            for ranks, value in self.groups
        ]
        note = " (usual when each process is given its own GPU)" if self.expected_per_rank else ""
        return f"{self.name} differs: {'; '.join(parts)}{note}"


def _compare(name: str, by_rank: Mapping[int, str | None], per_rank_ok: bool = False):
    groups = group_by_value(by_rank)
    if len(groups) > 1:
        return Inconsistency(name, tuple(groups), per_rank_ok)
    return None


def find_inconsistencies(infos: Mapping[int, RankInfo]) -> list[Inconsistency]:
    """Every compared field or relevant environment variable that differs across ranks."""
    found = []
    for field in COMPARED_FIELDS:
        by_rank = {r: _text(getattr(info, field)) for r, info in infos.items()}
        found.append(_compare(field, by_rank))
    names = sorted({name for info in infos.values() for name in info.env})
    for name in names:
        by_rank = {r: info.env.get(name, UNSET) for r, info in infos.items()}
        found.append(_compare(f"env {name}", by_rank, name in EXPECTED_PER_RANK))
    return [f for f in found if f is not None]


def _text(value) -> str | None:
    return UNSET if value is None else str(value)

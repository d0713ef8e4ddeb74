"""Pipeline partition plans: which contiguous run of blocks each stage holds.

A :class:`Plan` is plain data that travels to the ranks and back; a plan that cannot be
used raises :class:`PlanError` with what is wrong and the fix. The forms users write a
plan in are read by :func:`dtlab.analysis.partition.parse_plan`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TypeGuard

from dtlab.records.errors import InputError


class PlanError(InputError):
    """A partition plan that cannot be used; the message says what is wrong and the fix."""


@dataclass(frozen=True)
class Plan:
    """``blocks`` in model order; stage ``s`` holds ``blocks[bounds[s]:bounds[s + 1]]``
    (``bounds`` starts at 0, strictly increases, and ends with ``len(blocks)``: DeepSpeed's
    ``parts`` list)."""

    blocks: tuple[str, ...]
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.blocks, str) or isinstance(self.bounds, str):
            raise PlanError("a Plan takes a sequence of block names and a sequence of ints")
        # lists are accepted but stored as tuples, so plans stay hashable and compare equal
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "bounds", tuple(self.bounds))
        check_blocks(self.blocks)
        check_bounds(self.bounds, len(self.blocks))

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_blocks(self, stage: int) -> tuple[str, ...]:
        if not 0 <= stage < self.num_stages:
            raise PlanError(f"no stage {stage}: this plan has stages 0..{self.num_stages - 1}")
        return self.blocks[self.bounds[stage] : self.bounds[stage + 1]]

    def stage_map(self) -> dict[str, int]:
        return {b: s for s in range(self.num_stages) for b in self.stage_blocks(s)}

    def stage_of(self, block: str) -> int:
        stages = self.stage_map()
        if block not in stages:
            raise PlanError(f"no block {block!r} in this plan{suggest(block, self.blocks)}")
        return stages[block]

    def describe(self) -> str:
        """``"stage 0: embed, blocks.0 | stage 1: blocks.1-blocks.2 | ..."``"""
        return " | ".join(
            f"stage {s}: {compact(self.stage_blocks(s))}" for s in range(self.num_stages)
        )

    def moves_to(self, other: Plan) -> dict[str, tuple[int, int]]:
        """``{block: (stage here, stage in other)}`` for the blocks that change stage."""
        if other.blocks != self.blocks:
            only = sorted(set(self.blocks) ^ set(other.blocks)) or ["(same names, other order)"]
            raise PlanError(
                f"the plans cover different blocks ({', '.join(only)}): "
                "compare plans of the same model"
            )
        old, new = self.stage_map(), other.stage_map()
        return {b: (old[b], new[b]) for b in self.blocks if old[b] != new[b]}


def is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def check_blocks(blocks: tuple[str, ...]) -> None:
    if not blocks or not all(isinstance(b, str) for b in blocks):
        raise PlanError(f"blocks must be a non-empty sequence of names (str), got {blocks!r}")
    repeated = sorted({b for b in blocks if blocks.count(b) > 1})
    if repeated:
        raise PlanError(f"block names repeat ({', '.join(repeated)}): each block needs its own")


def check_bounds(bounds: tuple[int, ...], n: int) -> None:
    shown = list(bounds)
    if not all(is_int(b) for b in bounds) or len(bounds) < 2:
        raise PlanError(f"bounds must be ints [0, ..., {n}] (one more than stages), got {shown}")
    bad = [b for b in bounds if not 0 <= b <= n]
    if bad:
        raise PlanError(f"boundary {bad[0]} out of range in {shown}: boundaries lie in 0..{n}")
    if bounds[0] != 0 or bounds[-1] != n:
        raise PlanError(f"bounds must start at 0 and end at {n} (the number of blocks): {shown}")
    for s, (lo, hi) in enumerate(pairwise(bounds)):
        if lo == hi:
            raise PlanError(
                f"stage {s} is empty: boundary {lo} repeats in {shown}; each stage needs a block"
            )
        if lo > hi:
            raise PlanError(
                f"boundaries decrease at stage {s} ({lo} > {hi}) in {shown}: stages would "
                "overlap; boundaries must strictly increase"
            )


def suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3)
    if close:
        return f" (did you mean {', '.join(map(repr, close))}?)"
    return f"; blocks: {', '.join(choices)}"


_NUMBERED = re.compile(r"(.*\.)(\d+)")


def compact(names: Sequence[str]) -> str:
    """``embed, blocks.0-blocks.3, norm``: runs of consecutively numbered blocks shortened."""
    parts: list[str] = []
    run: list[str] = []
    for name in [*names, None]:  # None: flush the last run
        match = _NUMBERED.fullmatch(name) if name is not None else None
        last = _NUMBERED.fullmatch(run[-1]) if run else None
        if match and last and match[1] == last[1] and int(match[2]) == int(last[2]) + 1:
            run.append(match.string)  # the name (a full match)
            continue
        parts.extend([f"{run[0]}-{run[-1]}"] if len(run) > 1 else run)
        run = [name] if name is not None else []
    return ", ".join(parts)

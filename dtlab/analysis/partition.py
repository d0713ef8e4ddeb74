"""Pipeline partition plans: which contiguous run of blocks each stage holds.

Pure (runs anywhere): parse the forms users know (boundary indices, per-stage block
names, regexes -> stage, and the methods ``uniform`` / ``parameters`` / ``measured``),
and refuse bad plans with a :class:`PlanError` that names the problem. The methods' cut
points come from :mod:`dtlab.analysis.partition_search`; exports to DeepSpeed's, Megatron's
and torchtitan's forms live in :mod:`dtlab.analysis.partition_export`.

    plan = parse_plan("measured", blocks, num_stages=4, costs=costs)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dtlab.analysis.partition_search import measured_bounds, min_max_bounds, uniform_bounds
from dtlab.records import BlockCost, Plan, PlanError
from dtlab.records.plans import check_blocks, compact, is_int, suggest

METHODS = ("uniform", "parameters", "measured")
_FORMS = (
    "give the inner cut indices ([2, 4, 6]: stage 1 starts at block 2, ...), DeepSpeed's "
    "parts list ([0, 2, 4, 6, 7]), one list of block names per stage, {regex: stage}, "
    f"a Plan, or a method ({', '.join(METHODS)})"
)


def parse_plan(
    spec: object,
    blocks: Sequence[str],
    num_stages: int,
    *,
    costs: Mapping[str, BlockCost] | None = None,
) -> Plan:
    """Turn any accepted form of a plan into a :class:`Plan` of ``num_stages`` stages."""
    blocks = tuple(blocks)
    check_blocks(blocks)
    if not is_int(num_stages) or num_stages < 1:
        raise PlanError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if num_stages > len(blocks):
        raise PlanError(
            f"{num_stages} stages but only {len(blocks)} blocks: each stage needs at least "
            f"one block; run the pipeline on at most {len(blocks)} ranks, or split the model "
            "into more blocks"
        )
    if isinstance(spec, str):
        return _from_method(spec, blocks, num_stages, costs)
    if isinstance(spec, Plan):
        if spec.blocks != blocks:
            raise PlanError(
                f"the plan covers blocks {compact(spec.blocks)} but the model has "
                f"{compact(blocks)}: build the plan from this model's blocks"
            )
        plan = spec
    elif isinstance(spec, Mapping):
        plan = _from_regexes(spec, blocks, num_stages)
    elif isinstance(spec, (list, tuple)) and all(is_int(x) for x in spec):
        return _from_ints(list(spec), blocks, num_stages)
    elif isinstance(spec, (list, tuple)) and all(isinstance(x, (list, tuple)) for x in spec):
        plan = _from_names(spec, blocks)
    else:
        raise PlanError(f"cannot read a plan from {spec!r}: {_FORMS}")
    _check_stage_count(plan.num_stages, num_stages)
    return plan


def optimal_split(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Bounds of the contiguous split whose largest stage sum is smallest.

    Among equally good splits: the most even (smallest sum of squares), then the one whose
    earlier stages are larger (as DeepSpeed's ``uniform`` gives the extra blocks first).
    """
    values = [float(w) for w in weights]
    if any(not math.isfinite(w) or w < 0 for w in values):
        raise PlanError(f"weights must be finite and >= 0, got {list(weights)!r}")
    if not is_int(num_stages) or not 1 <= num_stages <= len(values):
        raise PlanError(f"num_stages must lie in 1..{len(values)} (one block at least per stage)")
    return min_max_bounds(values, num_stages)


# -- validation -------------------------------------------------------------------------


def _stages_text(count: int, num_stages: int) -> str:
    ranks = "1 rank runs" if num_stages == 1 else f"{num_stages} ranks run"
    return f"the plan has {count} stages but {ranks} the pipeline: each rank runs one stage"


def _check_stage_count(count: int, num_stages: int) -> None:
    if count != num_stages:
        raise PlanError(f"{_stages_text(count, num_stages)}; give {num_stages} stages")


# -- the forms --------------------------------------------------------------------------


def _from_ints(ints: list[int], blocks: tuple[str, ...], num_stages: int) -> Plan:
    n = len(blocks)
    if len(ints) == num_stages + 1 and ints and (ints[0] == 0 or ints[-1] == n):
        return Plan(blocks, tuple(ints))  # DeepSpeed parts; Plan names what is wrong
    if len(ints) == num_stages - 1:
        bad = [c for c in ints if not 0 < c < n]
        if bad:
            raise PlanError(
                f"cut index {bad[0]} out of range in {ints}: inner cuts lie in 1..{n - 1} "
                f"(0 or {n} would leave a stage empty)"
            )
        return Plan(blocks, (0, *ints, n))
    as_parts = bool(ints) and ints[0] == 0 and ints[-1] == n
    count = len(ints) - 1 if as_parts else len(ints) + 1
    example = uniform_bounds(n, num_stages)
    raise PlanError(
        f"{_stages_text(count, num_stages)} (reading {ints} as "
        f"{'DeepSpeed parts' if as_parts else 'inner cuts'}). Give either the "
        f"{num_stages - 1} inner cut indices, like {list(example[1:-1])}, or DeepSpeed's "
        f"parts list of {num_stages + 1} ints from 0 to {n}, like {list(example)}"
    )


def _from_names(spec: Sequence[Sequence[Any]], blocks: tuple[str, ...]) -> Plan:
    for s, names in enumerate(spec):
        if not all(isinstance(name, str) for name in names):
            raise PlanError(f"stage {s}: expected a list of block names (str), got {names!r}")
        for name in names:
            if name not in blocks:
                raise PlanError(f"stage {s} lists unknown block {name!r}{suggest(name, blocks)}")
    return _from_stage_lists([tuple(names) for names in spec], blocks)


def _from_regexes(spec: Mapping[object, object], blocks: tuple[str, ...], num_stages: int) -> Plan:
    owner: dict[str, tuple[str, int]] = {}  # block -> the first regex that matched it, its stage
    for pattern, stage in spec.items():
        if not isinstance(pattern, str) or not is_int(stage):
            raise PlanError(
                f"a regex plan maps regex (str) -> stage (int), got {pattern!r}: {stage!r}"
            )
        if not 0 <= stage < num_stages:
            raise PlanError(
                f"regex {pattern!r} maps to stage {stage}, but stages run 0..{num_stages - 1} "
                f"({num_stages} ranks run the pipeline)"
            )
        try:
            hits = [b for b in blocks if re.fullmatch(pattern, b)]
        except re.error as exc:
            raise PlanError(f"regex {pattern!r} does not compile: {exc}") from None
        if not hits:
            raise PlanError(
                f"regex {pattern!r} matches no block (it must match a whole name); "
                f"blocks: {', '.join(blocks)}"
            )
        for b in hits:
            first = owner.setdefault(b, (pattern, stage))
            if first[1] != stage:
                raise PlanError(
                    f"block {b!r} is matched by {first[0]!r} (stage {first[1]}) and by "
                    f"{pattern!r} (stage {stage}): make the regexes disjoint"
                )
    unmatched = [b for b in blocks if b not in owner]
    if unmatched:
        raise PlanError(
            f"block(s) {', '.join(unmatched)} matched by no regex: add one mapping them to a stage"
        )
    stages = [tuple(b for b in blocks if owner[b][1] == s) for s in range(num_stages)]
    return _from_stage_lists(stages, blocks, empty_hint=" (no regex maps a block to it)")


def _from_stage_lists(
    stages: list[tuple[str, ...]], blocks: tuple[str, ...], empty_hint: str = ""
) -> Plan:
    seen: dict[str, int] = {}
    for s, names in enumerate(stages):
        for name in names:
            if name in seen:
                where = (
                    f"twice on stage {s}" if seen[name] == s else f"on stages {seen[name]} and {s}"
                )
                raise PlanError(f"block {name!r} is listed {where}: each block goes on one stage")
            seen[name] = s
    missing = [b for b in blocks if b not in seen]
    if missing:
        raise PlanError(f"block(s) {', '.join(missing)} on no stage: every block needs a stage")
    index = {b: i for i, b in enumerate(blocks)}
    bounds = [0]
    for s, names in enumerate(stages):
        if not names:
            raise PlanError(f"stage {s} is empty{empty_hint}: each stage needs at least one block")
        held = sorted(index[name] for name in names)
        gaps = [i for i in range(held[0], held[-1]) if i not in held]
        if gaps:
            gap = blocks[gaps[0]]
            raise PlanError(
                f"stage {s} is not contiguous: it holds {blocks[held[0]]!r} and "
                f"{blocks[held[-1]]!r} but not {gap!r} between them (on stage {seen[gap]}); "
                "a stage holds consecutive blocks in model order"
            )
        if held[0] != bounds[-1]:
            expected = blocks[bounds[-1]]
            raise PlanError(
                f"stages out of order: stage {s} starts at {blocks[held[0]]!r}, but the next "
                f"block in model order is {expected!r} (on stage {seen[expected]}); each "
                "stage continues where the one before ends"
            )
        bounds.append(held[-1] + 1)
    return Plan(blocks, tuple(bounds))


# -- the methods ------------------------------------------------------------------------


def _from_method(
    method: str,
    blocks: tuple[str, ...],
    num_stages: int,
    costs: Mapping[str, BlockCost] | None,
) -> Plan:
    if method == "uniform":
        return Plan(blocks, uniform_bounds(len(blocks), num_stages))
    if method == "parameters":
        params = [c.num_params for c in _costs_for(blocks, costs, timed=False)]
        return Plan(blocks, optimal_split(params, num_stages))
    if method == "measured":
        return Plan(blocks, measured_bounds(_costs_for(blocks, costs, timed=True), num_stages))
    raise PlanError(
        f"unknown partition method {method!r}: the methods are {', '.join(METHODS)} "
        "(or give the plan itself: boundaries, block lists or {regex: stage})"
    )


def _costs_for(
    blocks: tuple[str, ...], costs: Mapping[str, BlockCost] | None, *, timed: bool
) -> list[BlockCost]:
    costs = costs or {}
    missing = [b for b in blocks if b not in costs or (timed and not costs[b].measured)]
    if missing and timed:
        raise PlanError(
            f"method 'measured' needs every block's forward and backward time; no measurement "
            f"for {', '.join(missing)}: profile the blocks first (dt.profile_blocks()) and pass "
            "costs="
        )
    if missing:
        raise PlanError(
            f"method 'parameters' needs a BlockCost for every block; none for "
            f"{', '.join(missing)}: pass costs= (dt.profile_blocks() measures them)"
        )
    return [costs[b] for b in blocks]

"""Pipeline partition plans: which contiguous run of blocks each stage holds.

Pure (runs anywhere): parse the forms users know (boundary indices, per-stage block
names, regexes -> stage, and the methods ``uniform`` / ``parameters`` / ``measured``),
refuse bad plans with a :class:`PlanError` that names the problem, and export a plan in
DeepSpeed's, Megatron's and torchtitan's forms.

    plan = parse_plan("measured", blocks, num_stages=4, costs=costs)
    to_deepspeed(plan), to_torchtitan(plan), to_megatron(plan)
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from dtlab.stage_records import BlockCost

METHODS = ("uniform", "parameters", "measured")
# plans whose slowest stage is this close to the fastest possible count as equally fast, so
# "measured" may give up that much time for a stage memory that fits more easily
TIME_TOLERANCE = 0.02
# parameter + gradient + Adam's two moments, all the parameter's dtype
STATE_BYTES_PER_PARAM_BYTE = 4
_FORMS = (
    "give the inner cut indices ([2, 4, 6]: stage 1 starts at block 2, ...), DeepSpeed's "
    "parts list ([0, 2, 4, 6, 7]), one list of block names per stage, {regex: stage}, "
    f"a Plan, or a method ({', '.join(METHODS)})"
)


class PlanError(ValueError):
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
        _check_blocks(self.blocks)
        _check_bounds(self.bounds, len(self.blocks))

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
            raise PlanError(f"no block {block!r} in this plan{_suggest(block, self.blocks)}")
        return stages[block]

    def describe(self) -> str:
        """``"stage 0: embed, blocks.0 | stage 1: blocks.1-blocks.2 | ..."``"""
        return " | ".join(
            f"stage {s}: {_compact(self.stage_blocks(s))}" for s in range(self.num_stages)
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


def parse_plan(
    spec: object,
    blocks: Sequence[str],
    num_stages: int,
    *,
    costs: Mapping[str, BlockCost] | None = None,
) -> Plan:
    """Turn any accepted form of a plan into a :class:`Plan` of ``num_stages`` stages."""
    blocks = tuple(blocks)
    _check_blocks(blocks)
    if not _is_int(num_stages) or num_stages < 1:
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
                f"the plan covers blocks {_compact(spec.blocks)} but the model has "
                f"{_compact(blocks)}: build the plan from this model's blocks"
            )
        plan = spec
    elif isinstance(spec, Mapping):
        plan = _from_regexes(spec, blocks, num_stages)
    elif isinstance(spec, (list, tuple)) and all(_is_int(x) for x in spec):
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
    if not _is_int(num_stages) or not 1 <= num_stages <= len(values):
        raise PlanError(f"num_stages must lie in 1..{len(values)} (one block at least per stage)")
    prefix = _prefix(values)
    return _most_even(prefix, num_stages, _within(prefix, _min_max(prefix, num_stages, _any)))


def to_deepspeed(plan: Plan) -> list[int]:
    """DeepSpeed's ``parts`` list (``PipelineModule.parts``): the plan's bounds."""
    return list(plan.bounds)


def to_torchtitan(plan: Plan) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: one list of block names per stage."""
    return [list(plan.stage_blocks(s)) for s in range(plan.num_stages)]


def to_megatron(plan: Plan) -> str:
    """Megatron-core's ``--pipeline-model-parallel-layout`` string, e.g. ``"Et|t*2|t|L"``."""
    kinds = [_megatron_kind(b) for b in plan.blocks]
    _check_megatron_order(plan, kinds)
    stages = []
    for s in range(plan.num_stages):
        symbols = "".join(kinds[plan.bounds[s] : plan.bounds[s + 1]]).replace("n", "")
        symbols = re.sub("E+", "E", symbols)  # token and position embeddings are one E
        stages.append(re.sub("t{2,}", lambda m: f"t*{len(m.group())}", symbols))
    return "|".join(stages)


# -- validation -------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_blocks(blocks: tuple[str, ...]) -> None:
    if not blocks or not all(isinstance(b, str) for b in blocks):
        raise PlanError(f"blocks must be a non-empty sequence of names (str), got {blocks!r}")
    repeated = sorted({b for b in blocks if blocks.count(b) > 1})
    if repeated:
        raise PlanError(f"block names repeat ({', '.join(repeated)}): each block needs its own")


def _check_bounds(bounds: tuple[int, ...], n: int) -> None:
    shown = list(bounds)
    if not all(_is_int(b) for b in bounds) or len(bounds) < 2:
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


def _stages_text(count: int, num_stages: int) -> str:
    ranks = "1 rank runs" if num_stages == 1 else f"{num_stages} ranks run"
    return f"the plan has {count} stages but {ranks} the pipeline: each rank runs one stage"


def _check_stage_count(count: int, num_stages: int) -> None:
    if count != num_stages:
        raise PlanError(f"{_stages_text(count, num_stages)}; give {num_stages} stages")


def _suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3)
    if close:
        return f" (did you mean {', '.join(map(repr, close))}?)"
    return f"; blocks: {', '.join(choices)}"


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
    example = _uniform_bounds(n, num_stages)
    raise PlanError(
        f"{_stages_text(count, num_stages)} (reading {ints} as "
        f"{'DeepSpeed parts' if as_parts else 'inner cuts'}). Give either the "
        f"{num_stages - 1} inner cut indices, like {list(example[1:-1])}, or DeepSpeed's "
        f"parts list of {num_stages + 1} ints from 0 to {n}, like {list(example)}"
    )


def _from_names(spec: Sequence[object], blocks: tuple[str, ...]) -> Plan:
    for s, names in enumerate(spec):
        if not all(isinstance(name, str) for name in names):
            raise PlanError(f"stage {s}: expected a list of block names (str), got {names!r}")
        for name in names:
            if name not in blocks:
                raise PlanError(f"stage {s} lists unknown block {name!r}{_suggest(name, blocks)}")
    return _from_stage_lists([tuple(names) for names in spec], blocks)


def _from_regexes(spec: Mapping[object, object], blocks: tuple[str, ...], num_stages: int) -> Plan:
    owner: dict[str, tuple[str, int]] = {}  # block -> the first regex that matched it, its stage
    for pattern, stage in spec.items():
        if not isinstance(pattern, str) or not _is_int(stage):
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
        return Plan(blocks, _uniform_bounds(len(blocks), num_stages))
    if method == "parameters":
        params = [c.num_params for c in _costs_for(blocks, costs, timed=False)]
        return Plan(blocks, optimal_split(params, num_stages))
    if method == "measured":
        return Plan(blocks, _measured_bounds(_costs_for(blocks, costs, timed=True), num_stages))
    raise PlanError(
        f"unknown partition method {method!r}: the methods are {', '.join(METHODS)} "
        "(or give the plan itself: boundaries, block lists or {regex: stage})"
    )


def _uniform_bounds(n: int, num_stages: int) -> tuple[int, ...]:
    size, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (s < extra))  # as DeepSpeed: extras go first
    return tuple(bounds)


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


def _measured_bounds(costs: list[BlockCost], num_stages: int) -> tuple[int, ...]:
    time = _prefix([c.forward_s + c.backward_s for c in costs])
    memory = _prefix(
        [c.param_bytes * STATE_BYTES_PER_PARAM_BYTE + (c.activation_bytes or 0) for c in costs]
    )
    fast = _within(time, _min_max(time, num_stages, _any) * (1 + TIME_TOLERANCE))
    lean = _within(memory, _min_max(memory, num_stages, fast))
    return _most_even(time, num_stages, lambda i, j: fast(i, j) and lean(i, j))


# -- contiguous-partition DP (O(stages * blocks^2): blocks number in the hundreds at most) --

Fits = Callable[[int, int], bool]  # may blocks[i:j] form one stage?


def _prefix(values: Sequence[float]) -> list[float]:
    return list(accumulate(values, initial=0.0))


def _any(i: int, j: int) -> bool:
    return True


def _within(prefix: list[float], limit: float) -> Fits:
    slack = 1e-9 * max(1.0, abs(limit))  # float sums of the same blocks may differ in the ulp
    return lambda i, j: prefix[j] - prefix[i] <= limit + slack


def _min_max(prefix: list[float], num_stages: int, fits: Fits) -> float:
    """Smallest achievable largest stage sum over the splits whose stages all fit."""
    n = len(prefix) - 1
    best = [0.0] + [math.inf] * n  # best[j]: blocks[:j] in the stages so far
    for k in range(1, num_stages + 1):
        row = [math.inf] * (n + 1)
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                if best[i] < math.inf and fits(i, j):
                    row[j] = min(row[j], max(best[i], prefix[j] - prefix[i]))
        best = row
    return best[n]


def _most_even(prefix: list[float], num_stages: int, fits: Fits) -> tuple[int, ...]:
    """The fitting split with the smallest sum of squared stage sums (earlier stages larger
    on ties). A sum of squares adds up stage by stage, so this DP is exact."""
    n = len(prefix) - 1
    cost = [0.0] + [math.inf] * n
    choice: list[list[int]] = []
    for k in range(1, num_stages + 1):
        row, picks = [math.inf] * (n + 1), [-1] * (n + 1)
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(
                j - 1, k - 2, -1
            ):  # latest cut first, kept on a tie: earlier stages larger
                if cost[i] == math.inf or not fits(i, j):
                    continue
                value = cost[i] + (prefix[j] - prefix[i]) ** 2
                if value < row[j] and not math.isclose(value, row[j], rel_tol=1e-12):
                    row[j], picks[j] = value, i
        cost = row
        choice.append(picks)
    assert cost[n] < math.inf, "no fitting split: the limits come from a feasible split"
    bounds = [n]
    for picks in reversed(choice):
        bounds.append(picks[bounds[-1]])
    return tuple(reversed(bounds))


# -- naming -----------------------------------------------------------------------------

_NUMBERED = re.compile(r"(.*\.)(\d+)")
_LAYER = re.compile(r"(?:.*\.)?(?:blocks|layers|h)\.\d+")
_EMBED_PARTS = ("embed", "wte", "wpe", "tok_embeddings")
_HEADS = {"head", "output", "lm_head"}
_NORMS = {"norm", "ln_f", "final_norm"}


def _compact(names: Sequence[str]) -> str:
    """``embed, blocks.0-blocks.3, norm``: runs of consecutively numbered blocks shortened."""
    parts: list[str] = []
    run: list[str] = []
    for name in [*names, None]:  # None: flush the last run
        match = _NUMBERED.fullmatch(name) if name is not None else None
        last = _NUMBERED.fullmatch(run[-1]) if run else None
        if match and last and match[1] == last[1] and int(match[2]) == int(last[2]) + 1:
            run.append(name)
            continue
        parts.extend([f"{run[0]}-{run[-1]}"] if len(run) > 1 else run)
        run = [name] if name is not None else []
    return ", ".join(parts)


def _megatron_kind(block: str) -> str:
    leaf = block.rsplit(".", 1)[-1]
    if _LAYER.fullmatch(block):
        return "t"
    if leaf in _HEADS:
        return "L"
    if leaf in _NORMS:
        return "n"  # Megatron builds the final norm with the loss layer
    if any(part in leaf for part in _EMBED_PARTS):
        return "E"
    raise PlanError(
        f"Megatron's layout cannot express block {block!r}: it knows embeddings (E), numbered "
        "transformer layers (t), and the output layer with its final norm (L)"
    )


def _check_megatron_order(plan: Plan, kinds: list[str]) -> None:
    order = "".join(kinds)
    # Megatron validates the flattened layout: one E first, one L last, decoders between
    if not re.fullmatch(r"E+t*n*L", order):
        raise PlanError(
            f"Megatron's layout needs the blocks in the order embedding, transformer layers, "
            f"final norm, output layer; this model's blocks read {order} "
            f"(E embedding, t layer, n norm, L output): {', '.join(plan.blocks)}"
        )
    stages = plan.stage_map()
    head = plan.blocks[-1]
    embeds = [b for b, k in zip(plan.blocks, kinds, strict=True) if k == "E"]
    for norm in (b for b, k in zip(plan.blocks, kinds, strict=True) if k == "n"):
        if stages[norm] != stages[head]:
            raise PlanError(
                f"final norm {norm!r} is on stage {stages[norm]} but the output layer {head!r} "
                f"on stage {stages[head]}: Megatron's L holds both, so put them on one stage"
            )
    if stages[embeds[-1]] != 0:
        raise PlanError(
            f"embeddings {', '.join(embeds)} span stages 0..{stages[embeds[-1]]}: Megatron's E "
            "is one layer, so put them all on stage 0"
        )

"""Partition plans: every accepted form, every refused plan's message, the methods' optimal
bounds, and the exports (pure: no torch, no cluster)."""

from __future__ import annotations

import itertools
import random

import pytest

from dtlab.analysis.partition import optimal_split, parse_plan
from dtlab.analysis.partition_export import to_deepspeed, to_megatron, to_torchtitan
from dtlab.records import Plan, PlanError
from dtlab.records.stages import BlockCost

BLOCKS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head")
NAMES = [["embed", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3"], ["norm", "head"]]
REGEXES = {r"embed|blocks\.0": 0, r"blocks\.[12]": 1, r"blocks\.3": 2, "norm|head": 3}
PLAN = Plan(BLOCKS, (0, 2, 4, 5, 7))


def timed(name: str, seconds: float, params: int = 0, acts: int | None = None) -> BlockCost:
    return BlockCost(name, params, params, seconds / 3, seconds * 2 / 3, acts)


# -- forms ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [[2, 4, 5], (0, 2, 4, 5, 7), NAMES, [tuple(s) for s in NAMES], REGEXES, PLAN],
    ids=["cuts", "parts", "names", "name-tuples", "regexes", "plan"],
)
def test_every_form_gives_the_same_plan(spec):
    assert parse_plan(spec, BLOCKS, 4) == PLAN


def test_names_within_a_stage_may_come_in_any_order():
    names = [["blocks.0", "embed"], *NAMES[1:]]
    assert parse_plan(names, BLOCKS, 4) == PLAN


def test_one_stage_takes_no_cuts():
    assert parse_plan([], BLOCKS, 1).bounds == (0, 7)


def test_plan_accessors():
    assert PLAN.num_stages == 4
    assert PLAN.stage_blocks(1) == ("blocks.1", "blocks.2")
    assert PLAN.stage_of("norm") == 3
    assert PLAN.stage_map()["blocks.3"] == 2
    assert PLAN.describe() == (
        "stage 0: embed, blocks.0 | stage 1: blocks.1-blocks.2 | stage 2: blocks.3 "
        "| stage 3: norm, head"
    )
    with pytest.raises(PlanError, match=r"'blocks\.1'"):
        PLAN.stage_of("block.1")
    with pytest.raises(PlanError, match=r"0\.\.3"):
        PLAN.stage_blocks(4)


def test_moves_to_lists_the_blocks_that_change_stage():
    other = Plan(BLOCKS, (0, 1, 4, 6, 7))
    assert PLAN.moves_to(other) == {"blocks.0": (0, 1), "norm": (3, 2)}
    assert PLAN.moves_to(PLAN) == {}
    with pytest.raises(PlanError, match="different blocks"):
        PLAN.moves_to(Plan(("a", "b"), (0, 1, 2)))


def test_plan_stores_tuples():
    plan = Plan(list(BLOCKS), [0, 2, 4, 5, 7])
    assert plan == PLAN and hash(plan) == hash(PLAN)


# -- refused plans: each message names the problem ---------------------------------------

BAD = {
    "empty-stage": ([0, 2, 2, 6, 7], "stage 1 is empty"),
    "decreasing": ([0, 4, 2, 6, 7], "boundaries decrease at stage 1"),
    "repeated-cut": ([2, 2, 6], "stage 1 is empty: boundary 2 repeats"),
    "parts-out-of-range": ([0, 2, 4, 6, 9], r"boundary 9 out of range .*0\.\.7"),
    "cut-out-of-range": ([2, 4, 9], r"cut index 9 .*1\.\.6"),
    "parts-not-from-0": ([1, 2, 4, 6, 7], "must start at 0"),
    "parts-not-to-the-end": ([0, 2, 4, 5, 6], "end at 7"),
    "wrong-int-count": (
        [1, 2, 3, 4, 5],
        r"6 stages but 4 ranks .*3 inner cut indices.*parts list of 5 ints",
    ),
    "regex-matches-nothing": (
        {**REGEXES, "lm_head": 3},
        r"regex 'lm_head' matches no block.*blocks: embed, blocks\.0",
    ),
    "regex-overlap": (
        {**REGEXES, r"blocks\.[23]": 2},
        r"'blocks\.2' is matched by 'blocks\\\\\.\[12\]' \(stage 1\) and by "
        r"'blocks\\\\\.\[23\]' \(stage 2\)",
    ),
    "regex-misses-a-block": (
        {r"embed|blocks\.0": 0, r"blocks\.[12]": 1, r"blocks\.3": 2, "norm": 3},
        "head matched by no regex",
    ),
    "regex-stage-out-of-range": ({**REGEXES, "norm|head": 4}, r"stage 4.*0\.\.3"),
    "regex-stage-left-empty": (
        {r"embed|blocks\.[01]": 0, r"blocks\.[23]": 1, "norm|head": 3},
        r"stage 2 is empty \(no regex",
    ),
    "regex-not-contiguous": (
        {r"embed|blocks\.2": 0, r"blocks\.[01]": 1, r"blocks\.3": 2, "norm|head": 3},
        "stage 0 is not contiguous",
    ),
    "bad-regex": ({"blocks.(": 0}, "does not compile"),
    "unknown-name": (
        [["embed", "block.0"], *NAMES[1:]],
        r"unknown block 'block\.0' \(did you mean 'blocks\.0'",
    ),
    "listed-twice": (
        [["embed", "blocks.0", "blocks.1"], *NAMES[1:]],
        r"'blocks\.1' is listed on stages 0 and 1",
    ),
    "listed-twice-on-a-stage": (
        [["embed", "blocks.0", "embed"], *NAMES[1:]],
        "'embed' is listed twice on stage 0",
    ),
    "missing-block": ([NAMES[0], NAMES[1], ["blocks.3"], ["head"]], "norm on no stage"),
    "empty-list": ([NAMES[0], NAMES[1] + ["blocks.3"], [], ["norm", "head"]], "stage 2 is empty"),
    "not-contiguous": (
        [["embed", "blocks.1"], ["blocks.0", "blocks.2"], ["blocks.3"], ["norm", "head"]],
        r"stage 0 is not contiguous: .*not 'blocks\.0' between them \(on stage 1\)",
    ),
    "stages-out-of-order": ([NAMES[1], NAMES[0], *NAMES[2:]], "stages out of order"),
    "too-many-stages": (
        [*NAMES[:3], ["norm"], ["head"]],
        "the plan has 5 stages but 4 ranks run the pipeline: each rank runs one stage",
    ),
    "too-few-stages": (
        [NAMES[0], NAMES[1] + ["blocks.3"], ["norm", "head"]],
        "the plan has 3 stages but 4 ranks run",
    ),
    "plan-of-other-blocks": (Plan(("a", "b", "c", "d"), (0, 1, 2, 3, 4)), "covers blocks a, b"),
    "unknown-method": ("balanced", "unknown partition method 'balanced'.*uniform, parameters"),
    "float": (3.5, "cannot read a plan from 3.5"),
    "flat-names": (["embed", "blocks.0"], "cannot read a plan"),
    "mixed-list": ([2, "4"], "cannot read a plan"),
    "regex-to-str": ({"embed": "0"}, r"regex \(str\) -> stage \(int\)"),
    "bool-cut": ([True, 4, 6], "cannot read a plan"),
}


@pytest.mark.parametrize("spec, message", BAD.values(), ids=BAD.keys())
def test_bad_plans_name_their_problem(spec, message):
    with pytest.raises(PlanError, match=message):
        parse_plan(spec, BLOCKS, 4)


def test_more_stages_than_blocks():
    with pytest.raises(PlanError, match="3 stages but only 2 blocks"):
        parse_plan("uniform", ["a", "b"], 3)


@pytest.mark.parametrize(
    "blocks, bounds, message",
    [
        (("a", "a"), (0, 1, 2), "block names repeat"),
        (("a", "b"), (1, 2), "must start at 0 and end at 2"),
        (("a", "b"), (0, 1), "must start at 0 and end at 2"),
        (("a", "b"), (0,), "one more than stages"),
        (("a", "b"), (0, 1.5, 2), "must be ints"),
        ("ab", (0, 1, 2), "sequence of block names"),
    ],
)
def test_plan_validates_itself(blocks, bounds, message):
    with pytest.raises(PlanError, match=message):
        Plan(blocks, bounds)


# -- methods ----------------------------------------------------------------------------


def test_uniform_gives_the_extra_blocks_to_the_first_stages_like_deepspeed():
    assert parse_plan("uniform", BLOCKS, 4).bounds == (0, 2, 4, 6, 7)
    assert parse_plan("uniform", BLOCKS, 3).bounds == (0, 3, 5, 7)


def test_parameters_minimises_the_largest_stage():
    params = dict(zip(BLOCKS, [10, 1, 1, 1, 1, 0, 10], strict=True))
    costs = {b: BlockCost(b, n, 2 * n) for b, n in params.items()}
    assert parse_plan("parameters", BLOCKS, 3, costs=costs).bounds == (0, 1, 6, 7)
    with pytest.raises(PlanError, match="none for head"):
        parse_plan("parameters", BLOCKS, 3, costs={b: costs[b] for b in BLOCKS[:-1]})


def test_optimal_split_known_answers():
    assert optimal_split([7, 2, 5, 10, 8], 2) == (0, 3, 5)  # stages 14 | 18
    assert optimal_split([1] * 7, 4) == (0, 2, 4, 6, 7)
    assert optimal_split([5], 1) == (0, 1)
    # 6|4|9 and 7|3|9 both have 9 as largest: the more even one wins
    assert optimal_split([6, 1, 1, 1, 1, 9], 3) == (0, 1, 5, 6)


def test_optimal_split_matches_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        weights = [rng.randint(0, 20) for _ in range(rng.randint(2, 8))]
        stages = rng.randint(1, len(weights))
        best = min(
            _largest(weights, (0, *cuts, len(weights)))
            for cuts in itertools.combinations(range(1, len(weights)), stages - 1)
        )
        bounds = optimal_split(weights, stages)
        assert len(bounds) == stages + 1 and _largest(weights, bounds) == best


def _largest(weights, bounds):
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))


def test_optimal_split_refuses_bad_input():
    with pytest.raises(PlanError, match="finite"):
        optimal_split([1, -1], 1)
    with pytest.raises(PlanError, match=r"1\.\.2"):
        optimal_split([1, 1], 3)


def test_measured_trades_up_to_2_percent_of_time_for_memory():
    blocks = ("a", "b", "c")
    # (0, 2, 3) is fastest (1.01 s) but holds a and b (800 B); (0, 1, 3) is 0.5% slower
    # and holds at most 400 B on a stage
    costs = {"a": timed("a", 1.0, 100), "b": timed("b", 0.01, 100), "c": timed("c", 1.005)}
    assert parse_plan("measured", blocks, 2, costs=costs).bounds == (0, 1, 3)
    # 4.5% slower is too much: time wins
    costs |= {"b": timed("b", 0.1, 100), "c": timed("c", 1.05)}
    assert parse_plan("measured", blocks, 2, costs=costs).bounds == (0, 2, 3)


def test_measured_counts_activations_as_memory():
    blocks = ("a", "b", "c")
    costs = {"a": timed("a", 1.0), "b": timed("b", 0.0, acts=50), "c": timed("c", 1.0, acts=60)}
    # both splits take 1 s a stage; b beside c would hold 110 B
    assert parse_plan("measured", blocks, 2, costs=costs).bounds == (0, 2, 3)


def test_measured_needs_every_block_timed():
    costs = {b: timed(b, 1.0) for b in BLOCKS} | {"norm": BlockCost("norm", 1, 4)}
    with pytest.raises(PlanError, match=r"no measurement for norm.*profile_blocks"):
        parse_plan("measured", BLOCKS, 4, costs=costs)
    with pytest.raises(PlanError, match="no measurement for embed, blocks.0"):
        parse_plan("measured", BLOCKS, 4)


# -- exports ----------------------------------------------------------------------------

PLANS = [PLAN, Plan(BLOCKS, (0, 1, 5, 7)), Plan(BLOCKS, (0, 7)), Plan(BLOCKS, tuple(range(8)))]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: str(p.bounds))
def test_exports_round_trip(plan):
    assert parse_plan(to_deepspeed(plan), BLOCKS, plan.num_stages) == plan
    assert parse_plan(to_torchtitan(plan), BLOCKS, plan.num_stages) == plan


def test_torchtitan_and_deepspeed_forms():
    assert to_deepspeed(PLAN) == [0, 2, 4, 5, 7]
    assert to_torchtitan(PLAN) == NAMES


@pytest.mark.parametrize(
    "bounds, layout",
    [
        ((0, 2, 4, 5, 7), "Et|t*2|t|L"),
        ((0, 1, 5, 7), "E|t*4|L"),
        ((0, 3, 7), "Et*2|t*2L"),
        ((0, 7), "Et*4L"),
    ],
)
def test_megatron_layout(bounds, layout):
    assert to_megatron(Plan(BLOCKS, bounds)) == layout


def test_megatron_names_of_other_models():
    blocks = ("transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1")
    plan = Plan((*blocks, "transformer.ln_f", "lm_head"), (0, 3, 6))
    assert to_megatron(plan) == "Et|tL"


def test_megatron_keeps_the_final_norm_with_the_output_layer():
    with pytest.raises(PlanError, match="final norm 'norm' is on stage 2 .* 'head' on stage 3"):
        to_megatron(Plan(BLOCKS, (0, 2, 4, 6, 7)))


def test_megatron_refuses_what_it_cannot_express():
    with pytest.raises(PlanError, match="cannot express block 'adapter'"):
        to_megatron(Plan((*BLOCKS[:3], "adapter", *BLOCKS[3:]), (0, 4, 8)))
    with pytest.raises(PlanError, match="order embedding, transformer layers"):
        to_megatron(Plan(BLOCKS[1:], (0, 3, 6)))
    with pytest.raises(PlanError, match="Megatron's E is one layer"):
        to_megatron(Plan(("wte", "wpe", "h.0", "head"), (0, 1, 4)))

"""Hang verdicts from fabricated rank reports (pure): a rank that never entered a
collective, mismatched shapes, a dead rank, and ranks outside any collective."""

from dtlab.analysis.hangs import diagnose, where
from dtlab.records import CollectiveCall, RankReport

IDLE = (
    ("/x/site-packages/ipykernel/kernelbase.py", 10, "dispatch_queue", ""),
    ("/usr/lib/python3.11/asyncio/base_events.py", 5, "run_forever", ""),
)
IN_ALL_REDUCE = (
    ("/tmp/ipykernel_1/123.py", 2, "<module>", "dist.all_reduce(t)"),
    ("/x/site-packages/torch/distributed/distributed_c10d.py", 9, "all_reduce", "work.wait()"),
)


def call(seq, done, sizes=((3,),), op="all_reduce", group="default_pg"):
    return CollectiveCall(group, seq, op, sizes, done)


def report(rank, stack, *calls, step=None):
    return RankReport(rank, stack, tuple(calls), step)


def test_a_rank_that_never_entered_the_collective_is_named_with_where_it_is():
    reports = {r: report(r, IN_ALL_REDUCE, call(4, True), call(5, False)) for r in range(3)}
    reports[3] = report(3, IDLE, call(4, True))
    verdict = diagnose(reports)
    assert (verdict.waiting, verdict.missing, verdict.collective.seq) == ((0, 1, 2), (3,), 5)
    assert verdict.summary.startswith("ranks 0-2 are in all_reduce #5 on default_pg")
    assert "rank 3 never entered it: rank 3 idle" in verdict.summary
    assert where(reports[0]).startswith("in `<module>` (123.py:2: dist.all_reduce(t))")


def test_mismatched_shapes_at_one_sequence_number_are_named():
    reports = {r: report(r, IN_ALL_REDUCE, call(1, True)) for r in (0, 2, 3)}
    reports[1] = report(1, IN_ALL_REDUCE, call(1, False, sizes=((5,),)))
    verdict = diagnose(reports)
    assert verdict.mismatch and verdict.missing == (1,) and verdict.waiting == (1,)
    assert "rank 1 passed all_reduce [5]; ranks 0,2-3 passed all_reduce [3]" in verdict.summary


def test_a_dead_rank_is_what_the_others_wait_for():
    reports = {r: report(r, IN_ALL_REDUCE, call(7, False)) for r in (0, 1, 3)}
    verdict = diagnose(reports, {2: "killed by signal 9 (SIGKILL)"})
    assert verdict.missing == (2,) and verdict.waiting == (0, 1, 3)
    assert "rank 2 dead (killed by signal 9 (SIGKILL))" in verdict.summary


def test_outside_any_collective_each_rank_is_placed_and_silence_is_said():
    loop = (("/work/train.py", 40, "train_step", "while True: pass"),)
    verdict = diagnose({0: report(0, loop, call(3, True)), 1: report(1, IDLE), 2: None})
    assert verdict.collective is None and not verdict.mismatch
    assert "rank 0 in `train_step` (train.py:40: while True: pass)" in verdict.summary
    assert "rank 1 idle" in verdict.summary and "rank 2 did not answer" in verdict.summary


def test_dtlab_control_group_is_the_fallback_and_every_rank_entering_is_said():
    control = (call(2, False, group="dtlab_control"),)
    verdict = diagnose({r: report(r, IDLE, *control) for r in range(2)})
    assert verdict.collective.group == "dtlab_control"
    assert "dtlab's step agreement" in verdict.summary
    assert "every rank entered it and none completed it" in verdict.summary


def test_ranks_outside_a_subgroup_are_not_said_to_be_missing_from_it():
    def sub(seq, done):
        return CollectiveCall("tp", seq, "all_reduce", ((3,),), done, group_id="7", members=(0, 1))

    reports = {
        0: report(0, IN_ALL_REDUCE, sub(2, False)),
        1: report(1, IDLE, sub(1, True)),
        2: report(2, IDLE),
        3: report(3, IDLE),
    }
    verdict = diagnose(reports)
    assert verdict.waiting == (0,) and verdict.missing == (1,), verdict.summary


def test_a_dtype_mismatch_is_named_and_an_old_group_with_the_same_name_is_apart():
    def f32(seq, done, dtype="Float", group_id="0"):
        return CollectiveCall(
            "default_pg", seq, "all_reduce", ((3,),), done, group_id, (), (dtype,)
        )

    reports = {
        0: report(0, IN_ALL_REDUCE, f32(3, False)),
        1: report(1, IN_ALL_REDUCE, f32(3, True, "Double")),
    }
    verdict = diagnose(reports)
    assert verdict.mismatch and "(Double)" in verdict.summary and "(Float)" in verdict.summary
    # an abandoned control group's pending agreement (another group id) is not this one's
    old = CollectiveCall("dtlab_control", 9, "all_reduce", ((7,),), False, group_id="1")
    new = CollectiveCall("dtlab_control", 9, "all_reduce", ((7,),), True, group_id="2")
    verdict = diagnose({0: report(0, IDLE, old), 1: report(1, IDLE, new)})
    assert verdict.missing == (1,) and verdict.collective.group_id == "1"

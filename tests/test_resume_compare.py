"""Comparing a resumed (or replayed) run with the run that never stopped, on records built
by hand in one process."""

import math
from dataclasses import replace

from dtlab.analysis.resume import compare_runs, first_module_difference, format_samples
from dtlab.records import StepMemory, StepRecord, StepTimes

BATCH = 8  # samples per rank per step
MODULES = ("embed", "block", "head")


def rec(step: int, rank: int = 0, **changes) -> StepRecord:
    """A deterministic step of a 4-rank job: rank r reads its own 8 consecutive samples."""
    start = ((step - 1) * 4 + rank) * BATCH
    base = StepRecord(
        step=step,
        time=0.0,
        loss=1.0 / step,
        lr=0.1,
        scale=None,
        skipped=False,
        times=StepTimes(0, 0, 0, 0, 0),
        memory=StepMemory(0, 0, 0, 0),
        indices=tuple(range(start, start + BATCH)),
        rng=(("python", 100 + step), ("numpy", 200 + step), ("torch", 300 + step)),
        grad_fingerprint=1000 + step,
        param_fingerprint=2000 + step,
        buffer_fingerprint=3000 + step,
        module_outputs=tuple((name, step * 10 + i) for i, name in enumerate(MODULES)),
    )
    return replace(base, **changes)


def run(steps=range(11, 21), num_ranks=4, change=None):
    """``{rank: [StepRecord]}``; ``change(rank, record)`` may return an altered record."""
    out = {}
    for rank in range(num_ranks):
        recs = [rec(s, rank) for s in steps]
        out[rank] = [change(rank, r) if change else r for r in recs]
    return out


def at(rank, step, **changes):
    """A change that alters one rank at one step."""

    def change(r, record):
        return replace(record, **changes) if (r, record.step) == (rank, step) else record

    return change


def with_rng(record, **fingerprints):
    return dict(record.rng) | fingerprints


def test_identical_runs():
    result = compare_runs(run(), run())
    assert result.identical
    assert result.first is None and result.at_first_step == ()
    assert result.steps == tuple(range(11, 21))
    assert result.summary() == "identical over steps 11-20 (10 steps, 4 ranks)"


def test_torch_rng_not_restored_on_one_rank():
    def change(rank, record):
        if rank == 2 and record.step >= 13:
            return replace(record, rng=tuple(with_rng(record, torch=7).items()))
        return record

    result = compare_runs(run(), run(change=change))
    assert not result.identical
    first = result.first
    assert (first.step, first.field, first.ranks) == (13, "rng:torch", (2,))
    assert (first.expected, first.found) == (313, 7)
    assert "torch CPU RNG" in first.explanation and "rank 2" in first.explanation
    assert "the run that never stopped" in first.explanation
    assert result.summary().startswith("first difference at step 13: torch CPU RNG of rank 2")


def test_rng_of_several_ranks_is_listed_as_a_range():
    def change(rank, record):
        return replace(record, rng=tuple(with_rng(record, python=-1).items()))

    first = compare_runs(run(), run(change=change)).first
    assert (first.field, first.ranks) == ("rng:python", (0, 1, 2, 3))
    assert "Python random RNG of ranks 0-3" in first.explanation


def test_generator_recorded_on_one_side_only_differs():
    def change(rank, record):
        return replace(record, rng=(*record.rng, ("cuda", 5)))

    first = compare_runs(run(), run(change=change)).first
    assert (first.field, first.expected, first.found) == ("rng:cuda", None, 5)
    assert "CUDA RNG" in first.explanation


def test_loader_restarted_at_the_epoch_start_re_reads_samples():
    reference = run(steps=range(1, 21))

    def restart(rank, record):  # the resumed loader starts again from the first batch
        return replace(record, indices=rec(record.step - 10, rank).indices)

    result = compare_runs(reference, run(change=restart))
    first = result.first
    assert (first.step, first.field, first.ranks) == (11, "indices", (0, 1, 2, 3))
    assert first.found == tuple(range(0, 8))
    assert "data position lost: rank 0 re-read samples 0-7 at step 11" in first.explanation
    assert "the run that never stopped read 320-327" in first.explanation
    assert "ranks 0-3 differ" in first.explanation


def test_indices_never_read_before_are_not_called_re_read():
    result = compare_runs(run(), run(change=at(1, 11, indices=(900, 901))))
    text = result.first.explanation
    assert "rank 1 read samples 900-901 at step 11" in text and "re-read" not in text


def test_samples_skipped_ahead_are_not_called_re_read():
    ahead = rec(13, 0).indices  # the reference reads them later, not before
    text = compare_runs(run(), run(change=at(0, 11, indices=ahead))).first.explanation
    assert "rank 0 read samples 384-391 at step 11" in text and "re-read" not in text


def test_same_samples_in_another_order():
    shuffled = tuple(reversed(rec(12, 0).indices))
    first = compare_runs(run(), run(change=at(0, 12, indices=shuffled))).first
    assert first.field == "indices" and "different order" in first.explanation


def test_format_samples():
    assert format_samples((8, 9, 10, 11)) == "8-11"
    assert format_samples((5,)) == "5"
    assert format_samples((12, 40, 77, 3, 5, 9, 1, 2)) == "12, 40, 77, ... (8 samples)"
    assert format_samples((3, 1)) == "3, 1"  # consecutive only when in ascending order


def test_lr_not_restored():
    first = compare_runs(run(), run(change=at(0, 11, lr=0.2))).first
    assert (first.field, first.ranks, first.expected, first.found) == ("lr", (0,), 0.1, 0.2)
    assert "learning-rate schedule not restored" in first.explanation
    assert "step 11 ran at lr 0.2 on rank 0" in first.explanation
    assert "at 0.1" in first.explanation


def test_scale_not_restored():
    reference = run(change=lambda r, record: replace(record, scale=65536.0))
    other = run(change=lambda r, record: replace(record, scale=1024.0 if r == 3 else 65536.0))
    first = compare_runs(reference, other).first
    assert (first.field, first.ranks) == ("scale", (3,))
    assert "GradScaler state not restored: step 11 used loss scale 1024.0" in first.explanation


def test_loss_differs_with_everything_else_equal():
    first = compare_runs(run(), run(change=at(1, 15, loss=0.5))).first
    assert (first.step, first.field, first.ranks) == (15, "loss", (1,))
    assert first.explanation.startswith("with the same data, RNGs and LR, the loss of step 15")
    assert "(0.5 vs " in first.explanation and "on rank 1" in first.explanation
    assert "model or optimizer state was not restored" in first.explanation


def test_nan_loss_equals_nan_loss():
    nan = run(change=lambda r, record: replace(record, loss=math.nan))
    assert compare_runs(nan, run(change=lambda r, record: replace(record, loss=math.nan))).identical


def test_only_parameters_differ_points_at_the_optimizer():
    first = compare_runs(run(), run(change=at(0, 16, param_fingerprint=1))).first
    assert first.field == "param_fingerprint"
    assert "parameters after step 16 differ" in first.explanation
    assert "optimizer state" in first.explanation


def test_differences_at_one_step_come_in_cause_order():
    def change(rank, record):
        if (rank, record.step) != (0, 12):
            return record
        rng = tuple(with_rng(record, numpy=-1).items())
        return replace(record, rng=rng, lr=0.2, loss=9.0, param_fingerprint=1)

    result = compare_runs(run(), run(change=change))
    fields = [d.field for d in result.at_first_step]
    assert fields == ["rng:numpy", "lr", "loss", "param_fingerprint"]
    assert result.first.field == "rng:numpy"
    loss = result.at_first_step[2]
    assert "which follows from the numpy RNG difference" in loss.explanation


def test_loss_is_not_blamed_on_the_lr_of_the_same_step():
    # the LR of step S acts only on its update, after the loss was computed
    result = compare_runs(run(), run(change=at(0, 12, lr=0.2, loss=9.0)))
    loss = result.at_first_step[1]
    assert loss.field == "loss"
    assert loss.explanation.startswith("with the same data and RNGs, the loss of step 12")


def test_steps_filter():
    other = run(change=at(0, 15, loss=0.5))
    before = compare_runs(run(), other, steps=range(11, 15))
    assert before.identical and before.steps == (11, 12, 13, 14)
    after = compare_runs(run(), other, steps=[15, 16, 99])
    assert after.steps == (15, 16) and after.first.step == 15


def test_only_steps_on_every_rank_of_both_runs_are_compared():
    other = run(steps=range(13, 25))
    other[1] = [r for r in other[1] if r.step != 14]
    assert compare_runs(run(), other).steps == (13, 15, 16, 17, 18, 19, 20)


def test_missing_rank():
    result = compare_runs(run(), run(num_ranks=3), other_name="the replay")
    first = result.first
    assert not result.identical
    assert (first.step, first.field, first.ranks) == (11, "missing", (3,))
    assert (first.expected, first.found) == (10, 0)
    assert "rank 3 is only in the run that never stopped, not in the replay" in first.explanation


def test_no_common_step():
    result = compare_runs(run(steps=range(1, 5)), run(steps=range(5, 9)))
    assert result.steps == () and result.first is None and not result.identical
    assert "nothing to compare" in result.summary()


def test_unrecorded_fields_are_skipped():
    def unrecorded(rank, record):
        return replace(
            record, rng=(), indices=(), grad_fingerprint=0, buffer_fingerprint=0, module_outputs=()
        )

    def other(rank, record):  # differs only where the reference did not record
        return replace(
            record,
            rng=(("torch", 1),),
            indices=(1, 2),
            grad_fingerprint=5,
            buffer_fingerprint=6,
            module_outputs=(("x", 1),),
        )

    assert compare_runs(run(change=unrecorded), run(change=other)).identical


def test_a_later_record_of_the_same_step_replaces_the_earlier():
    other = run()
    other[0] = [rec(11, 0, loss=9.0), *other[0]]  # step 11 before the stop, then after resume
    assert compare_runs(run(), other).identical


def test_module_output_difference_in_compare_runs():
    outputs = (("embed", 120), ("block", 99), ("head", 122))
    result = compare_runs(run(), run(change=at(2, 12, module_outputs=outputs, loss=9.0)))
    first = result.first
    assert (first.step, first.field, first.ranks) == (12, "module_outputs", (2,))
    assert (first.expected, first.found) == (("block", 121), ("block", 99))
    assert "output of module 'block'" in first.explanation
    assert "which follows from the module output difference" in result.at_first_step[1].explanation


def outputs(*fingerprints, names=MODULES):
    return tuple(zip(names, fingerprints, strict=True))


def test_first_module_difference_earliest_position_wins_over_lower_rank():
    reference = {0: outputs(1, 2, 3), 1: outputs(1, 2, 3), 2: outputs(1, 2, 3)}
    other = {0: outputs(1, 2, 9), 1: outputs(1, 8, 9), 2: outputs(1, 7, 3)}
    diff = first_module_difference(reference, other)
    assert (diff.rank, diff.module, diff.index, diff.ranks) == (1, "block", 1, (1, 2))
    assert "rank 1" in diff.explanation and "'block'" in diff.explanation


def test_first_module_difference_different_path():
    reference = {0: outputs(1, 2, 3)}
    other = {0: outputs(1, 2, 3, names=("embed", "dropout", "head"))}
    diff = first_module_difference(reference, other, other_name="the replay")
    assert (diff.rank, diff.module, diff.index) == (0, "block", 1)
    assert "different path" in diff.explanation and "the replay ran 'dropout'" in diff.explanation
    shorter = first_module_difference(reference, {0: outputs(1, 2, names=MODULES[:2])})
    assert (shorter.module, shorter.index) == ("head", 2)
    assert "the resumed run had ended its forward" in shorter.explanation


def test_first_module_difference_none_when_equal_or_nothing_to_compare():
    same = {0: outputs(1, 2, 3), 1: outputs(4, 5, 6)}
    assert first_module_difference(same, dict(same)) is None
    assert first_module_difference({0: ()}, {0: outputs(1, 2, 3)}) is None
    assert first_module_difference({}, {}) is None

"""Divergence of data-parallel ranks, on per-rank records built in one process."""

import math
from dataclasses import replace

import numpy as np
import pytest

from dtlab.analysis.divergence import (
    MIN_DEVIATION,
    PARAM_FIX,
    deviation_matrix,
    divergence_findings,
    find_divergence,
    first_divergent_step,
    tensor_diff,
)
from tests.fakes import PARAMS, healthy_trace, step_record, with_totals

NAMES = tuple(p.name for p in PARAMS)  # embed.weight, blocks.0.weight, blocks.0.bias, head.weight


def records(num_ranks=4, num_steps=8, change=None):
    """``{rank: [StepRecord]}`` of a healthy job; ``change(rank, rec)`` may alter a record."""
    out = {}
    for rank in range(num_ranks):
        recs = [step_record(s, rank) for s in range(1, num_steps + 1)]
        out[rank] = [change(rank, rec) if change else rec for rec in recs]
    return out


def perturb(values, indices, delta=7):
    return tuple(v + delta if i in indices else v for i, v in enumerate(values))


def params_differ(ranks, from_step, indices):
    def change(rank, rec):
        if rank in ranks and rec.step >= from_step:
            return replace(rec, param_fingerprints=perturb(rec.param_fingerprints, indices))
        return rec

    return change


def test_healthy_trace_has_no_divergence():
    trace = healthy_trace()
    assert find_divergence(trace.records, trace.param_names, kind="grad") is None
    assert find_divergence(trace.records, trace.param_names, kind="param") is None
    assert divergence_findings(trace.records, trace.param_names) == []


def test_param_perturbed_on_rank_2_names_rank_step_and_first_param_in_module_order():
    # head.weight (3) and blocks.0.weight (1) both differ: module order picks index 1.
    recs = records(change=params_differ({2}, 4, {3, 1}))
    found = find_divergence(recs, NAMES, kind="param")
    assert (found.kind, found.step, found.param_index) == ("param", 4, 1)
    assert found.param == "blocks.0.weight"
    assert found.groups == ((0, 1, 3), (2,))
    assert found.majority == (0, 1, 3) and found.outliers == (2,)
    assert (found.num_params_differing, found.num_params) == (2, 4)
    assert found.rel_norm_diff == 0.0  # the gradients agree
    assert found.summary == (
        "parameters diverge from step 4: blocks.0.weight differs on rank 2 from the copy "
        "ranks 0-1,3 hold; 2 of 4 parameters differ"
    )
    assert find_divergence(recs, NAMES, kind="grad") is None


def test_params_differing_while_grads_agree_blame_the_parameters():
    [finding] = divergence_findings(records(change=params_differ({2}, 4, {0})), NAMES)
    assert (finding.kind, finding.ranks, finding.step) == ("divergence", (2,), 4)
    assert finding.evidence["fingerprints"] == "param"
    assert finding.evidence["param"] == "embed.weight"
    assert finding.fix == PARAM_FIX


def grads_differ_on_rank_0_from_step_3(rank, rec):
    if rank == 0 and rec.step >= 3:
        norms = tuple(n * 1.5 if i == 2 else n for i, n in enumerate(rec.grad_norms))
        return replace(
            rec,
            grad_fingerprints=perturb(rec.grad_fingerprints, {2}),
            param_fingerprints=perturb(rec.param_fingerprints, {2}),
            grad_norms=norms,
        )
    return rec


def test_grads_differing_are_found_with_their_norms():
    recs = records(change=grads_differ_on_rank_0_from_step_3)
    found = find_divergence(recs, NAMES, kind="grad")
    assert (found.step, found.param, found.outliers, found.majority) == (
        3,
        "blocks.0.bias",
        (0,),
        (1, 2, 3),
    )
    assert found.norm_by_rank == pytest.approx({0: 1.5 / 5, 1: 1 / 5, 2: 1 / 5, 3: 1 / 5})
    assert found.rel_norm_diff == pytest.approx(0.5)
    assert "gradients diverge from step 3" in found.summary
    assert "its gradient norm there differs by 0.5x from ranks 1-3's" in found.summary


def test_grad_divergence_is_the_cause_of_the_param_divergence_it_brings():
    grad, param = divergence_findings(records(change=grads_differ_on_rank_0_from_step_3), NAMES)
    assert (grad.evidence["fingerprints"], grad.ranks, grad.step) == ("grad", (0,), 3)
    assert "all_reduce" in grad.fix
    assert (param.evidence["fingerprints"], param.ranks, param.step) == ("param", (0,), 3)
    assert param.fix == "follows from the gradient divergence at step 3: fix that first"


def test_two_against_two_lists_both_groups_and_takes_neither_as_right():
    found = find_divergence(records(change=params_differ({2, 3}, 5, {1})), NAMES, kind="param")
    assert found.groups == ((0, 1), (2, 3))
    assert found.majority == (0, 1) and found.outliers == (2, 3)  # the reference to compute
    assert found.is_tie and not found.has_majority
    assert found.named_ranks == (0, 1, 2, 3)  # a finding names every rank
    assert "splits ranks 0-1 | ranks 2-3, with no majority to tell which is right" in (
        found.summary
    )
    assert "reference" not in found.summary and "majority's" not in found.summary


def test_largest_group_wins_over_lowest_rank():
    def change(rank, rec):  # rank 0 alone, ranks 1-2 agree, rank 3 alone
        delta = {0: 1, 3: 2}.get(rank, 0)
        fps = perturb(rec.param_fingerprints, {0}, delta) if rec.step >= 2 else None
        return replace(rec, param_fingerprints=fps) if fps else rec

    found = find_divergence(records(change=change), NAMES, kind="param")
    assert found.groups == ((1, 2), (0,), (3,))
    assert found.majority == (1, 2) and found.outliers == (0, 3)
    assert not found.is_tie
    # the largest group is two of four: no majority, so every group is listed
    assert not found.has_majority and found.named_ranks == (0, 1, 2, 3)
    assert "splits ranks 1-2 | rank 0 | rank 3, with no majority" in found.summary


def test_steps_a_rank_did_not_record_are_skipped():
    recs = records(change=params_differ({2}, 4, {1}))
    recs[3] = [rec for rec in recs[3] if rec.step != 4]
    assert find_divergence(recs, NAMES, kind="param").step == 5
    recs[3] = recs[3][:3]  # rank 3 stopped after step 3: nothing in common from step 4
    assert find_divergence(recs, NAMES, kind="param") is None


def test_recording_off_means_no_divergence():
    def off(rank, rec):
        return replace(rec, grad_fingerprints=(), param_fingerprints=(), grad_norms=())

    assert find_divergence(records(change=off), NAMES, kind="grad") is None
    assert find_divergence(records(change=off), NAMES, kind="param") is None


def test_steps_with_recording_off_on_one_rank_are_skipped():
    def change(rank, rec):
        rec = params_differ({1}, 3, {2})(rank, rec)
        return replace(rec, param_fingerprints=()) if (rank, rec.step) == (0, 3) else rec

    assert find_divergence(records(change=change), NAMES, kind="param").step == 4


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'grad', 'param'"):
        find_divergence(records(), NAMES, kind="loss")


# --- tensor_diff ----------------------------------------------------------------------------


def test_one_ulp_apart_in_float32():
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    b = a.copy()
    b[1] = np.nextafter(np.float32(2.0), np.float32(3.0))
    diff = tensor_diff(a, b)
    assert (diff.num_differing, diff.first_index, diff.max_ulps) == (1, 1, 1)
    assert diff.max_abs == 2.0**-22
    assert diff.max_rel == 2.0**-23
    assert not diff.identical


def test_ulps_across_zero_and_between_powers_of_two():
    tiny = np.float64(5e-324)  # the smallest positive subnormal
    assert tensor_diff(np.array([-tiny]), np.array([tiny])).max_ulps == 2
    assert tensor_diff(np.array([1.0], np.float32), np.array([2.0], np.float32)).max_ulps == 2**23
    one = np.array([1.0])
    assert tensor_diff(-one, one).max_ulps == 2 * 0x3FF0000000000000  # beyond int64: exact
    half = np.array([1.0], np.float16)
    assert tensor_diff(half, np.nextafter(half, np.float16(2))).max_ulps == 1


def test_negative_zero_differs_in_bits_but_is_zero_ulps_away():
    diff = tensor_diff(np.array([0.0, 1.0]), np.array([-0.0, 1.0]))
    assert (diff.num_differing, diff.first_index) == (1, 0)
    assert (diff.max_ulps, diff.max_abs, diff.max_rel) == (0, 0.0, 0.0)


def test_identical_arrays_and_nans():
    a = np.array([[1.0, np.nan], [np.inf, -2.0]], dtype=np.float32)
    diff = tensor_diff(a, a.copy())
    assert diff.identical and diff.first_index is None
    assert (diff.max_abs, diff.max_ulps, diff.shape) == (0.0, 0, (2, 2))
    b = a.copy()
    b[1, 1] = np.nan
    worse = tensor_diff(a, b)
    assert (worse.num_differing, worse.first_index) == (1, 3)  # flat index, C order
    assert math.isinf(worse.max_abs) and math.isinf(worse.max_rel)


def test_mismatched_arrays_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"one shape: a is \(2,\), b is \(3,\)"):
        tensor_diff(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="a is float32, b is float64"):
        tensor_diff(np.zeros(2, np.float32), np.zeros(2))
    with pytest.raises(ValueError, match="not int64"):
        tensor_diff(np.zeros(2, np.int64), np.zeros(2, np.int64))


# --- deviation matrix -----------------------------------------------------------------------


def test_deviation_matrix_is_zero_when_ranks_agree():
    ranks, matrix = deviation_matrix({r: step_record(3, r) for r in range(4)})
    assert ranks == (0, 1, 2, 3)
    assert matrix.shape == (4, 4)
    assert not matrix.any()


def test_deviation_matrix_marks_the_outlier_cell():
    at_step = {r: step_record(3, r) for r in range(4)}
    rec = at_step[2]
    at_step[2] = replace(
        rec,
        grad_fingerprints=perturb(rec.grad_fingerprints, {1, 3}),
        grad_norms=tuple(n * 1.25 if i == 1 else n for i, n in enumerate(rec.grad_norms)),
    )
    ranks, matrix = deviation_matrix(at_step)
    assert matrix[2, 1] == pytest.approx(0.25)
    assert matrix[2, 3] == MIN_DEVIATION  # bits differ, norm equal: still visible
    matrix[2, 1] = matrix[2, 3] = 0.0
    assert not matrix.any()


def test_first_divergent_step_reads_the_summaries_only():
    recs = healthy_trace().records
    assert first_divergent_step(recs, kind="param") is None
    recs[2] = [
        with_totals(replace(r, param_fingerprints=(1, 2, 3, r.step))) if r.step >= 4 else r
        for r in recs[2]
    ]
    summaries = {rank: [r.summary() for r in rs] for rank, rs in recs.items()}
    assert first_divergent_step(summaries, kind="param") == 4
    assert first_divergent_step(summaries, kind="grad") is None
    off = {rank: [replace(r, param_fingerprint=0) for r in rs] for rank, rs in summaries.items()}
    assert first_divergent_step(off, kind="param") is None  # recording off: nothing to say
    with pytest.raises(ValueError, match="kind="):
        first_divergent_step(summaries, kind="buffers")

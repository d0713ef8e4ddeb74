"""Trends over steps (norm spread, stragglers, leaks), on records built in one process."""

from dataclasses import replace

import numpy as np
import pytest

from dtlab.analysis.trends import (
    LEAK_FIX,
    MiB,
    aligned_steps,
    find_leaks,
    find_stragglers,
    grad_norm_spread,
    memory_trends,
)
from tests.fakes import healthy_trace, step_record, with_totals

BASE_RSS = 500_000_000


def with_rss(rss):
    """``{rank: [StepRecord]}`` whose rss at step ``s`` (from 1) is ``rss[rank][s - 1]``."""
    out = {}
    for rank, row in enumerate(rss):
        recs = [step_record(s, rank) for s in range(1, len(row) + 1)]
        pairs = zip(recs, row, strict=True)
        out[rank] = [replace(r, memory=replace(r.memory, rss=int(v))) for r, v in pairs]
    return out


def noisy_rss(rng, num_ranks=4, num_steps=20, amplitude=5 * MiB):
    """Every rank at the same level, jumping at random by up to +-amplitude each step."""
    return BASE_RSS + rng.uniform(-amplitude, amplitude, (num_ranks, num_steps))


def with_times(times):
    """``{rank: [StepRecord]}`` with ``times[rank][s - 1]`` = (data, forward, backward, opt)."""
    out = {}
    for rank, row in enumerate(times):
        recs = [step_record(s, rank) for s in range(1, len(row) + 1)]
        out[rank] = [
            replace(r, times=replace(r.times, data=d, forward=f, backward=b, optimizer=o))
            for r, (d, f, b, o) in zip(recs, row, strict=True)
        ]
    return out


def ddp_times(rng, num_ranks=4, num_steps=15, extra_forward=None):
    """Phase times with +-10% noise; a rank's ``extra_forward`` seconds are waited for by
    every other rank in its backward (the all-reduce), as under DDP."""
    extra_forward = extra_forward or {}
    slowest_extra = max(extra_forward.values(), default=0.0)
    times = np.empty((num_ranks, num_steps, 4))
    for rank in range(num_ranks):
        extra = extra_forward.get(rank, 0.0)
        noise = rng.uniform(0.9, 1.1, (num_steps, 4))
        times[rank] = noise * [0.001, 0.010, 0.020, 0.005]
        times[rank, :, 1] += extra
        times[rank, :, 2] += slowest_extra - extra
    return times


# --- aligned steps and gradient norm spread ------------------------------------------------


def test_aligned_steps_keeps_only_steps_every_rank_recorded():
    recs = healthy_trace(num_ranks=3, num_steps=5).records
    recs[1] = [r for r in recs[1] if r.step != 2]
    steps = aligned_steps(recs)
    assert [s for s, _ in steps] == [1, 3, 4, 5]
    assert list(steps[0][1]) == [0, 1, 2]
    assert aligned_steps({}) == []


def test_grad_norm_spread_is_zero_under_ddp_and_shows_a_doubled_rank():
    recs = healthy_trace().records
    assert grad_norm_spread(recs) == [(s, 0.0) for s in range(1, 11)]
    recs[1] = [
        with_totals(replace(r, grad_norms=tuple(2 * n for n in r.grad_norms))) if r.step == 5 else r
        for r in recs[1]
    ]
    spread = dict(grad_norm_spread(recs))
    assert spread[5] == pytest.approx(1.0)  # (2T - T) / median(T, 2T, T, T)
    assert spread[4] == spread[6] == 0.0


def test_grad_norm_spread_leaves_out_steps_without_norms():
    recs = healthy_trace(num_steps=3).records
    recs[0] = [with_totals(replace(r, grad_norms=())) if r.step == 2 else r for r in recs[0]]
    assert [s for s, _ in grad_norm_spread(recs)] == [1, 3]


# --- stragglers -----------------------------------------------------------------------------


def test_healthy_ranks_with_noise_have_no_straggler():
    assert find_stragglers(healthy_trace().records) == []
    rng = np.random.default_rng(0)
    assert find_stragglers(with_times(ddp_times(rng))) == []


def test_straggler_is_found_by_compute_time_though_step_times_match():
    rng = np.random.default_rng(1)
    times = ddp_times(rng, extra_forward={3: 0.030})
    totals = times.sum(axis=2)
    assert np.all(totals.max(axis=0) / totals.min(axis=0) < 1.3)  # step times alike, as in DDP
    [found] = find_stragglers(with_times(times))
    assert (found.kind, found.ranks, found.step) == ("straggler", (3,), 3)
    assert found.evidence["ratio"] > 2.5
    assert found.evidence["slowest_in"] == found.evidence["num_steps"] == 13
    assert found.evidence["compute_ms"] == pytest.approx(46, abs=3)
    assert found.evidence["others_compute_ms"] == pytest.approx(16, abs=2)
    assert found.evidence["others_wait_ms"] == pytest.approx(30, abs=4)
    assert "mostly in forward" in found.summary
    assert "forward pass is slow" in found.fix


def test_a_rank_slow_in_only_half_the_steps_is_no_straggler():
    rng = np.random.default_rng(2)
    times = ddp_times(rng)
    times[0, ::2, 1] += 0.030  # ranks 0 and 1 take turns being slow
    times[1, 1::2, 1] += 0.030
    assert find_stragglers(with_times(times)) == []


def test_too_few_steps_or_ranks_give_no_straggler():
    rng = np.random.default_rng(3)
    times = ddp_times(rng, num_steps=6, extra_forward={3: 0.030})
    assert find_stragglers(with_times(times)) == []  # 6 - 2 warm-up steps < 5
    assert len(find_stragglers(with_times(times), min_steps=4)) == 1
    assert find_stragglers(with_times(times[:1])) == []


# --- leaks ----------------------------------------------------------------------------------


def test_healthy_trace_has_no_leak():
    assert find_leaks(healthy_trace(num_steps=20).records) == []


def test_leak_on_rank_1_is_found_through_noise_on_every_rank():
    rng = np.random.default_rng(4)
    rss = noisy_rss(rng, amplitude=2 * MiB)
    rss[1] += np.arange(20) * 1 * MiB
    [found] = find_leaks(with_rss(rss))
    assert (found.kind, found.ranks, found.step) == ("leak", (1,), 4)
    assert found.evidence["slope_bytes_per_step"] == pytest.approx(MiB, rel=0.2)
    assert found.evidence["num_steps"] == 17
    assert found.evidence["t_stat"] > 10
    assert found.summary.startswith("rank 1 leaks memory: rss grows 1.")
    assert found.fix == LEAK_FIX


def test_leak_is_found_under_five_mib_noise_over_twenty_steps():
    rng = np.random.default_rng(5)
    rss = noisy_rss(rng)
    rss[2] += np.arange(20) * 1 * MiB
    assert [f.ranks for f in find_leaks(with_rss(rss))] == [(2,)]


def test_noise_and_allocator_plateaus_are_no_leak():
    rng = np.random.default_rng(6)
    for _ in range(20):
        rss = noisy_rss(rng)
        for rank in range(4):  # one jump per rank to a plateau that then stays flat
            rss[rank, rng.integers(1, 20) :] += rng.uniform(8, 64) * MiB
        assert find_leaks(with_rss(rss)) == []


def test_a_plateau_on_one_rank_only_is_no_leak():
    rss = noisy_rss(np.random.default_rng(7))
    rss[2, 11:] += 40 * MiB
    trend = memory_trends(with_rss(rss))[2]
    assert trend.t_stat > 4 and not trend.beats_one_jump  # the slope alone would be fooled
    assert find_leaks(with_rss(rss)) == []


def test_warm_up_that_levels_off_on_one_rank_is_no_leak():
    rss = noisy_rss(np.random.default_rng(9), amplitude=1 * MiB)
    rss[0] += 40 * MiB * (1 - np.exp(-np.arange(20) / 6))  # a cache filling up
    trend = memory_trends(with_rss(rss))[0]
    # A line beats one jump and the slope is strong, but the residuals run: no leak.
    assert trend.growing and trend.beats_one_jump and trend.durbin_watson < 1.2
    assert find_leaks(with_rss(rss)) == []


def test_growth_every_rank_shares_is_one_finding_for_all_ranks():
    rng = np.random.default_rng(8)
    rss = noisy_rss(rng, amplitude=2 * MiB) + np.arange(20) * 2 * MiB
    [found] = find_leaks(with_rss(rss))
    assert (found.kind, found.ranks) == ("leak", (0, 1, 2, 3))
    assert "shared by every rank" in found.summary
    slopes = found.evidence["slope_bytes_per_step_by_rank"]
    assert slopes == {r: pytest.approx(2 * MiB, rel=0.2) for r in range(4)}


def test_too_few_steps_give_no_leak():
    rss = np.full((4, 10), BASE_RSS, dtype=float)
    rss[1] += np.arange(10) * 2 * MiB  # exact line, but 10 - 3 warm-up steps < 8
    assert find_leaks(with_rss(rss)) == []
    assert [f.ranks for f in find_leaks(with_rss(rss), min_steps=7)] == [(1,)]


def test_cuda_field_absent_on_cpu_and_unknown_field():
    assert find_leaks(healthy_trace(num_steps=20).records, field="cuda_allocated") == []
    with pytest.raises(ValueError, match="'rss'"):
        find_leaks(healthy_trace().records, field="heap")


def test_an_exact_linear_leak_is_found_whatever_its_residual_order():
    # 2 MiB every step with tiny allocator wobble: the Durbin-Watson test alone said "runs"
    wobble = [0, 4096, 8192, 4096, 0, 0, 4096, 8192, 8192, 4096, 0, 0, 4096, 8192, 4096, 0]
    recs = healthy_trace(num_steps=16).records
    recs[1] = [
        replace(r, memory=replace(r.memory, rss=300 * MiB + i * 2 * MiB + wobble[i]))
        for i, r in enumerate(recs[1])
    ]
    assert [f.ranks for f in find_leaks(recs)] == [(1,)]


def test_a_rank_slower_by_a_sliver_of_the_step_is_no_straggler():
    # seen on a healthy 4-rank script on 2 cores: 0.9 vs 0.7 ms of compute (1.3x) in a
    # step of ~17 ms spent mostly in the all-reduce; nobody waits for 0.2 ms
    rng = np.random.default_rng(3)
    times = np.empty((4, 12, 4))
    for rank in range(4):
        times[rank] = rng.uniform(0.95, 1.05, (12, 4)) * [0.0002, 0.0003, 0.016, 0.0002]
    times[1, :, 0] += 0.0003  # 1.4x the others' compute, 1.7% of the step
    assert find_stragglers(with_times(times)) == []
    times[1, :, 0] += 0.004  # now a quarter of the step: the others do wait for it
    assert [f.ranks for f in find_stragglers(with_times(times))] == [(1,)]

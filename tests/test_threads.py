"""One place sets the thread count that bitwise comparisons across processes depend on."""

import pytest
import torch

from dtlab.agent.threads import common_threads, same_threads, thread_env, use_threads
from dtlab.control.config import LaunchConfig, keeping_threads


def test_same_threads_computes_at_the_count_and_restores_the_old_one():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with same_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), same_threads(other):
        raise RuntimeError("a failing reference still restores the count")
    assert torch.get_num_threads() == before


def test_a_bad_count_is_refused_before_anything_changes():
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="thread count must be >= 1, got 0"):
        use_threads(0)
    assert torch.get_num_threads() == before


def test_child_processes_get_the_count_through_their_environment():
    assert thread_env(3) == {"OMP_NUM_THREADS": "3"}


def test_ranks_at_different_counts_are_named():
    assert common_threads({0: 2, 1: 2}) == 2
    with pytest.raises(ValueError, match=r"\{1: \[0, 2\], 4: \[1\]\}.*--threads N"):
        common_threads({0: 1, 1: 4, 2: 1})


def _keeping(threads_by_rank, **config):
    return keeping_threads(LaunchConfig(num_ranks=len(threads_by_rank), **config), threads_by_rank)


def test_fresh_engines_keep_the_count_the_ranks_ran_at():
    # a restart on a host with other cores would otherwise pick another count
    assert _keeping({0: 3, 1: 3}).threads == 3
    assert _keeping({0: 3, 1: 3}, threads=2).threads == 2  # asked: kept
    assert _keeping({0: 1, 1: 2}).threads is None  # no one count to keep

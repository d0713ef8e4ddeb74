"""The foundation's cluster and stepping tests again, with the ranks started by mpiexec
(ipyparallel's MPI launcher, Open MPI from Debian's openmpi-bin) instead of dtlab's fork
server. Only the ``live2``/``live4`` fixtures change; the tests are the same functions
(as ipyparallel's own test_mpi.py re-runs its cluster tests)."""

import pytest

import dtlab
from dtlab.control.errors import LaunchError
from dtlab.control.launchers import launcher_problem
from tests.conftest import needs, quiet
from tests.test_session_live import (  # noqa: F401 - collected here, on MPI ranks
    test_a_failure_interrupts_the_ranks_still_running,
    test_each_engine_is_the_rank_the_map_says,
    test_errors_on_several_ranks_become_one,
    test_run_push_pull_and_rank_subsets,
    test_timeout_interrupts_a_hung_rank_and_names_it,
    test_two_ranks_form_a_group_proved_by_all_reduce,
)
from tests.test_stepping_live import (  # noqa: F401
    test_a_parameter_changed_on_rank_2_is_named_with_its_step,
    test_an_error_on_one_rank_is_named_and_the_others_go_on,
    test_ddp_demo_steps_with_equal_fingerprints_on_every_rank,
    test_run_until_nonfinite_pauses_every_rank_at_that_step,
)

MISSING = launcher_problem("mpi")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(180),
    needs(MISSING),
]


@pytest.fixture
def live2(cluster_cleanup):
    return dtlab.launch(2, launcher="mpi", progress=quiet)


@pytest.fixture
def live4(cluster_cleanup):
    return dtlab.launch(4, launcher="mpi", progress=quiet)


def test_mpi_ranks_are_mpi_world_ranks(live4):
    """The engine-id -> rank map follows the MPI world, and stays explicit."""
    dt = live4
    assert dt.config.launcher == "mpi"
    seen = dt.run(lambda: int(__import__("os").environ["OMPI_COMM_WORLD_RANK"]))
    assert seen == {0: 0, 1: 1, 2: 2, 3: 3}
    assert sorted(dt.rank_map.engine_ids) == sorted(dt.engines.client.ids)


def test_a_missing_mpi_is_a_clear_launch_error(monkeypatch, no_leftovers):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LaunchError, match="mpiexec on PATH"):
        dtlab.launch(2, launcher="mpi", progress=quiet, restart=True)

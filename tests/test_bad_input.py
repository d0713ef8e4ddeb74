"""Bad input gets a clear error before anything runs: every timeout is a positive number of
seconds (one rule, from magics and from Python); a secret-looking variable's value never
leaves its rank; serving metrics beyond loopback is said out loud."""

from __future__ import annotations

import math
import warnings

import pytest
from IPython.core.error import UsageError

from dtlab.agent.identity import relevant_env
from dtlab.analysis.consistency import find_inconsistencies
from dtlab.control.config import LaunchConfig, checked_timeout
from tests.fakes import rank_info


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, True, "3"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        checked_timeout(bad)


def test_good_timeouts_pass():
    assert checked_timeout(None) is None and checked_timeout(2) == 2.0


@pytest.mark.parametrize(
    "magic, line, cell",
    [
        ("dt", "--timeout 0", "1 + 1"),
        ("dt", "--timeout -1", "1 + 1"),
        ("dt_step", "1 --timeout 0", None),
        ("dt_run", "--until step>=3 --timeout -1", None),
        ("dt_launch", "2 --timeout 0", None),
        ("dt_launch", "2 --pg-timeout -5", None),
    ],
)
def test_magics_refuse_such_timeouts_before_touching_a_rank(ip, magic, line, cell):
    """No session is needed to be refused: the argument is read first."""
    with pytest.raises(UsageError, match="must be a positive number of seconds"):
        if cell is None:
            ip.run_line_magic(magic, line)
        else:
            ip.run_cell_magic(magic, line, cell)


def test_a_launch_config_refuses_them_too():
    with pytest.raises(ValueError, match="--timeout must be a positive number"):
        LaunchConfig(num_ranks=2, timeout_s=-1)


def test_a_secret_looking_value_never_leaves_the_rank_but_differences_still_show():
    env = {"NCCL_IB_TOKEN": "hunter2", "NCCL_DEBUG": "INFO", "HOME": "/root"}
    sent = relevant_env(env)
    assert sent["NCCL_DEBUG"] == "INFO" and "HOME" not in sent
    assert "hunter2" not in sent["NCCL_IB_TOKEN"] and "redacted" in sent["NCCL_IB_TOKEN"]
    other = relevant_env({**env, "NCCL_IB_TOKEN": "letmein"})
    infos = {0: rank_info(0, env=sent), 1: rank_info(1, env=other)}
    (found,) = [f for f in find_inconsistencies(infos) if f.name == "env NCCL_IB_TOKEN"]
    text = found.describe()
    assert "hunter2" not in text and "letmein" not in text and "redacted" in text


def test_serving_metrics_beyond_loopback_warns(ip):
    from dtlab.control.stepper import Stepper
    from dtlab.views.notebook import NotebookSession

    session = NotebookSession.__new__(NotebookSession)  # no ranks needed to serve gauges
    session._metrics = None
    session.stepper = Stepper(world=None, hangs=None)  # no ranks: it holds no trace
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        url = session.serve_metrics(port=0, addr="0.0.0.0")
    try:
        assert url.startswith("http://0.0.0.0:")
        assert any("without a password" in str(w.message) for w in said)
    finally:
        session.stop_metrics()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        session.serve_metrics(port=0)
    session.stop_metrics()
    assert not any("without a password" in str(w.message) for w in said)


def test_a_bandwidth_sweep_of_no_iterations_is_refused_in_the_notebook():
    from dtlab.control.comm_bench import Comm

    with pytest.raises(ValueError, match="need iters >= 1"):
        Comm(world=None).bandwidth_sweep(iters=0)  # before any rank is asked


def test_far_more_local_ranks_than_cores_is_refused_unless_forced(ip):
    from dtlab.control.config import MAX_RANKS_PER_CORE, _cores

    too_many = MAX_RANKS_PER_CORE * _cores() + 1
    with pytest.raises(ValueError, match=f"{too_many} ranks on {_cores()} cores.*--force"):
        LaunchConfig(num_ranks=too_many)
    assert LaunchConfig(num_ranks=too_many, force=True).force  # asked for: allowed
    assert LaunchConfig(num_ranks=too_many, launcher="mpi").num_ranks == too_many  # not here
    with pytest.raises(UsageError, match="refuses more than"):
        ip.run_line_magic("dt_launch", "100000")  # nothing is started


def test_more_ranks_than_cores_is_said_with_the_figure():
    from dtlab.control.config import _cores, oversubscription

    cores = _cores()
    assert oversubscription(LaunchConfig(num_ranks=cores)) is None
    said = oversubscription(LaunchConfig(num_ranks=4 * cores))
    assert said == f"{4 * cores} ranks on {cores} cores: 4 ranks per core, so they take " + (
        "turns and their timings are noisy"
    )


def test_a_failed_launch_does_not_advise_restarting_what_it_stopped():
    """A launch that times out stops every process it started: its error says so, not
    "run %dt_launch N --restart" as for a live session's stuck ranks."""
    from dtlab.control.errors import LaunchError, RankError
    from dtlab.control.lifecycle import _launch_step
    from dtlab.records import RemoteFailure

    def timed_out():
        failures = {0: RemoteFailure("TimeoutError", "no reply in 20 s")}
        raise RankError("initialising ranks", failures, stuck=range(150))

    with pytest.raises(RankError, match="--restart"):
        timed_out()  # in a live session: the advice stands
    with pytest.raises(LaunchError) as failed:
        _launch_step(timed_out)
    text = str(failed.value)
    assert "--restart" not in text and "the failed launch stops them" in text
    assert "larger --timeout" in text


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_launching_another_n_says_which_session_it_stopped(live2):
    import dtlab
    from tests.conftest import quiet

    live2.execute("x = 1")
    with pytest.warns(UserWarning, match="stopped the live 2-rank session and the job attached"):
        session = dtlab.launch(3, progress=quiet)
    assert session.world_size == 3 and live2.closed

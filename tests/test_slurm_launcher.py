"""Ranks as a Slurm job: a real single-node Slurm cluster (slurm-wlm + munge, started here)
and ipyparallel's Slurm launcher. Launch, steps, the job id in %dt_status, and a shutdown
that cancels the job; then the foundation's cluster tests again on Slurm ranks (only the
``live2``/``live4`` fixtures change, as in test_mpi_launcher.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import dtlab
from dtlab.control import lifecycle
from tests.conftest import needs, quiet
from tests.slurm_cluster import SlurmCluster, missing
from tests.test_session_live import (  # noqa: F401 - collected here, on Slurm ranks
    test_each_engine_is_the_rank_the_map_says,
    test_errors_on_several_ranks_become_one,
    test_two_ranks_form_a_group_proved_by_all_reduce,
)
from tests.test_stepping_live import (  # noqa: F401
    test_ddp_demo_steps_with_equal_fingerprints_on_every_rank,
)

MISSING = missing()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(240),
    needs(MISSING),
]


@pytest.fixture(scope="module", autouse=True)
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    patch = pytest.MonkeyPatch()
    patch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])  # sbatch, squeue, scancel
    try:
        cluster.start()
        yield cluster
    finally:
        session = lifecycle._current  # its job must be cancelled while Slurm still runs
        if session is not None and not session.closed and session.config.launcher == "slurm":
            session.shutdown()
        drained = _drained(cluster)
        killed = cluster.stop()
        patch.undo()
    assert drained, "a job was still queued or running after the last shutdown"
    assert killed == [], f"job-step processes outlived their job: {killed}"


def _drained(cluster, timeout_s: float = 30) -> bool:
    """No job left in the queue within the timeout (a cancelled job passes COMPLETING)."""
    deadline = time.monotonic() + timeout_s
    while cluster.jobs():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture
def live2(cluster_cleanup):
    return dtlab.launch(2, launcher="slurm", progress=quiet)


@pytest.fixture
def live4(cluster_cleanup):
    return dtlab.launch(4, launcher="slurm", progress=quiet)


def _slurm_env() -> tuple:
    import os

    return tuple(
        os.environ.get(k)
        for k in ("SLURM_PROCID", "SLURM_LOCALID", "LOCAL_RANK", "MASTER_ADDR", "SLURM_JOB_ID")
    )


def test_launch_step_status_and_shutdown_through_slurm(slurm, ip, capsys, cluster_cleanup):
    ip.run_line_magic(
        "dt_launch", "4 --launcher slurm --partition debug --sbatch-arg=--cpus-per-task=1 --restart"
    )
    assert "4 ranks ready (gloo, slurm launcher)" in capsys.readouterr().out
    dt = ip.user_ns["dt"]
    seen = dt.run(_slurm_env)
    job = seen[0][4]
    for rank, (procid, localid, local_rank, master, job_id) in seen.items():
        assert int(procid) == rank and local_rank == localid  # one node: local = global
        assert master == dt.infos[0].host or master == "127.0.0.1"
        assert job_id == job
    assert [line.split()[0] for line in slurm.jobs()] == [job]
    ip.run_line_magic("dt_demo", "--set num_samples=256")
    ip.run_line_magic("dt_step", "3")
    assert dt.trace.last_step == 3
    capsys.readouterr()
    ip.run_line_magic("dt_status", "")
    assert f"4 ranks, gloo, slurm job {job}" in capsys.readouterr().out
    ip.run_line_magic("dt_shutdown", "")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any("RUNNING" in j for j in slurm.jobs()):
        time.sleep(0.5)
    assert not any("RUNNING" in j for j in slurm.jobs()), slurm.jobs()  # cancelled
    written = list(Path.cwd().glob("slurm-*.out")) + list(Path.cwd().glob("*.sbatch"))
    assert written == []  # the script and the job's output go to the profile's log folder

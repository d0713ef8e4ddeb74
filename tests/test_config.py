import pytest

from dtlab.control.config import LaunchConfig, parse_env


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"num_ranks": 0}, "must be a whole number >= 1, got 0"),
        ({"num_ranks": -2}, "got -2"),
        (
            {"num_ranks": 2, "backend": "mpi"},
            "unknown backend 'mpi'; choose one of auto, gloo, nccl",
        ),
        (
            {"num_ranks": 2, "launcher": "k8s"},
            "unknown launcher 'k8s'; choose one of local, mpi, slurm, ssh",
        ),
        ({"num_ranks": 2, "timeout_s": 0}, "--timeout must be a positive number of seconds"),
        ({"num_ranks": 2, "threads": 0}, "--threads must be >= 1"),
        ({"num_ranks": 2, "port": 70000}, "--port must be 0"),
    ],
)
def test_bad_launch_options_say_what_and_how(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        LaunchConfig(**kwargs)
    assert fragment in str(e.value)


def test_what_needs_new_engines_and_what_a_new_group():
    a = LaunchConfig(num_ranks=2)
    assert a.engine_settings() == LaunchConfig(num_ranks=2, threads=3).engine_settings()
    assert a.engine_settings() != LaunchConfig(num_ranks=2, env={"A": "1"}).engine_settings()
    assert a.engine_settings() != LaunchConfig(num_ranks=3).engine_settings()
    assert a.group_settings() == LaunchConfig(num_ranks=2, timeout_s=5).group_settings()
    assert a.group_settings() != LaunchConfig(num_ranks=2, threads=3).group_settings()


def test_omp_num_threads_env_must_be_a_count():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a whole number >= 1"):
        LaunchConfig(num_ranks=2, env={"OMP_NUM_THREADS": "many"})


def test_parse_env():
    assert parse_env(["NCCL_DEBUG=INFO", "X=a=b", "EMPTY="]) == {
        "NCCL_DEBUG": "INFO",
        "X": "a=b",
        "EMPTY": "",
    }


@pytest.mark.parametrize("item", ["NOVALUE", "=1", "1A=2", "A-B=1"])
def test_parse_env_rejects(item):
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_env([item])


def test_a_launch_keeps_the_logs_of_the_newest_clusters_only(tmp_path):
    """Every launch leaves a controller log, a fork server's and a folder of engine logs
    in the profile: the oldest are removed past KEEP_LOGS; a cluster whose cluster file
    is still there (running) keeps its own, and files of others are left alone."""
    from dtlab.control.cluster import prune_logs

    log, security = tmp_path / "log", tmp_path / "security"
    log.mkdir()
    security.mkdir()
    ids = [f"dtlab-{1_800_000_000 + i}-{i:04x}" for i in range(6)]
    for cid in ids:
        (log / f"{cid}.log").write_text("x")
        (log / f"ipcontroller-{cid}-123.log").write_text("x")
        (log / f"dtlab-forkserver-{cid}-1-123.log").write_text("x")
        (log / f"{cid}-engines").mkdir()
        (log / f"{cid}-engines" / "engine-0.log").write_text("x")
    (security / f"cluster-{ids[0]}.json").write_text("{}")  # the oldest, still running
    (log / "ipython-notebook.log").write_text("not dtlab's")
    assert prune_logs(str(tmp_path), keep=2) == 4 * 3  # ids 1-3: four entries each
    left = {p.name for p in log.iterdir()}
    for cid in (ids[0], ids[4], ids[5]):
        assert {f"{cid}.log", f"{cid}-engines", f"ipcontroller-{cid}-123.log"} <= left
    assert not any(cid in name for cid in ids[1:4] for name in left)
    assert "ipython-notebook.log" in left
    assert prune_logs(str(tmp_path), keep=2) == 0

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
        ({"num_ranks": 2, "timeout_s": 0}, "--timeout must be > 0"),
        ({"num_ranks": 2, "threads": 0}, "--threads must be >= 1"),
        ({"num_ranks": 2, "port": 70000}, "--port must be 0"),
    ],
)
def test_bad_launch_options_say_what_and_how(kwargs, fragment):
    with pytest.raises(ValueError) as e:
        LaunchConfig(**kwargs)
    assert fragment in str(e.value)


def test_group_settings_change_with_env_not_with_timeout():
    a = LaunchConfig(num_ranks=2)
    assert a.group_settings() == LaunchConfig(num_ranks=2, timeout_s=5).group_settings()
    assert a.group_settings() != LaunchConfig(num_ranks=2, env={"A": "1"}).group_settings()


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

"""Pure tests of the environment check on hand-built RankInfo (no cluster)."""

from dtlab.analysis.checks_environment import ENV_RULES, check_environment
from dtlab.records import Evidence
from tests.fakes import rank_info


def evidence(infos, cores=None) -> Evidence:
    ranks = {info.rank: info for info in infos}
    return Evidence(records={}, names=(), ranks=ranks, cores_by_host=cores or {"h": 2})


def world(num_ranks=4, **changes):
    return [rank_info(r, **changes) for r in range(num_ranks)]


def test_healthy_launch_has_no_finding_and_says_what_was_compared():
    result = check_environment(evidence(world()))
    assert result.passed
    assert result.check == "environment"
    assert result.looked_at == (
        "4 ranks on 1 host: versions, 1 environment variable, threads x ranks vs cores"
    )
    assert "h: 4 x 1 threads on 2 cores" in result.passed_because


def test_no_ranks_passes_with_nothing_to_compare():
    result = check_environment(Evidence(records={}, names=()))
    assert result.passed and "no rank information" in result.looked_at


def test_torch_version_on_one_rank_is_an_error_naming_it():
    infos = world()
    infos[2] = rank_info(2, torch_version="2.12.0")
    [found] = check_environment(evidence(infos)).findings
    assert (found.kind, found.severity, found.ranks, found.step) == (
        "environment",
        "error",
        (2,),
        None,
    )
    assert "rank 2 = '2.12.0'" in found.summary
    assert found.evidence["values"] == {"0-1,3": "2.13.0+cpu", "2": "2.12.0"}
    assert "pip show torch" in found.fix


def test_env_variable_on_some_ranks_is_a_warning():
    infos = world()
    infos[3] = rank_info(3, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "4"})
    [found] = check_environment(evidence(infos)).findings
    assert (found.severity, found.ranks) == ("warning", (3,))
    assert "--env MKL_NUM_THREADS=" in found.fix


def test_nccl_variable_on_a_gloo_world_is_advice():
    infos = world(env={"OMP_NUM_THREADS": "1", "NCCL_ALGO": "Ring"})
    [found] = check_environment(evidence(infos)).findings
    assert (found.severity, found.ranks) == ("advice", (0, 1, 2, 3))
    assert "NCCL_ALGO has no effect on a gloo group" in found.summary


def test_gloo_variables_on_nccl_jobs_and_informational_nccl_ones_are_left_alone():
    # NCCL jobs still use gloo for CPU tensors (and dtlab's agreement): GLOO_* matters there
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    assert check_environment(evidence(world(backend="nccl", env=env))).passed
    # container images set NCCL_VERSION to describe themselves, not to configure NCCL
    env = {"OMP_NUM_THREADS": "1", "NCCL_VERSION": "2.21.5"}
    assert check_environment(evidence(world(env=env))).passed


def test_cuda_launch_blocking_on_all_ranks_is_a_warning_naming_them():
    infos = world(env={"OMP_NUM_THREADS": "1", "CUDA_LAUNCH_BLOCKING": "1"})
    [found] = check_environment(evidence(infos)).findings
    assert (found.severity, found.ranks) == ("warning", (0, 1, 2, 3))
    assert "serialises" in found.summary and "ranks 0-3 = '1'" in found.summary


def test_distributed_debug_detail_warns_and_nccl_debug_info_advises_on_nccl():
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_DEBUG": "INFO"}
    findings = check_environment(evidence(world(backend="nccl", env=env))).findings
    assert sorted((f.evidence["variable"], f.severity) for f in findings) == [
        ("NCCL_DEBUG", "advice"),
        ("TORCH_DISTRIBUTED_DEBUG", "warning"),
    ]


def test_two_threads_per_rank_on_two_cores_is_a_warning_with_the_numbers():
    result = check_environment(evidence(world(num_threads=2)))
    [found] = result.findings
    assert (found.severity, found.ranks) == ("warning", (0, 1, 2, 3))
    assert "4 ranks x 2 threads = 8 threads on 2 cores" in found.summary
    assert "5.7x" in found.summary
    assert found.evidence["threads"] == {0: 2, 1: 2, 2: 2, 3: 2}
    assert found.evidence["cores"] == 2
    assert "--threads 1" in found.fix and "OMP_WAIT_POLICY=PASSIVE" in found.fix


def test_passive_wait_policy_downgrades_oversubscription_to_advice():
    env = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}
    [found] = check_environment(evidence(world(num_threads=2, env=env))).findings
    assert (found.severity, found.ranks) == ("advice", (0, 1, 2, 3))
    assert "OMP_WAIT_POLICY" not in found.fix


def test_only_the_oversubscribed_host_is_named():
    infos = [rank_info(r, host="a", num_threads=2) for r in (0, 1)]
    infos += [rank_info(r, host="b", num_threads=2) for r in (2, 3)]
    result = check_environment(evidence(infos, cores={"a": 4, "b": 2}))
    [found] = result.findings
    assert found.ranks == (2, 3) and found.evidence["host"] == "b"
    assert result.looked_at.startswith("4 ranks on 2 hosts")


def test_cuda_visible_devices_per_rank_is_expected():
    infos = [
        rank_info(r, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": str(r)}) for r in range(4)
    ]
    assert check_environment(evidence(infos)).passed


def test_rules_table_is_well_formed():
    for rule in ENV_RULES:
        assert rule.severity in ("error", "warning", "advice")
        assert rule.why and rule.fix

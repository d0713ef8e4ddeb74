from dtlab.analysis.consistency import find_inconsistencies
from tests.fakes import rank_info as info


def test_identical_ranks_have_no_inconsistency():
    assert find_inconsistencies({r: info(r) for r in range(4)}) == []


def test_per_rank_fields_like_pid_and_rank_are_not_inconsistencies():
    infos = {r: info(r, pid=1000 * r, host="h") for r in range(4)}
    assert find_inconsistencies(infos) == []


def test_version_difference_names_the_ranks():
    infos = {r: info(r) for r in range(4)}
    infos[3] = info(3, torch_version="2.12.0")
    [found] = find_inconsistencies(infos)
    assert found.name == "torch_version"
    assert found.describe() == "torch_version differs: ranks 0-2 = '2.13.0+cpu'; rank 3 = '2.12.0'"


def test_env_var_set_on_some_ranks_only():
    infos = {r: info(r, env={"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO"}) for r in range(2)}
    infos.update({r: info(r) for r in (2, 3)})
    [found] = find_inconsistencies(infos)
    assert found.name == "env NCCL_DEBUG"
    assert "ranks 0-1 = 'INFO'; ranks 2-3 = unset" in found.describe()
    assert not found.expected_per_rank


def test_thread_count_difference_is_flagged():
    infos = {r: info(r, num_threads=2 if r == 1 else 1) for r in range(4)}
    assert [f.name for f in find_inconsistencies(infos)] == ["num_threads"]


def test_cuda_visible_devices_flagged_but_marked_as_usual():
    infos = {r: info(r, env={"CUDA_VISIBLE_DEVICES": str(r)}) for r in range(4)}
    [found] = find_inconsistencies(infos)
    assert found.expected_per_rank
    assert "own GPU" in found.describe()

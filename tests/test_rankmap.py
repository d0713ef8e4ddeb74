import pytest

from dtlab.control.rankmap import (
    assign_ranks,
    choose_backend,
    cuda_device,
    make_plans,
    master_addr,
    threads_per_rank,
)
from dtlab.records import EngineFacts


def facts(host="h", pid=1, cpus=2, gpus=0, index=None, visible=None):
    return EngineFacts(
        host=host,
        pid=pid,
        num_cpus=cpus,
        num_cuda_devices=gpus,
        launch_index=index,
        cuda_visible_devices=visible,
    )


def test_ranks_follow_launch_index_not_engine_id():
    # engines registered in a racy order: engine 0 was forked third, and so on
    by_engine = {0: facts(index=2, pid=12), 1: facts(index=0, pid=10), 2: facts(index=1, pid=11)}
    rank_map = assign_ranks(by_engine)
    assert rank_map.engine_ids == (1, 2, 0)
    assert rank_map.engines([0, 2]) == [1, 0]


def test_without_distinct_launch_indexes_order_is_host_then_pid():
    # SLURM_PROCID=0 inherited by every local engine must not decide the order
    by_engine = {5: facts("b", 7, index=0), 6: facts("a", 9, index=0), 7: facts("a", 3, index=0)}
    assert assign_ranks(by_engine).engine_ids == (7, 6, 5)


def test_local_ranks_and_sizes_per_host():
    by_engine = {i: facts(host="n1" if i < 3 else "n2", index=i) for i in range(5)}
    m = assign_ranks(by_engine)
    assert m.local_ranks == (0, 1, 2, 0, 1)
    assert m.local_world_sizes == (3, 3, 3, 2, 2)
    assert master_addr(m) == "n1"


def test_one_host_rendezvous_on_loopback():
    m = assign_ranks({i: facts(index=i) for i in range(4)})
    assert master_addr(m) == "127.0.0.1"


def test_assign_ranks_needs_engines():
    with pytest.raises(ValueError, match="no engines"):
        assign_ranks({})


def test_auto_backend_is_gloo_without_a_gpu_per_rank():
    by_engine = {i: facts(index=i, gpus=1) for i in range(2)}  # 2 ranks share 1 GPU
    assert choose_backend("auto", assign_ranks(by_engine), by_engine) == "gloo"
    by_engine = {i: facts(index=i, gpus=2) for i in range(2)}
    assert choose_backend("auto", assign_ranks(by_engine), by_engine) == "nccl"


def test_nccl_without_gpus_names_ranks_and_fix():
    by_engine = {i: facts(index=i, gpus=0) for i in range(8)}
    with pytest.raises(ValueError) as e:
        choose_backend("nccl", assign_ranks(by_engine), by_engine)
    assert "ranks 0-7" in str(e.value) and "--backend gloo" in str(e.value)


def test_threads_never_oversubscribe_a_host():
    assert threads_per_rank(None, num_cpus=2, local_world_size=8) == 1
    assert threads_per_rank(None, num_cpus=16, local_world_size=4) == 4
    assert threads_per_rank(3, num_cpus=2, local_world_size=8) == 3


def test_plans_carry_everything_a_rank_needs():
    by_engine = {10 + i: facts(host="n1" if i < 2 else "n2", index=i, cpus=8) for i in range(4)}
    m = assign_ranks(by_engine)
    plans = make_plans(
        m,
        by_engine,
        backend="gloo",
        port=29500,
        threads=None,
        timeout_s=60.0,
        env={"NCCL_DEBUG": "INFO"},
    )
    assert [p.rank for p in plans.values()] == [0, 1, 2, 3]
    assert {p.master_addr for p in plans.values()} == {"n1"}
    assert [p.local_rank for p in plans.values()] == [0, 1, 0, 1]
    assert {p.num_threads for p in plans.values()} == {4}
    assert plans[3].env == {"NCCL_DEBUG": "INFO"} and plans[3].master_port == 29500


def test_gpu_per_rank_by_local_rank_or_by_own_visible_device():
    shared = {i: facts(index=i, gpus=4) for i in range(4)}  # every rank sees 4 GPUs
    m = assign_ranks(shared)
    assert [cuda_device(r, m, shared) for r in range(4)] == [0, 1, 2, 3]
    own = {i: facts(index=i, gpus=1, visible=str(i)) for i in range(4)}  # --gpus-per-task=1
    m = assign_ranks(own)
    assert [cuda_device(r, m, own) for r in range(4)] == [0, 0, 0, 0]
    assert choose_backend("auto", m, own) == "nccl"
    same = {i: facts(index=i, gpus=1, visible="0") for i in range(2)}  # two ranks, one GPU
    assert choose_backend("auto", assign_ranks(same), same) == "gloo"


def test_omp_num_threads_in_env_sets_threads_unless_given():
    by_engine = {i: facts(index=i, cpus=8) for i in range(2)}
    m = assign_ranks(by_engine)
    common = dict(backend="gloo", port=1, timeout_s=1.0, env={"OMP_NUM_THREADS": "3"})
    assert {p.num_threads for p in make_plans(m, by_engine, threads=None, **common).values()} == {3}
    assert {p.num_threads for p in make_plans(m, by_engine, threads=2, **common).values()} == {2}

"""Rank-side rendezvous without ipyparallel: one rank in this process, then a real
two-process gloo world."""

import multiprocessing as mp
import os
import queue as queues
import socket

import pytest

from dtlab.agent import rendezvous
from dtlab.records import RankPlan


def plan(rank, world_size, port, **kw):
    return RankPlan(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        master_addr="127.0.0.1",
        master_port=port,
        backend="gloo",
        cuda_device=None,
        num_threads=1,
        timeout_s=30.0,
        **kw,
    )


@pytest.fixture
def own_environ():
    """join() writes RANK, MASTER_PORT... into os.environ: give it back as it was, so later
    tests (and the clusters they start) do not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.timeout(60)
def test_one_rank_group_joins_checks_and_leaves(own_environ):
    port = rendezvous.open_store(0, 1, 30.0)
    assert port > 0
    try:
        info = rendezvous.join(plan(0, 1, port, env={"NCCL_DEBUG": "WARN"}))
        assert info.allreduce_sum == 0 and info.world_size == 1 and info.backend == "gloo"
        assert type(info.torch_version) is str  # a TorchVersion would import torch in the notebook
        assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == str(port)
        assert info.env["NCCL_DEBUG"] == "WARN"
        assert rendezvous.check_group() == 0
        assert rendezvous.rank_namespace()["rank"] == 0
    finally:
        rendezvous.leave()
    with pytest.raises(RuntimeError, match="run %dt_launch first"):
        rendezvous.check_group()


@pytest.mark.timeout(60)
def test_port_in_use_is_named_with_the_fix():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError) as e:
            rendezvous.open_store(port, 2, 5.0)
    assert f"port {port} is already in use" in str(e.value)
    assert "--port" in str(e.value)


def _rank_main(rank, port, queue):
    if rank == 0:
        rendezvous.open_store(port, 2, 30.0)
    info = rendezvous.join(plan(rank, 2, port))
    queue.put((rank, info.allreduce_sum, info.rank))
    rendezvous.leave()


@pytest.mark.timeout(90)
def test_two_process_gloo_world():
    with socket.socket() as s:  # a port for the test only; open_store(0) is tested above
        s.bind(("", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    try:
        while len(results) < len(procs):
            try:
                results.append(queue.get(timeout=0.5))
            except queues.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed, f"a rank process failed with exit code {failed}"
        results.sort()
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    assert results == [(0, 1, 0), (1, 1, 1)]

"""Sharded jobs on 4 live gloo ranks: FSDP2 (``fully_shard``) and ZeroRedundancyOptimizer.

They step; each rank's memory shows what sharding saved against plain DDP; gradient and
parameter fingerprints are taken of the whole (gathered) tensors, so they agree across
ranks; the doctor is clean; a checkpoint resumes bit for bit on fresh engines.
"""

from __future__ import annotations

import pytest

from dtlab import demo

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def memory_at(dt, step: int) -> dict:
    return {rank: rec.memory for rank, rec in dt.trace.at(step).items()}


@pytest.fixture
def ddp_memory(live4):
    demo.attach(live4, num_samples=512)
    live4.step(2)
    return memory_at(live4, 2)


@pytest.mark.parametrize("sharding", ["fsdp2", "zero"])
def test_a_sharded_job_steps_saves_memory_and_resumes_bit_identically(
    live4, tmp_path, ddp_memory, sharding
):
    dt = live4
    dt.checkpoint_root = tmp_path / "checkpoints"
    infos = demo.attach(dt, num_samples=512, sharding=sharding, accumulate=2)
    assert {i.optimizer for i in infos.values()} == (
        {"ZeroRedundancyOptimizer"} if sharding == "zero" else {"AdamW"}
    )
    dt.step(4)
    now = memory_at(dt, 4)
    full = ddp_memory[0]
    for rank, mem in now.items():
        if sharding == "fsdp2":  # parameters, gradients and Adam state: a quarter each
            assert mem.param_bytes == pytest.approx(full.param_bytes / 4, rel=0.05), rank
            assert mem.grad_bytes == pytest.approx(full.grad_bytes / 4, rel=0.05), rank
        else:  # ZeRO: the model is whole, the optimizer state is a shard
            assert mem.param_bytes == full.param_bytes
        assert mem.optimizer_bytes < 0.35 * full.optimizer_bytes, (rank, mem)
    last = dt.trace.at(4)
    assert len({r.grad_fingerprint for r in last.values()}) == 1  # whole gradients agree
    assert len({r.param_fingerprint for r in last.values()}) == 1
    assert dt.doctor() == []
    report = dt.resume_check(3)
    assert report.identical, report.summary()

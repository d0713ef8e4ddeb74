"""Per-rank records built by hand, for the pure tests (no cluster)."""

import math
from dataclasses import replace

from dtlab.records import (
    JobInfo,
    ParamInfo,
    RankInfo,
    StepMemory,
    StepRecord,
    StepTimes,
    combine_fingerprints,
)
from dtlab.records.trace import Trace

_BASE = RankInfo(
    rank=0,
    world_size=4,
    local_rank=0,
    local_world_size=4,
    host="h",
    pid=100,
    device="cpu",
    backend="gloo",
    num_threads=1,
    python_version="3.11.7",
    torch_version="2.13.0+cpu",
    cuda_version=None,
    nccl_version=None,
    allreduce_sum=6,
    env={"OMP_NUM_THREADS": "1"},
)

PARAMS = (
    ParamInfo("embed.weight", (16, 4), "torch.float32", 64),
    ParamInfo("blocks.0.weight", (4, 4), "torch.float32", 16),
    ParamInfo("blocks.0.bias", (4,), "torch.float32", 4),
    ParamInfo("head.weight", (16, 4), "torch.float32", 64),
)


def rank_info(rank: int, **changes) -> RankInfo:
    """A healthy rank of a 4-rank CPU world, with ``changes`` applied."""
    return replace(_BASE, **{"rank": rank, "local_rank": rank, "pid": 100 + rank, **changes})


def job_info(rank: int, params=PARAMS, **changes) -> JobInfo:
    base = JobInfo(
        rank=rank,
        model="Toy",
        wrapper="DistributedDataParallel",
        optimizer="AdamW",
        scheduler=None,
        scaler=False,
        params=params,
        record=True,
        capacity=1000,
    )
    return replace(base, **changes)


def step_record(step: int, rank: int = 0, num_params: int = len(PARAMS), **changes) -> StepRecord:
    """A healthy data-parallel step: every rank has the same fingerprints at a step."""
    base = StepRecord(
        step=step,
        time=1000.0 + step,
        loss=2.0 / step,
        lr=1e-3,
        scale=None,
        skipped=False,
        times=StepTimes(data=0.001, forward=0.01, backward=0.02, optimizer=0.005),
        memory=StepMemory(rss=500_000_000, param_bytes=592, grad_bytes=592, optimizer_bytes=1184),
        indices=tuple(range(rank * 4 + step * 100, rank * 4 + step * 100 + 4)),
        grad_norms=tuple(1.0 / (step + i) for i in range(num_params)),
        grad_fingerprints=tuple(step * 1000 + i for i in range(num_params)),
        param_fingerprints=tuple(step * 2000 + i for i in range(num_params)),
        nonfinite=(0,) * num_params,
        missing_grads=(),
    )
    rec = replace(base, **changes)
    if "update_rms" not in changes:  # Adam-like: each element moves by about the LR
        lr = rec.lr if rec.lr is not None and math.isfinite(rec.lr) else 1e-3
        rec = replace(rec, update_rms=0.8 * lr)
    return with_totals(rec, **changes)


def with_totals(rec: StepRecord, **given) -> StepRecord:
    """Fill the whole-step numbers from the per-parameter tuples, as a rank does (unless
    the test gave them)."""
    squares = [n * n for n in rec.grad_norms if not math.isnan(n)]
    totals = {
        "grad_norm": math.sqrt(math.fsum(squares)) if rec.grad_norms else None,
        "grad_fingerprint": combine_fingerprints(rec.grad_fingerprints),
        "param_fingerprint": combine_fingerprints(rec.param_fingerprints),
        "num_nonfinite": sum(rec.nonfinite),
    }
    return replace(rec, **{k: v for k, v in totals.items() if k not in given})


def healthy_trace(num_ranks: int = 4, num_steps: int = 10) -> Trace:
    """An in-memory trace of a healthy data-parallel job."""
    trace = Trace({r: job_info(r) for r in range(num_ranks)})
    for rank in range(num_ranks):
        trace.add(rank, [step_record(s, rank) for s in range(1, num_steps + 1)])
    return trace

"""Each fault made on purpose with dtlab.inject on 4 live ranks, and %dt_doctor naming it:
the check, the rank(s), the step and where."""

import statistics
import time

import pytest

from dtlab import demo
from tests.test_stepping_live import steady_straggler_verdict

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# memory freed by earlier tests would hide a leak's first steps from RSS: give it back
TRIM_HEAP = "import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)"

# what outlives the job (the process environment) is put back after the test
UNDO = {"mismatched environment variable": "import os; os.environ.pop('NCCL_ALGO', None)"}

# name -> (demo options, [(ranks, code) before stepping], steps, [(ranks, code) after the
#          first step, or None], expected (check, ranks, step), text the summary names)
FAULTS = {
    "perturbed parameter": (
        {},
        [],
        2,
        ([2], "dtlab.inject.perturb_param('blocks.1.attn.qkv.weight')"),
        2,
        ("divergence", (2,), 3),
        "blocks.1.attn.qkv.weight",
    ),
    "per-rank initial weights": (
        {},
        [([1], "dtlab.inject.reinit_weights(seed=1234)")],
        2,
        None,
        0,
        ("initial_state", (1,), 1),
        "embed.weight",
    ),
    "different learning rate": (
        {},
        [],
        2,
        ([1], "dtlab.inject.scale_lr(2.0)"),
        3,
        ("learning_rate", (1,), 3),
        "rank 1",
    ),
    "NaN from a module": (
        {"ddp": False},
        [([3], "dtlab.inject.nan_at('blocks.2.ffn', step=4)")],
        0,
        None,
        0,
        ("numerics", (3,), 4),
        "blocks.2.ffn on rank 3",
    ),
    "NaN from a module under DDP": (
        {},
        [([3], "dtlab.inject.nan_at('blocks.2.ffn', step=4)")],
        0,
        None,
        0,
        ("numerics", (3,), 4),
        "ranks 0-2 only received inf/nan gradients",
    ),
    "unwatched NaN from a module": (  # plain steps: found by re-running the micro-batch
        {"ddp": False},
        [([3], "dtlab.inject.nan_at('blocks.2.ffn', step=4)")],
        6,
        None,
        0,
        ("numerics", (3,), 4),
        "blocks.2.ffn on rank 3 (found by re-running micro-batch 0 of the step",
    ),
    "unwatched NaN from a module under DDP": (
        {},
        [([3], "dtlab.inject.nan_at('blocks.2.ffn', step=4)")],
        6,
        None,
        0,
        ("numerics", (3,), 4),
        "first non-finite output: blocks.2.ffn on rank 3 (found by re-running",
    ),
    "straggler": (
        {},
        [([3], "dtlab.inject.slow({slow})")],
        10,
        None,
        0,
        ("straggler", (3,), None),
        "forward",
    ),
    "memory leak": (
        {},
        [(None, TRIM_HEAP), ([1], "dtlab.inject.leak(4)")],
        20,
        None,
        0,
        ("leak", (1,), None),
        "rank 1",
    ),
    "memory held on one rank": (
        {},
        [([2], "dtlab.inject.hold(600)")],
        2,
        None,
        0,
        ("memory", (2,), 1),
        "rank 2 holds much more memory",
    ),
    "mismatched environment variable": (
        {},
        [([2], "dtlab.inject.set_env('NCCL_ALGO', 'Ring')")],
        2,
        None,
        0,
        ("environment", (2,), None),
        "NCCL_ALGO",
    ),
    "overlapping shards": (
        {},
        [([3], "dtlab.inject.share_shard(0)")],
        3,
        None,
        0,
        ("data_order", (0, 3), 1),
        "ranks 0,3",
    ),
    "accumulation without no_sync": (
        {"accumulate": 4, "no_sync": False},
        [],
        3,
        None,
        0,
        ("accumulation", (0, 1, 2, 3), 1),
        "every micro-batch",
    ),
    "slow input pipeline": (
        {},
        [([1], "dtlab.inject.slow_data(0.08)")],
        8,
        None,
        0,
        ("data_order", (1,), None),
        "waiting for data",
    ),
    "overflow that keeps the GradScaler skipping": (
        {"scaler": True},
        [([1], "dtlab.inject.nan_at('blocks.1.ffn', 12, until=20, value=float('inf'))")],
        16,
        None,
        0,
        ("numerics", (0, 1, 2, 3), None),
        "skipped",
    ),
    "no set_epoch": (
        {"num_samples": 256},
        [(None, "dtlab.inject.skip_set_epoch()")],
        12,
        None,
        0,
        ("data_order", (0, 1, 2, 3), 9),
        "set_epoch",
    ),
}


def _one_step_of_compute(dt, steps: int = 4) -> float:
    """Seconds of compute (data + forward + optimizer) in a median step here, at least
    40 ms: a busy machine's noise can hide a fixed 40 ms, not a doubled step."""
    dt.step(steps)
    compute = [
        r.times.data + r.times.forward + r.times.optimizer
        for recs in dt.trace.records.values()
        for r in recs[1:]
    ]
    return max(0.04, statistics.median(compute))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_doctor_finds_each_fault_where_it_was_made(live4, fault):
    options, before, steps, after, more_steps, expected, named = FAULTS[fault]
    dt = live4
    demo.attach(dt, **options)
    dt.execute("import dtlab")
    for ranks, code in before:
        if "{slow}" in code:  # a straggler as slow as a step is long on this machine now
            code = code.format(slow=_one_step_of_compute(dt))
        dt.execute(code, ranks=ranks)
    if fault.startswith("NaN from a module"):
        dt.run_until("nonfinite", max_steps=10)  # watches modules while it runs
    if steps:
        dt.step(steps)
    if after:
        dt.execute(after[1], ranks=after[0])
        dt.step(more_steps)
    if expected[0] == "straggler":  # timings: on a busy machine, step until it can judge
        steady_straggler_verdict(dt)
    start = time.monotonic()
    try:
        findings = dt.doctor()
        took = time.monotonic() - start
    finally:
        if fault in UNDO:
            dt.execute(UNDO[fault])
    kind, ranks, step = expected
    hits = [f for f in findings if (f.kind, f.ranks) == (kind, ranks)]
    assert hits, [(f.kind, f.ranks, f.step, f.summary) for f in findings]
    if step is not None:
        assert hits[0].step == step
    assert named in hits[0].summary
    assert took < 30
    print(
        f"\nFOUND | {fault} | {kind} | {ranks} | {hits[0].step} | {dt.trace.last_step} "
        f"steps | {took:.2f} s"
    )

"""The doctor at scale: every check over R simulated ranks x S steps, with planted problems.

    python benchmarks/doctor_scale.py                       # 512 ranks x 1,000 steps
    python benchmarks/doctor_scale.py --ranks 64 --steps 200 --ranks 512

Records are built as the notebook holds them (step summaries, one per rank and step) for a
data-parallel job of 300 parameters: every rank reads its own shard, replicas agree bit for
bit, times and memory carry a little noise. Planted: one rank whose weights part from the
others at 40 % of the run (divergence), one that keeps 4 MiB more each step (a leak), one
whose forward takes 1.5x as long (a straggler). Reports the time each check takes, the
notebook's memory for the records and the peak while the doctor runs, and whether each
planted problem was named. The target (issue 20): 512 x 1,000 in < 3 s.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtlab.analysis.doctor import all_findings, run_checks  # noqa: E402
from dtlab.analysis.registry import registered  # noqa: E402
from dtlab.records import (  # noqa: E402
    Evidence,
    JobInfo,
    ParamInfo,
    StepMemory,
    StepRecord,
    StepTimes,
)
from dtlab.records.trace import Trace  # noqa: E402

PARAMS = 300
MIB = 1 << 20


def job(rank: int, params: tuple[ParamInfo, ...]) -> JobInfo:
    return JobInfo(
        rank=rank,
        model="Transformer",
        wrapper="DistributedDataParallel",
        optimizer="AdamW",
        scheduler="LambdaLR",
        scaler=False,
        params=params,
        record=True,
        capacity=2000,
        data="DataLoader, DistributedSampler",
    )


def simulate(ranks: int, steps: int, batch: int = 8, seed: int = 0):
    """{rank: [StepRecord]} with the three planted problems, and which ranks carry them."""
    rnd = random.Random(seed)
    params = tuple(
        ParamInfo(f"layers.{i // 6}.w{i % 6}", (256, 256), "float32", 65536) for i in range(PARAMS)
    )
    diverged, leaking, slow = ranks // 3, ranks // 2, (2 * ranks) // 3
    split = max(2, int(steps * 0.4))
    base_rss = 3 << 30
    records: dict[int, list[StepRecord]] = {}
    for rank in range(ranks):
        recs = []
        for step in range(1, steps + 1):
            grad_fp = hash(("g", step)) & ((1 << 64) - 1)
            param_fp = hash(("p", step)) & ((1 << 64) - 1)
            if rank == diverged and step >= split:
                grad_fp ^= 0x5A5A
                param_fp ^= 0xA5A5
            forward = 0.015 * (1.5 if rank == slow else 1.0) * rnd.uniform(0.97, 1.03)
            rss = base_rss + (4 * MIB * step if rank == leaking else 0) + rnd.randrange(MIB)
            start = ((step - 1) * ranks + rank) * batch
            recs.append(
                StepRecord(
                    step=step,
                    time=1.7e9 + step * 0.06,
                    loss=2.0 / (1 + 0.01 * step) * rnd.uniform(0.98, 1.02),
                    lr=1e-3 * min(1.0, step / 100),
                    scale=None,
                    skipped=False,
                    times=StepTimes(
                        data=0.001 * rnd.uniform(0.9, 1.1),
                        forward=forward,
                        backward=0.030 * rnd.uniform(0.97, 1.03),
                        optimizer=0.004,
                        record=0.0005,
                    ),
                    memory=StepMemory(
                        rss=rss,
                        param_bytes=PARAMS * 65536 * 4,
                        grad_bytes=PARAMS * 65536 * 4,
                        optimizer_bytes=2 * PARAMS * 65536 * 4,
                        dtlab_bytes=2 * MIB,
                    ),
                    indices=tuple(range(start, start + batch)),
                    grad_norm=1.0 / (1 + 0.001 * step),
                    grad_fingerprint=grad_fp,
                    param_fingerprint=param_fp,
                )
            )
        records[rank] = recs
    planted = {"divergence": diverged, "memory": leaking, "straggler": slow}
    return records, params, planted, split


def named(findings, planted: dict[str, int]) -> dict[str, bool]:
    """Was each planted rank named by a finding of the kind that should name it?"""
    kinds = {
        "divergence": ("divergence",),
        "memory": ("memory", "leak"),
        "straggler": ("straggler",),
    }
    found = {}
    for problem, rank in planted.items():
        found[problem] = any(
            rank in f.ranks and any(k in f.kind for k in kinds[problem]) for f in findings
        )
    return found


def measure(ranks: int, steps: int) -> dict:
    process = psutil.Process()
    registered()  # the checks' modules imported before anything is timed
    gc.collect()
    before = process.memory_info().rss
    t0 = time.perf_counter()
    records, params, planted, split = simulate(ranks, steps)
    built = time.perf_counter() - t0
    held = process.memory_info().rss - before
    jobs = {r: job(r, params) for r in records}
    trace = Trace(jobs)  # as the notebook keeps them: records, and their numbers as columns
    t0 = time.perf_counter()
    for step in range(steps):  # in the order they arrive: a step of every rank at a time
        for rank, recs in records.items():
            trace.add(rank, recs[step : step + 1])
        if (step + 1) % 10 == 0:
            trace.flush()  # the end of a run of 10 steps, as the stepper does
    stored = time.perf_counter() - t0
    evidence = Evidence(
        records=trace.records, columns=trace.columns, names=tuple(p.name for p in params), jobs=jobs
    )
    per_check = {}
    results = []
    peak = process.memory_info().rss
    t0 = time.perf_counter()
    for entry in registered():
        t = time.perf_counter()
        results.extend(run_checks(evidence, [entry]))
        per_check[entry.name] = time.perf_counter() - t
        peak = max(peak, process.memory_info().rss)
    total = time.perf_counter() - t0
    findings = all_findings(results)
    return {
        "ranks": ranks,
        "steps": steps,
        "build_s": built,
        "store_us": stored / (ranks * steps) * 1e6,
        "records_mib": held / MIB,
        "doctor_s": total,
        "peak_mib": (peak - before) / MIB,
        "per_check": per_check,
        "named": named(findings, planted),
        "split": split,
        "findings": [f.summary for f in findings],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[512])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--show", action="store_true", help="print every finding")
    args = parser.parse_args()
    print(f"doctor over simulated data-parallel ranks, {PARAMS} parameters, {args.steps} steps")
    for ranks in args.ranks:
        m = measure(ranks, args.steps)
        slowest = sorted(m["per_check"].items(), key=lambda kv: -kv[1])[:4]
        print(
            f"{ranks} ranks x {args.steps} steps: doctor {m['doctor_s']:.2f} s "
            f"({m['doctor_s'] / (ranks * args.steps) * 1e6:.1f} us per rank-step); records "
            f"{m['records_mib']:.0f} MiB in memory (built in {m['build_s']:.1f} s), stored in "
            f"the trace at {m['store_us']:.1f} us per rank-step, "
            f"peak +{m['peak_mib']:.0f} MiB"
        )
        print("  slowest checks: " + ", ".join(f"{n} {s:.2f} s" for n, s in slowest))
        print(
            "  planted problems named: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in m["named"].items())
        )
        if args.show:
            for line in m["findings"]:
                print(f"  - {line}")


if __name__ == "__main__":
    main()

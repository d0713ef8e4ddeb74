"""Steady-state step time of the demo job under dtlab, side by side with torchrun.

    python benchmarks/step_overhead.py                   # N = 2 4 8, 3 repeats each
    python benchmarks/step_overhead.py --ranks 8 --repeats 5 --json results.json

The same job (the demo model in DDP, AdamW, LambdaLR, DistributedSampler) and the same
loop, measured per N in one run, the tools alternating so drift hits both:

- torchrun: a plain loop inside each rank, no dtlab; ms per step over --steps steps;
- the plain loop inside dtlab's engines (``dt.run``, no stepping channel, no records):
  what the engine processes themselves cost against torchrun's;
- dtlab, recording off: ``dt.step(--steps)`` from the notebook side (loss, LR, times and
  memory are still recorded), wall time / steps;
- dtlab, default recording: the same with per-parameter norms and fingerprints;
- round trip: ``dt.step(1)`` repeated; overhead = notebook wall time minus the slowest
  rank's own step time for that step (what the channel, JSON and bookkeeping cost);
- for scale, an empty ipyparallel call to all ranks (what stepping would cost per call
  without the channel).

Ratios are dtlab / torchrun: 1.05 means 5% slower.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WARMUP = 10


# --- torchrun: the plain loop on every rank -----------------------------------------------
def torchrun_worker(steps: int) -> None:
    import torch
    import torch.distributed as dist

    from dtlab.agent.demo_model import build_demo, demo_step

    dist.init_process_group("gloo")
    job = build_demo(rank=dist.get_rank(), world_size=dist.get_world_size(), ddp=True)
    batches = iter(job.data)

    def step():
        nonlocal batches
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(job.data)
            batch = next(batches)
        return demo_step(job, batch)

    for _ in range(WARMUP):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(
            json.dumps({"step_ms": elapsed / steps * 1e3, "threads": torch.get_num_threads()}),
            flush=True,
        )
    dist.destroy_process_group()


def measure_torchrun(n: int, steps: int) -> float:
    cmd = [
        *TORCHRUN,
        "--standalone",
        f"--nproc_per_node={n}",
        str(HERE),
        "--role",
        "torchrun-worker",
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"torchrun failed:\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:  # after rank 0 reported: torch's teardown, not the loop
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        print(
            f"  (torchrun exited {proc.returncode} after its timing: {tail[0][:120]})",
            file=sys.stderr,
        )
    return json.loads(lines[-1])["step_ms"]


# --- dtlab: the same job, stepped from this process ---------------------------------------
def _noop():
    return None


def _plain_loop(steps: int) -> float:
    """The torchrun worker's loop, run inside an engine on the attached demo job."""
    import time

    import torch.distributed as dist

    from dtlab.agent.demo_model import demo_step
    from dtlab.agent.job import current
    from dtlab.agent.state import RANK

    job = current()  # its data iterator, so epochs roll over as under dtlab
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        demo_step(RANK.demo, job._next_batch())
    dist.barrier()
    return (time.perf_counter() - start) / steps * 1e3


def measure_dtlab(dt, steps: int, round_trips: int) -> dict:
    from dtlab import demo

    result = {}
    demo.attach(dt, record=False)
    dt.step(WARMUP)
    result["engine_loop_ms"] = dt.run(_plain_loop, steps)[0]
    for label, record in (("off", False), ("default", True)):
        demo.attach(dt, record=record)
        dt.step(WARMUP)
        start = time.perf_counter()
        dt.step(steps)
        result[f"{label}_ms"] = (time.perf_counter() - start) / steps * 1e3
    overheads, trips = [], []
    for _ in range(round_trips):
        start = time.perf_counter()
        run = dt.step(1)
        trip = time.perf_counter() - start
        slowest = max(rec.times.total for rec in dt.trace.at(run.last_step).values())
        trips.append(trip * 1e3)
        overheads.append((trip - slowest) * 1e3)
    result["round_trip_ms"] = statistics.median(trips)
    result["overhead_ms"] = statistics.median(overheads)
    calls = []
    for _ in range(round_trips):
        start = time.perf_counter()
        dt.run(_noop)
        calls.append((time.perf_counter() - start) * 1e3)
    result["ipyparallel_call_ms"] = statistics.median(calls)
    return result


def bench(ranks: list[int], repeats: int, steps: int, round_trips: int) -> dict:
    import dtlab

    results = {}
    for n in ranks:
        runs = {"torchrun": [], "dtlab": []}
        with dtlab.launch(n, progress=lambda *a: None, restart=True) as dt:
            for i in range(repeats):  # alternate, so drift on a noisy machine hits both
                runs["torchrun"].append(measure_torchrun(n, steps))
                runs["dtlab"].append(measure_dtlab(dt, steps, round_trips))
                print(f"  N={n} run {i + 1}/{repeats} done", file=sys.stderr, flush=True)
        results[n] = runs
    return results


def _median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ratio(runs: dict, key: str) -> str:
    """Median / torchrun's median, with the range of the per-repeat ratios (each repeat
    measured dtlab and torchrun back to back)."""
    per = [d[key] / t for d, t in zip(runs["dtlab"], runs["torchrun"], strict=True)]
    mid = _median_of(runs["dtlab"], key) / statistics.median(runs["torchrun"])
    return f"{mid:.2f}x ({min(per):.2f}-{max(per):.2f})"


def report(results: dict) -> str:
    lines = [
        "| N | torchrun ms/step | same loop in dtlab's engines | dtlab, recording off "
        "| dtlab, default recording | `dt.step(1)` overhead | empty ipyparallel call |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, runs in results.items():
        t = statistics.median(runs["torchrun"])
        spread = f"{min(runs['torchrun']):.1f}-{max(runs['torchrun']):.1f}"
        med = functools.partial(_median_of, runs["dtlab"])
        overheads = [r["overhead_ms"] for r in runs["dtlab"]]
        lines.append(
            f"| {n} | {t:.1f} ({spread}) | {med('engine_loop_ms'):.1f}: "
            f"{_ratio(runs, 'engine_loop_ms')} | {med('off_ms'):.1f}: {_ratio(runs, 'off_ms')} "
            f"| {med('default_ms'):.1f}: {_ratio(runs, 'default_ms')} "
            f"| {med('overhead_ms'):.2f} ms ({min(overheads):.2f}-{max(overheads):.2f}) "
            f"| {med('ipyparallel_call_ms'):.1f} ms |"
        )
    lines.append(
        "\nmedians of the repeats; in brackets the range over repeats (ratios: of each "
        "repeat's dtlab / torchrun, measured back to back)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    parser.add_argument("--round-trips", type=int, default=30)
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "torchrun-worker":
        return torchrun_worker(args.steps)
    os.environ.setdefault("DTLAB_RUNS_DIR", str(HERE.parent / "results" / "runs"))
    print(f"{os.cpu_count()} CPUs; medians of {args.repeats} runs each", file=sys.stderr)
    results = bench(args.ranks, args.repeats, args.steps, args.round_trips)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""How much the notebook holds for a long run at many ranks: a Trace's bounded window
against keeping every step, side by side in one run.

    python benchmarks/trace_memory.py                           # 512 ranks, 10,000 steps
    python benchmarks/trace_memory.py --ranks 512 --steps 20000 --window 2000

Each configuration runs in a fresh process (so its resident memory is its own): a Trace
with a run folder takes packed frames as the ranks send them (one frame per rank per run
of ``--run`` steps, then a flush, as ``dt.step`` does), ``--steps`` steps of ``--ranks``
ranks of a data-parallel job (16 sample indices a step, fingerprints equal across ranks
but for one rank whose parameters part at 40 % of the run). Reported: the process's
resident memory after the run above what it held before (RSS, psutil) and its peak, per
rank-step and projected to 100,000 steps; the rate at which records were taken in
(decoded, kept, summarised, written to Parquet); the doctor's time over what the Trace
holds and whether it named the planted divergence at its step; and the run folder's size.
"Every step in memory" stops at ``--whole-steps`` (it grows with the run: the projection
is linear), the window runs the whole ``--steps``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_scale import PARAMS  # noqa: E402
from doctor_scale import job as simulated_job  # noqa: E402

from dtlab.analysis.doctor import all_findings, run_checks  # noqa: E402
from dtlab.control.run_folder_writer import FolderWriter  # noqa: E402
from dtlab.records import Evidence, JobInfo, ParamInfo  # noqa: E402
from dtlab.records.packed import Packed  # noqa: E402
from dtlab.records.row import ROW  # noqa: E402
from dtlab.records.summaries import SUMMARY  # noqa: E402
from dtlab.records.trace import Trace  # noqa: E402

INDICES = 16  # sample ids a rank reads in a step
ODD_RANK = 3


def job(rank: int) -> JobInfo:
    params = tuple(
        ParamInfo(f"layers.{i}.weight", (64, 64), "float32", 4096) for i in range(PARAMS)
    )
    return simulated_job(rank, params)


def frame(rank: int, ranks: int, first: int, count: int, parts_at: int) -> bytes:
    """A rank's packed rows for steps ``first`` .. ``first + count - 1``."""
    steps = np.arange(first, first + count, dtype=np.int64)
    rows = np.zeros(count, dtype=ROW)
    rows["rank"], rows["step"] = rank, steps
    rows["time"] = 1.7e9 + steps * 0.05
    rows["loss"] = 2.0 / np.sqrt(steps) + 0.001 * rank
    rows["lr"], rows["scale"] = 1e-3, np.nan
    rows["data"], rows["forward"], rows["backward"] = 0.001, 0.01 + 0.0001 * rank, 0.02
    rows["optimizer"], rows["record"] = 0.005, 0.0004
    rows["rss"] = 2_000_000_000 + rank
    rows["param_bytes"] = rows["grad_bytes"] = PARAMS * 4096 * 4
    rows["optimizer_bytes"] = 2 * PARAMS * 4096 * 4
    rows["cuda_allocated"] = rows["cuda_reserved"] = rows["cuda_peak"] = np.nan
    rows["grad_norm"] = 1.0 / np.sqrt(steps)
    rows["grad_fingerprint"] = (steps * 7919 + 1).astype(np.uint64)
    param = (steps * 104729 + 1).astype(np.uint64)
    if rank == ODD_RANK:
        param = np.where(steps >= parts_at, param + 1, param)
    rows["param_fingerprint"] = param
    rows["micro_batches"], rows["synced_micro_batches"] = 1, 1
    rows["num_indices"] = INDICES
    rows["indices_at"] = np.arange(count) * INDICES
    rows["num_unreached"], rows["comm_calls"], rows["comm_bytes"] = -1, -1, -1
    # None: scale, the CUDA bytes, comm calls and bytes, unreached (bits as in NULLABLE)
    rows["nulls"] = (1 << 1) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 7) | (1 << 8) | (1 << 9)
    # a DistributedSampler's shard: every rank reads its own samples, none twice an epoch
    base = (steps[:, None] * ranks * INDICES + rank * INDICES + np.arange(INDICES)).reshape(-1)
    return Packed(rows, base.astype(np.int64)).to_bytes()


def measure(ranks: int, steps: int, window: int, run: int, out) -> None:
    proc = psutil.Process()
    parts_at = int(steps * 0.4)
    with tempfile.TemporaryDirectory() as tmp:
        # a small trace first, so the imports are not measured
        warm = Trace({r: job(r) for r in range(2)}, sink=FolderWriter(Path(tmp) / "warm"))
        for rank in range(2):
            warm.add_packed(rank, frame(rank, 2, 1, 20, 10))
        warm.close()
        run_checks(Evidence(records=warm.records, names=warm.param_names, jobs=warm.jobs))
        del warm
        before = proc.memory_info().rss
        trace = Trace(
            {r: job(r) for r in range(ranks)}, sink=FolderWriter(Path(tmp) / "run"), window=window
        )
        t0 = time.perf_counter()
        for first in range(1, steps + 1, run):
            count = min(run, steps - first + 1)
            for rank in range(ranks):
                trace.add_packed(rank, frame(rank, ranks, first, count, parts_at))
            trace.flush()
        trace.sync()  # the last part written too (parts are written on a thread)
        took = time.perf_counter() - t0
        held = proc.memory_info().rss - before
        t0 = time.perf_counter()
        evidence = Evidence(
            records=trace.records,
            columns=trace.columns,
            names=trace.param_names,
            jobs=trace.jobs,
            history=trace.history.rows(),
        )
        findings = all_findings(run_checks(evidence))
        doctor = time.perf_counter() - t0
        named = [f for f in findings if f.kind == "divergence" and f.ranks == (ODD_RANK,)]
        disk = sum(p.stat().st_size for p in (Path(tmp) / "run" / "steps").iterdir())
        out.send(
            {
                "held": held,
                "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
                "in_memory": len(trace.records[0]),
                "take_us": took / (ranks * steps) * 1e6,
                "doctor_s": doctor,
                "found_at": named[0].step if named else None,
                "parts_at": parts_at,
                "disk_b": disk / (ranks * steps),
            }
        )


def in_process(ranks: int, steps: int, window: int, run: int) -> dict:
    receive, send = mp.Pipe(duplex=False)
    worker = mp.get_context("spawn").Process(target=measure, args=(ranks, steps, window, run, send))
    worker.start()
    try:
        result = receive.recv()
    finally:
        worker.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--whole-steps", type=int, default=3_000)
    parser.add_argument("--window", type=int, default=2_000)
    parser.add_argument("--run", type=int, default=50, help="steps per dt.step call")
    args = parser.parse_args()
    print(
        f"notebook memory, {args.ranks} simulated ranks, runs of {args.run} steps, "
        f"{INDICES} sample ids a step; rank {ODD_RANK}'s parameters part at 40 % of the run"
    )
    configs = (
        ("every step in memory", args.whole_steps, 0),
        (f"window of {args.window:,} steps", args.steps, args.window),
    )
    for name, steps, window in configs:
        m = in_process(args.ranks, steps, window, args.run)
        per = m["held"] / (args.ranks * steps)
        # bounded: what it holds now, plus a summary row for each step still to come
        projected = (
            per * args.ranks * 100_000
            if not window
            else m["held"] + (100_000 - steps) * SUMMARY.itemsize
        )
        found = (
            f"named the divergence at step {m['found_at']:,} (planted at {m['parts_at']:,})"
            if m["found_at"] is not None
            else "did NOT name the planted divergence"
        )
        print(
            f"{name}: {steps:,} steps, {m['in_memory']:,} per rank in memory: the notebook "
            f"grew {m['held'] / 2**20:,.0f} MiB ({per:,.0f} B per rank-step; peak "
            f"{m['peak'] / 2**20:,.0f} MiB); at 100,000 steps ~{projected / 2**30:,.2f} GiB"
            f"{' (linear)' if not window else ' (bounded: the window)'}; taken in at "
            f"{m['take_us']:.1f} us per rank-step; disk {m['disk_b']:.0f} B per rank-step; "
            f"doctor {m['doctor_s']:.1f} s, {found}"
        )


if __name__ == "__main__":
    main()

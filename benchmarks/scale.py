"""Launchers side by side, what sharding saves, and what dtlab moves per step.

    python benchmarks/scale.py                        # local, mpi, slurm at N = 2 4 8
    python benchmarks/scale.py --launchers local mpi --ranks 2 4

1. Per launcher and N: the launch (``dtlab.launch`` until every rank has joined its
   group), the per-step control overhead (``dt.step(1)`` wall time minus the slowest
   rank's own step time, median of --trips), and the shutdown. ``slurm`` runs on a
   single-node Slurm cluster this script starts (tests/slurm_cluster.py; root and Debian's
   slurm-wlm + munge), ``mpi`` with Open MPI's mpiexec and mpi4py.
2. Memory per rank for the demo model at 4 ranks under DDP, ZeRO (ZeroRedundancyOptimizer)
   and FSDP2 (fully_shard): parameter, gradient and optimizer-state bytes each rank holds.
3. What dtlab moves per rank and step: the step summary each rank sends to the notebook
   (one JSON line, measured as stored) for the demo model and one 16x its parameters, and
   the agreement all-reduce (7 int64 on a gloo group of its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

import dtlab  # noqa: E402
from dtlab import demo  # noqa: E402
from dtlab.records import step_record_to_dict  # noqa: E402

AGREEMENT_BYTES = 7 * 8  # stepping.agree: [pause, hit, failed, fp, -fp, seq, -seq] int64


def quiet(*_):
    pass


def launcher_round(launcher: str, n: int, trips: int) -> dict:
    start = time.perf_counter()
    dt = dtlab.launch(n, launcher=launcher, progress=quiet, restart=True, timeout=300)
    launched = time.perf_counter() - start
    try:
        demo.attach(dt, num_samples=4096)
        dt.step(5)
        overheads = []
        for _ in range(trips):
            t0 = time.perf_counter()
            run = dt.step(1)
            trip = time.perf_counter() - t0
            slowest = max(r.times.total for r in dt.trace.at(run.last_step).values())
            overheads.append(trip - slowest)
    finally:
        t0 = time.perf_counter()
        dt.shutdown()
        stopped = time.perf_counter() - t0
    return {
        "launcher": launcher,
        "ranks": n,
        "launch_s": launched,
        "stop_s": stopped,
        "overhead_ms": statistics.median(overheads) * 1e3,
    }


def memory_per_rank(n: int) -> dict:
    dt = dtlab.launch(n, progress=quiet, restart=True)
    out = {}
    try:
        for name, options in (
            ("DDP", {}),
            ("ZeRO", {"sharding": "zero"}),
            ("FSDP2", {"sharding": "fsdp2"}),
        ):
            demo.attach(dt, num_samples=1024, **options)
            dt.step(3)
            mem = dt.trace.at(3)[0].memory
            out[name] = {
                "param": mem.param_bytes,
                "grad": mem.grad_bytes,
                "optimizer": mem.optimizer_bytes,
                "rss": mem.rss,
            }
    finally:
        dt.shutdown()
    return out


def summary_bytes() -> dict:
    """Bytes of one rank's step summary as stored (what the channel carries per step)."""
    dt = dtlab.launch(2, progress=quiet, restart=True)
    out = {}
    try:
        for label, config in (("demo", {}), ("16x parameters", {"dim": 256})):
            demo.attach(dt, num_samples=1024, **config)
            dt.step(5)
            records = [dt.trace.records[0][-k] for k in range(1, 6)]
            params = sum(p.numel for p in dt.trace.jobs[0].params)
            # as the stepping channel carries it: one JSON line per record
            size = statistics.median(
                len(json.dumps(step_record_to_dict(0, rec)).encode()) for rec in records
            )
            out[label] = {"params": params, "bytes": size}
    finally:
        dt.shutdown()
    return out


def start_slurm():
    from tests.slurm_cluster import SlurmCluster, missing

    if missing():
        raise SystemExit(f"slurm: {missing()}")
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="dtlab-bench-slurm-")))
    cluster.start()
    import os

    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    return cluster


def measure(args) -> dict:
    slurm = start_slurm() if "slurm" in args.launchers else None
    try:
        rounds = []
        for _ in range(args.repeats):  # round-robin: drift hits every launcher alike
            for n in args.ranks:
                for launcher in args.launchers:
                    rounds.append(launcher_round(launcher, n, args.trips))
                    print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        if slurm is not None:
            slurm.stop()
    return {"rounds": rounds, "memory": memory_per_rank(4), "summary": summary_bytes()}


def report(result: dict) -> str:
    lines = [
        "| launcher | N | launch (s) | step overhead (ms) | stop (s) |",
        "|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["launcher"], r["ranks"]) for r in result["rounds"]}, key=lambda k: (k[1], k[0])
    )
    for launcher, n in keys:
        runs = [r for r in result["rounds"] if (r["launcher"], r["ranks"]) == (launcher, n)]

        def med(key, runs=runs):
            return statistics.median(r[key] for r in runs)

        lines.append(
            f"| {launcher} | {n} | {med('launch_s'):.2f} | {med('overhead_ms'):.2f} "
            f"| {med('stop_s'):.2f} |"
        )
    lines += [
        "",
        "| 4 ranks | params / rank | grads / rank | optimizer / rank | RSS / rank |",
        "|---|---|---|---|---|",
    ]
    for name, mem in result["memory"].items():
        mib = {k: v / 2**20 for k, v in mem.items()}
        lines.append(
            f"| {name} | {mib['param']:.2f} MiB | {mib['grad']:.2f} MiB "
            f"| {mib['optimizer']:.2f} MiB | {mib['rss']:.0f} MiB |"
        )
    lines += ["", "| model | parameters | step summary per rank and step |", "|---|---|---|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['params']:,} | {s['bytes']:,} B |")
    lines.append(f"\n- plus the agreement: {AGREEMENT_BYTES} B per rank per agreement")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", nargs="+", default=["local", "mpi", "slurm"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trips", type=int, default=15, help="single steps timed per round")
    parser.add_argument("--json", help="where to write results (default benchmarks/results/)")
    args = parser.parse_args()
    result = measure(args)
    print(report(result))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or HERE.parent / "results" / f"scale-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

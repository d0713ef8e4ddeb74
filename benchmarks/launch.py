"""Launch, relaunch, shutdown and step speed of dtlab, side by side with torchrun.

    python benchmarks/launch.py                      # N = 1 2 4 8, 3 repeats each
    python benchmarks/launch.py --ranks 8 --repeats 5 --json results.json

Every measurement starts a fresh process and times it from the outside, so both tools pay
for their own interpreter start and imports ("from nothing"):

- ready, bare: torch imported, process group up, one all_reduce of the rank ids done;
- ready, DDP: the same plus a small MLP wrapped in DistributedDataParallel and one step
  (DDP's constructor imports torch._dynamo: ~1 s of CPU per rank, docs/design.md);
- relaunch: ``dtlab.launch(N)`` again on the live cluster (reuse, group re-checked);
- shutdown: ``Session.shutdown()`` until no process is left, against torchrun's own
  teardown (rank 0 ready -> torchrun exited);
- steps: median ms per DDP step of the same MLP over --steps steps, run inside the ranks,
  with dtlab's default thread setting against torchrun's.

Ratios are dtlab / torchrun: below 1 means dtlab is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# --- the work, identical under both tools (runs on every rank) ----------------------------
def ddp_steps(num_steps: int) -> list[float]:
    """Build DDP around a small MLP and take ``num_steps`` steps; ms per step."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        opt.step()
        times.append((time.perf_counter() - start) * 1000)
    return times


def torchrun_worker(work: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ids = torch.tensor([dist.get_rank()])
    dist.all_reduce(ids)
    result = {}
    if work == "ddp":
        ddp_steps(1)
    if work == "steps":
        result["step_ms"] = statistics.median(ddp_steps(steps)[5:])
    if dist.get_rank() == 0:
        print(json.dumps({"ready": time.time(), **result}), flush=True)
    dist.barrier()  # ranks that leave while a peer still reads can abort gloo (seen: SIGABRT)
    dist.destroy_process_group()


def dtlab_child(num_ranks: int, work: str, steps: int) -> None:
    import dtlab

    dt = dtlab.launch(num_ranks, progress=lambda *a: None)
    result = {}
    if work == "ddp":
        dt.run(ddp_steps, 1)
    result["ready"] = time.time()
    if work == "steps":
        per_rank = dt.run(ddp_steps, steps)
        result["step_ms"] = statistics.median(per_rank[0][5:])
    if work == "bare":
        start = time.perf_counter()
        assert dtlab.launch(num_ranks, progress=lambda *a: None) is dt
        result["relaunch_s"] = time.perf_counter() - start
    start = time.perf_counter()
    dt.shutdown()
    result["shutdown_s"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)


# --- the driver ---------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float = 300, tries: int = 2) -> tuple[float, dict, float]:
    """(start wall time, last JSON line printed, end wall time) of one fresh process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for attempt in range(1, tries + 1):
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        end = time.time()
        if proc.returncode == 0:
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            return start, json.loads(lines[-1]), end
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        print(
            f"  run failed ({proc.returncode}, try {attempt}/{tries}): {cmd[:4]}... {tail[0]}",
            file=sys.stderr,
            flush=True,
        )
    raise RuntimeError(f"{cmd} failed {tries} times:\n{proc.stderr[-3000:]}")


def measure_torchrun(n: int, work: str, steps: int) -> dict:
    cmd = [
        *TORCHRUN,
        "--standalone",
        f"--nproc_per_node={n}",
        str(HERE),
        "--role",
        "torchrun-worker",
        "--work",
        work,
        "--steps",
        str(steps),
    ]
    start, out, end = _run(cmd)
    return {"ready_s": out["ready"] - start, "teardown_s": end - out["ready"], **out}


def measure_dtlab(n: int, work: str, steps: int) -> dict:
    cmd = [
        sys.executable,
        str(HERE),
        "--role",
        "dtlab-child",
        "-n",
        str(n),
        "--work",
        work,
        "--steps",
        str(steps),
    ]
    start, out, _ = _run(cmd)
    return {"ready_s": out["ready"] - start, **out}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def bench(ranks: list[int], repeats: int, steps: int) -> dict:
    results = {}
    for n in ranks:
        for work in ("bare", "ddp", "steps"):
            if work == "steps" and n == 1:
                continue
            runs = {"torchrun": [], "dtlab": []}
            for i in range(repeats):  # alternate, so drift on a noisy machine hits both
                runs["torchrun"].append(measure_torchrun(n, work, steps))
                runs["dtlab"].append(measure_dtlab(n, work, steps))
                print(f"  N={n} {work} run {i + 1}/{repeats} done", file=sys.stderr, flush=True)
            results[f"{n}/{work}"] = runs
    return results


def report(results: dict) -> str:
    lines = ["| N | measure | torchrun | dtlab | dtlab / torchrun |", "|---|---|---|---|---|"]

    def row(n, label, t, d, unit):
        lines.append(f"| {n} | {label} | {t:.2f} {unit} | {d:.2f} {unit} | {d / t:.2f}x |")

    for key, runs in results.items():
        n, work = key.split("/")
        t, d = runs["torchrun"], runs["dtlab"]
        if work == "steps":
            row(n, "DDP step (median)", median_of(t, "step_ms"), median_of(d, "step_ms"), "ms")
            continue
        label = "ready: torch + group + all_reduce" if work == "bare" else "ready: + DDP + 1 step"
        row(n, label, median_of(t, "ready_s"), median_of(d, "ready_s"), "s")
        if work == "bare":
            row(
                n,
                "stop (torchrun: own teardown)",
                median_of(t, "teardown_s"),
                median_of(d, "shutdown_s"),
                "s",
            )
            lines.append(
                f"| {n} | relaunch on live ranks | - | {median_of(d, 'relaunch_s'):.3f} s | - |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="bare", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "torchrun-worker":
        return torchrun_worker(args.work, args.steps)
    if args.role == "dtlab-child":
        return dtlab_child(args.n, args.work, args.steps)
    print(f"{os.cpu_count()} CPUs; medians of {args.repeats} runs each", file=sys.stderr)
    results = bench(args.ranks, args.repeats, args.steps)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What running your own script under %dt_script costs, side by side with torchrun.

    python benchmarks/script_overhead.py                    # N = 2 4 8, 3 repeats each
    python benchmarks/script_overhead.py --ranks 4 --repeats 5 --json results.json

One script (benchmarks/script_job.py: a small transformer LM in DDP, AdamW, clipping, a
hand-set LR) that times its own steps, run per N in one process, the three ways
alternating so that drift on a busy machine hits them all:

- torchrun: ``torchrun --standalone --nproc-per-node N``, at the ranks' thread count;
- dtlab, recording off: ``dt.run_script(..., record=False)`` then ``dt.continue_script()``
  (the hooks still time each phase and count micro-batches; loss, LR and memory are kept);
- dtlab, default recording: the same with per-parameter norms and fingerprints.

Each run reports the median of its per-step times after a warm-up (rank 0), and the
spread over repeats; ratios are median dtlab / median torchrun (1.05: 5% slower), with the
range of the per-repeat ratios. Targets (issue 16): recording off within 5%, default
recording within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "script_job.py"
sys.path.insert(0, str(HERE.parent))


def run_torchrun(n: int, threads: int, steps: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(SCRIPT),
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_dtlab(dt, record: bool, steps: int, out: Path) -> dict:
    status = dt.run_script(str(SCRIPT), ["--steps", str(steps), "--out", str(out)], record=record)
    if not status.paused:
        raise RuntimeError(f"the script did not pause at step 0: {status}")
    dt.continue_script()
    return json.loads(out.read_text())


def measure(n: int, repeats: int, steps: int) -> dict:
    import dtlab
    from dtlab.agent.threads import common_threads

    dt = dtlab.launch(n, progress=lambda *a: None)
    threads = common_threads({r: i.num_threads for r, i in dt.infos.items()})
    got: dict[str, list[float]] = {"torchrun": [], "record off": [], "record on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            out = Path(tmp) / f"{rep}.json"
            got["torchrun"].append(run_torchrun(n, threads, steps, out)["median_ms"])
            got["record off"].append(run_dtlab(dt, False, steps, out)["median_ms"])
            got["record on"].append(run_dtlab(dt, True, steps, out)["median_ms"])
            print(
                f"  N={n} repeat {rep + 1}: "
                + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in got.items()),
                flush=True,
            )
    base = got["torchrun"]
    result = {"ranks": n, "threads": threads, "steps": steps, "ms": got}
    for mode in ("record off", "record on"):
        ratios = [d / t for d, t in zip(got[mode], base, strict=True)]
        result[mode] = {
            "ratio": statistics.median(got[mode]) / statistics.median(base),
            "ratio_range": (min(ratios), max(ratios)),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dtlab.control import lifecycle

    results = []
    try:
        for n in args.ranks:
            results.append(measure(n, args.repeats, args.steps))
    finally:
        if lifecycle.current_or_none() is not None:
            lifecycle.current().shutdown()
    print(
        f"\n{'N':>3} {'torchrun ms':>14} {'off ms':>14} {'on ms':>14} "
        f"{'off ratio':>18} {'on ratio':>18}"
    )
    for r in results:

        def cell(v):
            return f"{statistics.median(v):6.1f} ({min(v):.0f}-{max(v):.0f})"

        def ratio(mode, r=r):
            lo, hi = r[mode]["ratio_range"]
            return f"{r[mode]['ratio']:.3f} ({lo:.2f}-{hi:.2f})"

        ms = r["ms"]
        print(
            f"{r['ranks']:>3} {cell(ms['torchrun']):>14} {cell(ms['record off']):>14} "
            f"{cell(ms['record on']):>14} {ratio('record off'):>18} {ratio('record on'):>18}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What ``torchrun -m dtlab.run`` costs a job, side by side with plain torchrun, no notebook.

    python benchmarks/live_job.py                      # N = 2 4 8, 3 repeats each
    python benchmarks/live_job.py --ranks 4 --repeats 5 --steps 60 --json results.json
    python benchmarks/live_job.py --batch 32           # 4x the work per step, same model

One script (benchmarks/script_job.py: a small transformer LM in DDP, AdamW, clipping, a
hand-set LR) that times its own steps, run per N three ways, alternating so that drift on
a busy machine hits them all:

- torchrun: ``torchrun --standalone --nproc-per-node N script_job.py``;
- dtlab.run, recording off: ``torchrun ... -m dtlab.run --no-record script_job.py`` (the
  hooks still time each phase and count micro-batches; loss, LR and memory are written);
- dtlab.run, recording on: the same with per-parameter norms and fingerprints;
- dtlab.run, recording on, no engine (``--no-connect``): what each rank's ipyparallel
  engine (the thread a notebook connects to; idle here) adds to the line above.

Every rank writes its records into a job folder (under a temporary folder here). Each run
reports the median of its per-step times after a warm-up (rank 0), and the spread over
repeats; ratios are median dtlab.run / median torchrun (1.05: 5% slower), with the range
of the per-repeat ratios, and the difference of the medians in ms: dtlab's cost per step
depends on the model (its parameters), not on the work per step, which ``--batch`` sets.
Targets (issue 38): within 5% recording, 1% without.
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
MODES = ("torchrun", "record off", "record on", "record on, no engine")


def run_once(mode: str, n: int, steps: int, tmp: Path, rep: int, batch: int) -> float:
    out = tmp / f"{mode.replace(' ', '-')}-{n}-{rep}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    if mode != "torchrun":
        folder = tmp / f"job-{mode.replace(' ', '-').replace(',', '')}-{n}-{rep}"
        cmd += ["-m", "dtlab.run", "--run-dir", str(folder)]
        cmd += ["--no-record"] if mode == "record off" else []
        cmd += ["--no-connect"] if mode.endswith("no engine") else []
    cmd += [str(SCRIPT), "--steps", str(steps), "--batch", str(batch), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} at N={n} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())["median_ms"]


def measure(n: int, repeats: int, steps: int, batch: int) -> dict:
    got: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(repeats):
            for mode in MODES:
                got[mode].append(run_once(mode, n, steps, Path(tmp), rep, batch))
            print(
                f"  N={n} repeat {rep + 1}: "
                + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in got.items()),
                flush=True,
            )
    base = got["torchrun"]
    result: dict = {"ranks": n, "steps": steps, "batch": batch, "ms": got}
    for mode in MODES[1:]:
        ratios = [d / t for d, t in zip(got[mode], base, strict=True)]
        result[mode] = {
            "ratio": statistics.median(got[mode]) / statistics.median(base),
            "ratio_range": (min(ratios), max(ratios)),
            "extra_ms": statistics.median(got[mode]) - statistics.median(base),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="token windows per step and rank")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [measure(n, args.repeats, args.steps, args.batch) for n in args.ranks]
    print(
        "\n| N | "
        + " | ".join(f"{m} ms" for m in MODES)
        + " | "
        + " | ".join(f"{m} / torchrun" for m in MODES[1:])
        + " |"
    )
    print("|---" * (2 * len(MODES)) + "|")
    for r in results:

        def cell(v):
            return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

        def ratio(mode, r=r):
            lo, hi = r[mode]["ratio_range"]
            return f"{r[mode]['ratio']:.3f} ({lo:.2f}-{hi:.2f}), {r[mode]['extra_ms']:+.1f} ms"

        ms = r["ms"]
        cells = [cell(ms[m]) for m in MODES] + [ratio(m) for m in MODES[1:]]
        print(f"| {r['ranks']} | " + " | ".join(cells) + " |")
    print(
        f"\nbatch {args.batch}; median ms per step (range over repeats); ratios: median / "
        "median torchrun (range of the per-repeat ratios), then the median's difference in ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

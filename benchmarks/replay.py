"""Replay speed: steps re-run by ``dt.replay`` against the same steps of the original run.

    python benchmarks/replay.py                    # 4 ranks, 40 replayed steps, 3 replays
    python benchmarks/replay.py --ranks 8 --steps 100

Launches a dtlab session, attaches the demo job (with dropout, so steps draw from the
RNGs a replay must restore), runs --warmup steps, takes a checkpoint, runs --steps more
(the original), then replays those steps --repeats times. Each replay is timed whole
(save where the job is, load the checkpoint, run, load back) and per step: the median
step time of the replayed steps against the median of the same steps in the original run,
as the ranks measured them. Every replay must be identical to the original (it says so).
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


def measure(args: argparse.Namespace) -> dict:
    session = dtlab.launch(args.ranks, progress=lambda *a: None)
    try:
        session.checkpoint_root = Path(tempfile.mkdtemp(prefix="dtlab-replay-bench-"))
        demo.attach(session, dropout=0.1)
        session.step(args.warmup)
        session.checkpoint()
        session.step(args.steps)
        first, last = args.warmup + 1, args.warmup + args.steps
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = session.replay(first, last)
            wall = time.perf_counter() - start
            runs.append(
                {
                    "wall_s": wall,
                    "original_step_s": result.original_step_s,
                    "replay_step_s": result.replay_step_s,
                    "identical": result.identical,
                }
            )
        return {"ranks": args.ranks, "steps": args.steps, "runs": runs}
    finally:
        session.shutdown()


def report(result: dict) -> str:
    runs = result["runs"]
    original = statistics.median(r["original_step_s"] for r in runs)
    replay = statistics.median(r["replay_step_s"] for r in runs)
    wall = statistics.median(r["wall_s"] for r in runs)
    fixed = wall - result["steps"] * replay
    return "\n".join(
        [
            "| | original | replay | ratio |",
            "|---|---|---|---|",
            f"| median step (ms) | {original * 1e3:.1f} | {replay * 1e3:.1f} "
            f"| {replay / original:.2f}x |",
            f"| {result['steps']} steps, whole replay (s) | {result['steps'] * original:.2f} "
            f"| {wall:.2f} | {wall / (result['steps'] * original):.2f}x |",
            "",
            f"- {result['ranks']} ranks, demo job with dropout; medians of {len(runs)} replays; "
            f"every replay identical to the original: {all(r['identical'] for r in runs)}.",
            f"- fixed cost of one replay (save where the job is, two loads, control): "
            f"{fixed:.2f} s.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the checkpoint")
    parser.add_argument("--steps", type=int, default=40, help="steps replayed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="where to write results (default benchmarks/results/)")
    args = parser.parse_args()
    result = measure(args)
    print(report(result))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or HERE.parent / "results" / f"replay-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

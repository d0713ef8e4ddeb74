"""Faults made on purpose on live ranks: time to detect, what the report said, time to
recover (``dt.restart`` from the latest checkpoint).

    python benchmarks/recovery.py [--ranks 4]

For each fault: attach the demo job, take a checkpoint, inject the fault, run until dtlab
reports it (the clock runs from the call to the error), then restart from the checkpoint
and take one step (the clock runs from the restart call to that step's end).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

import dtlab  # noqa: E402
from dtlab import demo  # noqa: E402
from dtlab.control.errors import RankError  # noqa: E402

# name -> (ranks, code injected, how the fault is met: "step" or a cell's source)
FAULTS = {
    "kill -9 mid-step": ([2], "dtlab.inject.kill_at(step=4)", "step"),
    "exception in one rank's forward": ([1], "dtlab.inject.raise_at(step=4)", "step"),
    "rank sleeps forever in its step": ([1], "dtlab.inject.hang_at(step=4)", "step"),
    "rank skips a DDP all-reduce": ([3], "dtlab.inject.hang_at(step=4, how='skip_sync')", "step"),
    "rank skips an all_reduce in a cell": (
        [],
        "",
        "t = torch.ones(3)\nif rank != 3:\n    dist.all_reduce(t)",
    ),
    "mismatched all_reduce shapes in a cell": (
        [],
        "",
        "dist.all_reduce(torch.ones(5 if rank == 1 else 3))",
    ),
}


def measure(session, name: str, timeout: float) -> dict:
    ranks, code, how = FAULTS[name]
    demo.attach(session, dropout=0.1, num_samples=512)
    session.step(2)
    session.checkpoint()
    if code:
        session.execute(code, ranks=ranks)
    start = time.perf_counter()
    try:
        if how == "step":
            session.step(10, timeout=timeout)
        else:
            session.execute(how, timeout=timeout)
        said = "NOT DETECTED"
    except RankError as e:
        said = "; ".join(line for line in str(e).splitlines()[:3])
    detect = time.perf_counter() - start
    start = time.perf_counter()
    session.restart("latest")
    session.step(1)
    return {
        "fault": name,
        "detect_s": detect,
        "report": said,
        "recover_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=5.0, help="run/cell timeout, s")
    parser.add_argument("--json", help="where to write results (default benchmarks/results/)")
    args = parser.parse_args()
    session = dtlab.launch(args.ranks, progress=lambda *a: None)
    rows = []
    try:
        session.checkpoint_root = Path(tempfile.mkdtemp(prefix="dtlab-recovery-bench-"))
        for name in FAULTS:
            rows.append(measure(session, name, args.timeout))
            print(
                f"{name}: detected in {rows[-1]['detect_s']:.1f} s, recovered in "
                f"{rows[-1]['recover_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        session.shutdown()
    print("| fault | time to detect | what the report said | time to recover |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['detect_s']:.1f} s | {r['report']} | {r['recover_s']:.1f} s |")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or HERE.parent / "results" / f"recovery-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Pipeline plans and live re-partitioning, measured on the demo model.

    python benchmarks/partition.py                 # 4 ranks, 5 rounds of 20 steps per plan
    python benchmarks/partition.py --ranks 4 --steps 30 --rounds 5

1. Launch, attach the demo as a pipeline (a wider vocabulary than the default, so the
   embedding and the head hold many parameters but little compute: where counting
   parameters and measuring time disagree), run warm-up steps, profile every block.
2. Step time per plan: ``uniform``, ``parameters`` and ``measured``, each applied live,
   then --steps steps; round-robin over --rounds rounds so drift on a noisy machine hits
   every plan alike. Reported: the median wall time per step as the notebook sees it.
3. Moving boundaries: a live ``dt.repartition`` (+ the first step after it) against the
   baseline, tearing the ranks down and relaunching them with the new plan (+ attach + the
   first step). The baseline is a lower bound: it does not even carry the optimizer state
   over, which the live move does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

import dtlab  # noqa: E402
from dtlab import demo  # noqa: E402

CONFIG = {"vocab_size": 4096, "num_layers": 6, "moe_layer": 2}
PLANS = ("uniform", "parameters", "measured")


def quiet(*_):
    pass


def step_times(session, plans, steps: int, rounds: int) -> dict[str, list[float]]:
    """Per method, the step times of its plan; methods that chose the same plan share
    one set of measurements (timing it twice would only measure the machine's noise)."""
    distinct = list(dict.fromkeys(plans.values()))
    times: dict = {plan: [] for plan in distinct}
    for _ in range(rounds):
        for plan in distinct:
            session.repartition(plan)
            session.step(3)  # settle: the first steps after a move set up the schedule
            result = session.step(steps)
            times[plan].append(result.seconds / result.num_steps)
    return {name: times[plan] for name, plan in plans.items()}


def move_times(session, args, plans) -> tuple[list[float], list[float]]:
    live, relaunch = [], []
    a, b = plans["uniform"], plans["measured"]
    for i in range(args.moves):
        target = b if i % 2 == 0 else a
        start = time.perf_counter()
        session.repartition(target)
        session.step(1)
        live.append(time.perf_counter() - start)
    for i in range(args.moves):
        target = b if i % 2 == 0 else a
        start = time.perf_counter()
        session.shutdown()
        session = dtlab.launch(args.ranks, progress=quiet)
        demo.attach_pipeline(
            session, plan=list(target.bounds), microbatches=args.microbatches, **CONFIG
        )
        session.step(1)
        relaunch.append(time.perf_counter() - start)
    session.shutdown()
    return live, relaunch


def measure(args: argparse.Namespace) -> dict:
    session = dtlab.launch(args.ranks, progress=quiet)
    try:
        demo.attach_pipeline(session, plan="uniform", microbatches=args.microbatches, **CONFIG)
        session.step(args.warmup)
        session.profile_blocks(repeats=5)
        plans = {name: session.plan(name) for name in PLANS}
        times = step_times(session, plans, args.steps, args.rounds)
    except BaseException:
        session.shutdown()
        raise
    live, relaunch = move_times(session, args, plans)
    return {
        "ranks": args.ranks,
        "config": CONFIG,
        "microbatches": args.microbatches,
        "plans": {n: p.describe().replace(" | ", "; ") for n, p in plans.items()},
        "step_s": times,
        "live_move_s": live,
        "relaunch_s": relaunch,
    }


def report(result: dict) -> str:
    med = {name: statistics.median(t) for name, t in result["step_s"].items()}
    best_other = min(med["uniform"], med["parameters"])
    live, relaunch = (
        statistics.median(result["live_move_s"]),
        statistics.median(result["relaunch_s"]),
    )
    lines = ["| plan | stages | median step (ms) | vs measured |", "|---|---|---|---|"]
    for name in PLANS:
        lines.append(
            f"| {name} | {result['plans'][name]} | {med[name] * 1e3:.1f} "
            f"| {med[name] / med['measured']:.2f}x |"
        )
    lines += [
        "",
        f"- measured vs the best of the others: {med['measured'] / best_other:.2f}x "
        "(target <= 1.00x; below 1 is faster)",
        f"- moving boundaries: live {live:.2f} s, relaunch {relaunch:.2f} s: "
        f"{relaunch / live:.1f}x faster live (target >= 5x)",
        f"- {result['ranks']} ranks, demo {result['config']}, {result['microbatches']} "
        "micro-batches, GPipe; wall time per step as the notebook sees it",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per plan and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--moves", type=int, default=3, help="moves timed each way")
    parser.add_argument("--json", help="where to write results (default benchmarks/results/)")
    args = parser.parse_args()
    result = measure(args)
    print(report(result))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or HERE.parent / "results" / f"partition-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""The demo as a script: ``python -m dtlab.quickstart [N]`` (what ``./dev demo`` runs).

What dtlab is for, in one command, printed as the notebook cells that do each part:

1. launch N ranks (default 8) and print the rank table;
2. run one notebook cell on every rank (an all_reduce of the rank ids);
3. attach the demo job (a tiny MoE language model under DDP) and step it;
4. plant a fault: one rank (``--fault-rank``, default 5) edits one of its weights outside
   the optimizer, as a debugging line under ``if rank == ...`` would; step on;
5. run the doctor, print its verdict and the finding that names the rank, the step and
   the parameter where the replicas parted;
6. write the HTML report (``dt.report()``), print its path, and stop every rank.

notebooks/02_gradients_drift.ipynb walks the same fault in JupyterLab, with the fix.
"""

from __future__ import annotations

import argparse
import time

import dtlab
from dtlab.records import Finding
from dtlab.views.cells import collate_cell
from dtlab.views.reports import doctor_summary, run_summary
from dtlab.views.tables import launch_summary, rank_table, wrapped

CELL = """\
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(f"all_reduce of the rank ids = {t.item():g}")
"""
FAULT_PARAM = "blocks.1.attn.qkv.weight"
FAULT = f'dtlab.inject.perturb_param("{FAULT_PARAM}")  # +0.001, outside the optimizer'
STEPS_BEFORE, STEPS_AFTER = 3, 8  # 11 steps: enough for every check to look


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dtlab.quickstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("num_ranks", type=int, nargs="?", default=8)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--fault-rank", type=int, default=None, help="default: 5, or the last")
    args = parser.parse_args(argv)
    if args.num_ranks < 2:
        parser.error("the demo compares replicas: give it 2 ranks or more")
    if args.fault_rank is None:
        args.fault_rank = min(5, args.num_ranks - 1)
    if not 0 <= args.fault_rank < args.num_ranks:
        parser.error(f"--fault-rank {args.fault_rank}: ranks are 0-{args.num_ranks - 1}")
    return args


def _cell(line: str) -> None:
    print(f"\n>>> {line}")


def _drift(findings: list[Finding]) -> Finding | None:
    """The finding about the planted fault: parameters that differ across replicas."""
    return next((f for f in findings if f.kind == "divergence"), None)


def _session(dt, args: argparse.Namespace) -> None:
    _cell(f"%%dt\n{CELL}")
    print(collate_cell(dt.execute(CELL))[0])
    _cell("%dt_demo")
    infos = dtlab.demo.attach(dt)
    print(f"demo job attached on {len(infos)} ranks (a tiny MoE language model, DDP)")
    _cell(f"%dt_step {STEPS_BEFORE}")
    print(run_summary(dt.step(STEPS_BEFORE), dt.trace))
    _cell(f"%%dt --ranks {args.fault_rank}\n{FAULT}")
    dt.execute(FAULT, ranks=[args.fault_rank])
    print(f"planted: rank {args.fault_rank} edited {FAULT_PARAM} after step {STEPS_BEFORE}")
    _cell(f"%dt_step {STEPS_AFTER}")
    print(run_summary(dt.step(STEPS_AFTER), dt.trace))
    _cell("%dt_doctor")
    results = dt.checks()
    print(wrapped(doctor_summary(results)))
    found = _drift([f for r in results for f in r.findings])
    print()
    if found is None:
        print("the doctor did not find the planted fault")  # a bug: the demo test fails
    else:
        ranks = ", ".join(map(str, found.ranks))
        where = f"rank {ranks}, from step {found.step}, parameter {found.evidence['param']}"
        print(wrapped(f"the planted fault, as the doctor names it: {where}"))
        print(wrapped(f"cause and fix: {found.fix}"))
    _cell("dt.report()")
    print(f"report: {dt.report()}")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    start = time.monotonic()
    with dtlab.launch(args.num_ranks, backend=args.backend) as dt:
        print(launch_summary(dt, time.monotonic() - start))
        print(rank_table(dt.infos, dt.inconsistencies()))
        _session(dt, args)
        stop = time.monotonic()
    print(f"\nstopped {args.num_ranks} ranks in {time.monotonic() - stop:.2f} s")
    print(f"the demo took {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()

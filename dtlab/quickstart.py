"""The quick start as a script: ``python -m dtlab.quickstart [N]``.

Launches N ranks (default 8), prints the rank table, runs one notebook-style cell on every
rank (an all_reduce of the rank ids), shows each rank's state, and shuts everything down.
notebooks/01_quickstart.ipynb does the same in JupyterLab.
"""

from __future__ import annotations

import argparse
import time

import dtlab
from dtlab.views.cells import collate_cell
from dtlab.views.tables import launch_summary, rank_table, status_table

CELL = """\
t = torch.tensor([float(rank)])
dist.all_reduce(t)
print(f"all_reduce of the rank ids = {t.item():g}")
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dtlab.quickstart", description=__doc__)
    parser.add_argument("num_ranks", type=int, nargs="?", default=8)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    start = time.monotonic()
    with dtlab.launch(args.num_ranks, backend=args.backend) as dt:
        print(launch_summary(dt, time.monotonic() - start))
        print(rank_table(dt.infos, dt.inconsistencies()))
        print(f"\n%%dt\n{CELL}")
        print(collate_cell(dt.execute(CELL))[0])
        print(status_table(dt.status(), dt.infos, "%dt_status"))
        stop = time.monotonic()
    print(f"\nstopped {args.num_ranks} ranks in {time.monotonic() - stop:.2f} s")


if __name__ == "__main__":
    main()

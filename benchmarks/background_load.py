"""A busy machine on demand: a dtlab job of N ranks (default 8) stepping the demo until
SIGTERM or --seconds, then shut down. Run the test suite beside it to check that
it passes on a loaded machine, as people run it:

    .venv/bin/python benchmarks/background_load.py --ranks 8 &
    ./dev test; ./dev test
    kill %1        # SIGTERM: it stops after the step it is in and shuts its ranks down

Prints one line when it starts stepping and one when it stops (steps made, load average).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # ranks per core: the point here
    import dtlab
    from dtlab import demo
    from dtlab.views.progress import TextProgress

    stop = []  # SIGTERM: finish the step in flight, then shut down (dtlab keeps SIGINT
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # for pausing its runs)
    dt = dtlab.launch(args.ranks, progress=TextProgress(sys.stderr), force=True)
    steps, start = 0, time.monotonic()
    try:
        demo.attach(dt)
        print(f"stepping {args.ranks} ranks", flush=True)
        while not stop and (args.seconds is None or time.monotonic() - start < args.seconds):
            steps += dt.step(5).num_steps
    finally:
        dt.shutdown()
        took = time.monotonic() - start
        print(
            f"stopped after {steps} steps in {took:.0f} s; load average {os.getloadavg()}",
            flush=True,
        )


if __name__ == "__main__":
    main()

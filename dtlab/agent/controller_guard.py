"""The controller's guard: stops the ipyparallel controller that rank 0 of a ``dtlab.run``
job started, once rank 0 is gone, however it went (``kill -9`` included, which leaves no
time to stop it, and the controller outlives its parent).

    python -m dtlab.agent.controller_guard RANK0_PID PROFILE_DIR CLUSTER_ID

Rank 0 starts it beside the controller, in a session of its own (a signal to the job's
process group does not reach it before rank 0 is gone). It polls every ``POLL_S``: it
ends when the controller ends (rank 0 stopped it, as at every normal end), and stops the
controller with ipyparallel's own ``Cluster.stop_controller`` (from the cluster file the
controller's launcher wrote) when rank 0 is gone first. An idle process of a few MB.
"""

from __future__ import annotations

import sys
import time

import psutil

POLL_S = 0.5


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def guard(rank0_pid: int, profile_dir: str, cluster_id: str, poll_s: float = POLL_S) -> str:
    """Wait for rank 0 or the controller to end; -> what happened (for the log)."""
    import ipyparallel as ipp

    cluster = ipp.Cluster.from_file(profile_dir=profile_dir, cluster_id=cluster_id)
    controller = cluster.controller.pid if cluster.controller is not None else None
    if controller is None:
        return "no controller to guard"
    while alive(controller):
        if not alive(rank0_pid):
            cluster.stop_controller_sync()
            return f"rank 0 (pid {rank0_pid}) is gone: stopped its controller (pid {controller})"
        time.sleep(poll_s)
    return "the controller ended"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    said = guard(int(args[0]), args[1], args[2])
    if said.startswith("rank 0"):
        print(f"dtlab.run: {said}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

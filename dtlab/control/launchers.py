"""Which ipyparallel engine launcher each ``--launcher`` name means.

``local`` is ipyparallel's local launcher with one change: the N engines are forked from a
single process that has already imported torch (see :mod:`dtlab.control.forkserver`), which
is what makes an 8-rank launch on 2 cores faster than torchrun. ``mpi``, ``slurm`` and ``ssh``
are ipyparallel's own launchers, passed through unchanged.
"""

from __future__ import annotations

import sys

from ipyparallel.cluster.launcher import LocalEngineLauncher
from traitlets import Integer

# "local" is ours; the others are ipyparallel's `ipyparallel.engine_launchers` entry points
LAUNCHERS = ("local", "mpi", "slurm", "ssh")


class ForkingEngineSetLauncher(LocalEngineLauncher):
    """Launch a set of local engines as forks of one torch-loaded process.

    The set is one OS process to ipyparallel (the fork server); stopping or signalling it
    reaches every engine because the fork server forwards SIGTERM and SIGINT.
    """

    name = "dtlab-forkserver"
    n = Integer(1).tag(to_dict=True)

    def find_args(self):
        return [
            sys.executable,
            "-m",
            "dtlab.control.forkserver",
            "--num-engines",
            str(self.n),
            "--",
            *self.cluster_args,
            *self.engine_args,
        ]

    def start(self, n):
        self.n = n
        return super().start()


def engine_launcher_class(name: str):
    """The class or ipyparallel name to pass as ``Cluster(engine_launcher_class=...)``
    (``name`` is one of LAUNCHERS, checked by LaunchConfig)."""
    return ForkingEngineSetLauncher if name == "local" else name

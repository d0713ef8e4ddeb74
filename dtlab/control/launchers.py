"""Which ipyparallel engine launcher each ``--launcher`` name means.

``local`` is ipyparallel's local launcher with one change: the N engines are forked from a
single process that has already imported torch (see :mod:`dtlab.control.forkserver`), which
is what makes an 8-rank launch on 2 cores faster than torchrun. ``mpi``, ``slurm`` and ``ssh``
are ipyparallel's own launchers, passed through unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys

from ipyparallel.cluster.launcher import LocalEngineLauncher
from traitlets import Integer

from dtlab.control.errors import OptionError
from dtlab.records.words import Word


class Launcher(Word):
    """``--launcher``: ``local`` is ours; the others are ipyparallel's
    ``ipyparallel.engine_launchers`` entry points, passed through."""

    LOCAL = "local"
    MPI = "mpi"
    SLURM = "slurm"
    SSH = "ssh"


LAUNCHERS = tuple(Launcher)


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
    return ForkingEngineSetLauncher if name == Launcher.LOCAL else name


def launcher_problem(name: str) -> str | None:
    """What this machine lacks to use launcher ``name``, with the fix; None if nothing."""
    if name == Launcher.MPI:
        if shutil.which("mpiexec") is None:
            return (
                "the mpi launcher needs mpiexec on PATH: install an MPI (Debian: apt-get "
                "install openmpi-bin) or load your cluster's MPI module"
            )
        if importlib.util.find_spec("mpi4py") is None:
            return (
                "the mpi launcher needs mpi4py where the engines run (ipyparallel numbers "
                "MPI engines by their MPI rank): pip install 'dtlab[mpi]'"
            )
    if name == Launcher.SLURM and shutil.which("sbatch") is None:
        return "the slurm launcher needs sbatch on PATH (run on a Slurm login node)"
    if name == Launcher.SSH and shutil.which("ssh") is None:
        return "the ssh launcher needs an ssh client on PATH"
    return None


def mpi_defaults() -> list[str]:
    """mpiexec arguments dtlab adds (``launcher_config`` can replace them): Open MPI refuses
    more ranks than cores without --oversubscribe, and root without --allow-run-as-root."""
    if not _is_open_mpi():
        return []
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


@functools.cache
def _is_open_mpi() -> bool:
    try:
        out = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr  # "mpiexec (OpenRTE) 4.1.4 ... open-mpi.org" (v4)
    return any(mark in text for mark in ("Open MPI", "OpenRTE", "open-mpi.org"))


def parse_hosts(text: str) -> dict[str, int]:
    """``"node1:4,node2:4"`` (as mpirun -H) -> ``{"node1": 4, "node2": 4}``; a host without
    a count gets one engine. Ports and users go in ~/.ssh/config (``:`` is the count)."""
    hosts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, count = item.partition(":")
        if not host or (count and not (count.isdigit() and int(count) >= 1)):
            raise OptionError(f"bad --hosts item {item!r}: expected HOST or HOST:N, e.g. node1:4")
        hosts[host] = hosts.get(host, 0) + (int(count) if count else 1)
    if not hosts:
        raise OptionError("--hosts is empty: expected e.g. node1:4,node2:4")
    return hosts


def ssh_config(hosts: dict[str, int], *, python: str | None = None) -> dict:
    """``launcher_config`` for ipyparallel's SSH launcher: ``hosts`` ({host: engines});
    ``python``: the interpreter on the hosts (default: this one's path, for a shared
    filesystem or identical images)."""
    return {
        "SSHEngineSetLauncher": {"engines": dict(hosts)},
        "SSHEngineLauncher": {"remote_python": python or sys.executable},
    }


SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{{cluster_id}}
#SBATCH --ntasks={{n}}
#SBATCH --output={{output_file}}
{extra}srun {{program_and_args}}
"""


def slurm_config(partition: str | None = None, sbatch_args: tuple[str, ...] = ()) -> dict:
    """``launcher_config`` for ipyparallel's Slurm launcher: the partition and any other
    ``sbatch`` options (``--cpus-per-task=1``, ``--gpus-per-task=1``, ``--nodes=2``, ...) as
    ``#SBATCH`` lines of its batch script (a custom script gets no option added for it)."""
    lines = [f"#SBATCH --partition={partition}"] if partition else []
    for arg in sbatch_args:
        if not arg.startswith("-") or "\n" in arg:
            raise OptionError(
                f"bad --sbatch-arg {arg!r}: expected an sbatch option like --cpus-per-task=1"
            )
        lines.append(f"#SBATCH {arg}".replace("{", "{{").replace("}", "}}"))
    if not lines:
        return {}
    template = SLURM_TEMPLATE.format(extra="".join(line + "\n" for line in lines))
    return {"SlurmEngineSetLauncher": {"batch_template": template}}

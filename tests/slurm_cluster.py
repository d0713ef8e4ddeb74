"""A real single-node Slurm cluster on this machine, for tests (Debian's slurm-wlm + munge).

Everything lives in one temporary folder (config, munge key and socket, state, logs) and
runs in the foreground as child processes, stopped by pid: munged, slurmctld, slurmd.
``SLURM_CONF`` points sbatch/squeue/scancel at it. Needs root (Slurm's daemons and munged
run as root here) and the Debian packages; :func:`missing` says what is not there.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")
PARTITION = "debug"
CPUS = 8  # more than this machine's cores: enough slots for 8 one-CPU tasks


def missing() -> str | None:
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"no {', '.join(absent)}: apt-get install slurm-wlm munge (.ci/run does)"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


CONFIG = """ClusterName=dtlabtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}

    def start(self, timeout_s: float = 60) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        key = f / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {"ctld_port": _free_port(), "d_port": _free_port()}
        (f / "slurm.conf").write_text(
            CONFIG.format(node=self.node, folder=f, cpus=CPUS, partition=PARTITION, **ports)
        )
        munge = [
            _binary("munged"),
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={f}/munge.socket",
            f"--pid-file={f}/munged.pid",
            f"--log-file={f}/munged.log",
            f"--seed-file={f}/munge.seed",
        ]
        self._spawn(munge, "munged")
        self._wait(lambda: (f / "munge.socket").exists(), 10, "munged did not start")
        self._spawn([_binary("slurmctld"), "-D", "-i", "-f", str(f / "slurm.conf")], "slurmctld")
        self._spawn(
            [_binary("slurmd"), "-D", "-N", self.node, "-f", str(f / "slurm.conf")], "slurmd"
        )
        self._wait(self._idle, timeout_s, "the Slurm node did not become idle")

    def _spawn(self, command: list[str], name: str) -> None:
        log = open(self.folder / f"{name}.out", "w")  # noqa: SIM115 - the process keeps it
        self.procs.append(
            subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        )

    def _idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env, timeout=10
        )
        return out.stdout.strip() in ("idle", "mix", "alloc")

    def _wait(self, probe, timeout_s: float, message: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{message}: {proc.args[0]} exited; see {self.folder}")
            try:
                if probe():
                    return
            except (OSError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{message} within {timeout_s:g} s; logs in {self.folder}")

    def jobs(self) -> list[str]:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T"],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=10,
        )
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self) -> list[int]:
        """Cancel what is still queued or running and let slurmd end its job steps, then
        stop the daemons; job-step processes left after that (slurmstepd detaches from
        slurmd) are found by what they hold of this cluster, killed by pid, and returned."""
        if self.procs and self.procs[-1].poll() is None:
            subprocess.run(
                ["scancel", "--full", f"--partition={PARTITION}"],
                env=self.env,
                capture_output=True,
                timeout=30,
            )
            try:
                self._wait(lambda: not self.jobs(), 30, "jobs did not end")
            except (TimeoutError, RuntimeError):
                pass  # the leftovers are killed below
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        killed = self._leftovers()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed  # empty when every job step ended by itself

    def _leftovers(self) -> list[int]:
        """Job-step processes of this cluster: they hold its spool folder, or carry its
        SLURM_CONF (srun), and their descendants."""
        import psutil

        mine = []
        spool, conf = str(self.folder), self.env["SLURM_CONF"]
        for proc in psutil.process_iter():
            try:
                held = [c.laddr for c in proc.net_connections("unix")]
                if any(isinstance(a, str) and a.startswith(spool) for a in held) or (
                    proc.environ().get("SLURM_CONF") == conf
                ):
                    mine += [proc.pid] + [c.pid for c in proc.children(recursive=True)]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return sorted(set(mine) - {os.getpid()})

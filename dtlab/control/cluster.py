"""The ipyparallel cluster under a session: start it, wait for its engines, stop it cleanly.

Stages of ``start``:
1. configure an ``ipyparallel.Cluster`` with the launcher that ``--launcher`` names;
2. for ``local``, start the engines *before* the controller, so the fork server imports
   torch while the controller boots (the engines wait for its connection file);
3. connect a client and wait until N engines have registered, reporting k/N, and failing
   fast if the launcher or the controller process exits.

``stop`` stops the engines first (their nannies can still tell the controller), then the
controller, then makes sure no process it started is left (by pid).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipyparallel as ipp
import psutil

from dtlab.control.calls import held_interrupts
from dtlab.control.config import LaunchConfig
from dtlab.control.errors import DtlabError, LaunchError
from dtlab.control.forkserver import ENGINE_LOGS_ENV, EXIT_LOG_ENV, engine_log
from dtlab.control.launchers import (
    Launcher,
    engine_launcher_class,
    launcher_problem,
    mpi_defaults,
)
from dtlab.control.network import listen_address
from dtlab.control.rankmap import threads_per_rank

# Registration waits for a heartbeat tick: 3 s by default, ~1.5 s at 250 ms (docs/design.md).
HEARTBEAT_MS = 250
# The nanny reports a local engine's death at once; the heartbeat is for a lost host, and
# 120 missed beats (30 s) keep a merely slow engine on a loaded machine from being dropped.
HEARTBEAT_MISSES = 120
STOP_GRACE_S = 3.0
ENGINE_EXIT_WAIT_S = 3.0  # engines asked to exit (mpi, slurm) before the launcher stops
QUERY_TIMEOUT_S = 10.0
CHECK_EVERY_S = 0.5

Progress = Callable[[str, int, int], None]


def exit_log_path(cluster: ipp.Cluster) -> str:
    """Where the fork server of a local cluster notes each engine's exit status (the
    cluster's profile directory, owner-only, like its connection files)."""
    return os.path.join(cluster.profile_dir, "security", f"{cluster.cluster_id}-exits.jsonl")


def engine_logs_path(cluster: ipp.Cluster) -> str:
    """The folder where a local cluster's engines write their output, one file each
    (:func:`dtlab.control.forkserver.engine_log`): the profile's log folder, owner-only."""
    return os.path.join(cluster.profile_dir, "log", f"{cluster.cluster_id}-engines")


def _local_threads(config: LaunchConfig) -> int:
    return threads_per_rank(
        config.threads, len(psutil.Process().cpu_affinity() or [0]), config.num_ranks
    )


_CLUSTER_ID = re.compile(r"dtlab-(\d+)-[0-9a-f]{4}")
KEEP_LOGS = 20  # dtlab clusters whose logs a profile keeps (the newest that are not running)


def prune_logs(profile_dir: str, keep: int = KEEP_LOGS) -> int:
    """Remove the logs (``<profile>/log``: the controller's, the fork server's, each
    engine's) of the dtlab clusters of this profile but the newest ``keep``, as a launch
    starts: every launch leaves a few files and they would pile up for good. A cluster
    whose cluster file is still there (running, or its notebook was killed) keeps its
    logs. -> how many files and folders went."""
    log = Path(profile_dir) / "log"
    if not log.is_dir():
        return 0
    by_id: dict[str, list[Path]] = {}
    for path in log.iterdir():
        found = _CLUSTER_ID.search(path.name)
        if found:
            by_id.setdefault(found.group(0), []).append(path)
    security = Path(profile_dir) / "security"
    done = [cid for cid in by_id if not (security / f"cluster-{cid}.json").exists()]
    done.sort(key=lambda cid: (int(cid.split("-")[1]), cid))
    removed = 0
    for cid in done[: max(0, len(done) - keep)]:
        for path in by_id[cid]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
    return removed


def make_cluster(config: LaunchConfig) -> ipp.Cluster:
    local = config.launcher == Launcher.LOCAL
    cluster = ipp.Cluster(
        n=config.num_ranks,
        engine_launcher_class=engine_launcher_class(config.launcher),
        profile=config.profile,
        cluster_id=f"dtlab-{int(time.time())}-{secrets.token_hex(2)}",
        controller_args=[
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
        ],
        # local engines read the connection file from the shared profile dir, so they can
        # start before the controller; remote ones get it through their environment
        send_engines_connection_env=not local,
        # loopback unless --listen says where (message signing stays on either way)
        controller_ip=listen_address(config.listen),
        delay=0,
        log_level=30,
    )
    cluster.log = cluster_logger(cluster)
    try:
        prune_logs(cluster.profile_dir)
    except OSError:
        pass  # logs of old clusters left as they are: never a reason not to launch
    env = dict(config.env)
    if local:
        # ipyparallel engines do not set it (torchrun does): without it torch takes every
        # core in every rank, and 8 ranks on 2 cores step ~15x slower (docs/design.md)
        env.setdefault("OMP_NUM_THREADS", str(_local_threads(config)))
        env[EXIT_LOG_ENV] = exit_log_path(cluster)  # how engines died
        os.makedirs(engine_logs_path(cluster), mode=0o700, exist_ok=True)
        env[ENGINE_LOGS_ENV] = engine_logs_path(cluster)  # what they said last
    cluster.config.EngineLauncher.environment = env
    if config.launcher == Launcher.MPI:
        cluster.config.MPIEngineSetLauncher.mpi_args = mpi_defaults()
    if config.launcher == Launcher.SLURM:  # the batch script beside the job's log, not in the cwd
        log_dir = os.path.join(cluster.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        script = os.path.join(log_dir, f"{cluster.cluster_id}-engines.sbatch")
        cluster.config.SlurmEngineSetLauncher.batch_file_name = script
    for section, values in config.launcher_config.items():
        for key, value in values.items():
            setattr(cluster.config[section], key, value)
    return cluster


def cluster_log_path(cluster: ipp.Cluster) -> str:
    return os.path.join(cluster.profile_dir, "log", f"{cluster.cluster_id}.log")


def cluster_logger(cluster: ipp.Cluster) -> logging.Logger:
    """ipyparallel's own log for this cluster, in a file (``cluster_log_path``): its
    default handler prints, at WARNING, every line a stopped engine set wrote (tracebacks
    of all ranks, torch's warnings) into the notebook, where dtlab says what happened."""
    os.makedirs(os.path.dirname(cluster_log_path(cluster)), exist_ok=True)
    logger = logging.getLogger(f"dtlab.ipyparallel.{cluster.cluster_id}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.FileHandler(cluster_log_path(cluster), delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    return logger


class EngineCluster:
    """N ipyparallel engines plus their controller, and every pid they own locally."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.cluster = make_cluster(config)
        self.client: ipp.Client | None = None
        # processes seen so far: a controller killed outright orphans its schedulers,
        # which can then no longer be found as its descendants
        self._seen: dict[int, psutil.Process] = {}
        self._most_engines: dict[int, int] = {}  # fork server pid -> most engines seen alive

    @property
    def cluster_id(self) -> str:
        return self.cluster.cluster_id

    def start(self, progress: Progress) -> None:
        try:
            self._start(progress)
        except LaunchError as e:
            self.stop()
            raise LaunchError(f"{e}\n(everything this launch started was stopped)") from None
        except BaseException:
            self.stop()
            raise

    def _start(self, progress: Progress) -> None:
        n = self.config.num_ranks
        if problem := launcher_problem(self.config.launcher):
            raise LaunchError(problem)
        progress("engines registered", 0, n)
        if self.config.launcher == Launcher.LOCAL:
            self.cluster.start_engines_sync()
            self.cluster.start_controller_sync()
        else:
            self.cluster.start_controller_sync()
            self.cluster.start_engines_sync()
        deadline = time.monotonic() + self.config.timeout_s
        self.client = self.cluster.connect_client_sync()
        seen = -1
        checked = time.monotonic()
        while len(self.client.ids) < n:
            if len(self.client.ids) != seen:
                seen = len(self.client.ids)
                progress("engines registered", seen, n)
            if time.monotonic() - checked > CHECK_EVERY_S:
                checked = time.monotonic()
                self._check_alive()
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"only {len(self.client.ids)} of {n} engines registered within "
                    f"{self.config.timeout_s:g} s ({self.config.launcher} launcher). "
                    "Raise --timeout if the engines are just slow "
                    f"(a batch queue){self._reach_hint()}, else read the launcher "
                    f"output:\n{self.output_tail()}"
                )
            time.sleep(0.02)
        progress("engines registered", n, n)
        self.local_processes()  # remember the controller's and launchers' processes

    def _check_alive(self) -> None:
        """Fail fast when the controller or an engine launcher process has exited, or (local
        launcher) an engine died before registering.

        Asks the OS, not ``launcher.state``: the launchers' stop callbacks run on the event
        loop of ipyparallel's sync wrappers, which is not running between calls.
        """
        launchers = [("controller", self.cluster.controller)] + [
            ("engine launcher", es) for es in self.cluster.engines.values()
        ]
        for name, launcher in launchers:
            process = getattr(launcher, "process", None)
            if process is not None and not running([process.pid]):
                raise LaunchError(
                    f"the {name} exited while engines were registering. "
                    f"The end of its output:\n{self.output_tail([launcher])}"
                )
        lost = self._engines_lost()
        if lost:
            raise LaunchError(
                f"{lost} engine process(es) exited before registering. "
                f"The end of the launcher's output:\n{self.output_tail()}"
            )

    def _engines_lost(self) -> int:
        """Local launcher: how many forked engines have died. The fork server's children
        are its engines, and the nannies of engines that died (which lead their own
        session, so they are told apart by that)."""
        if self.config.launcher != Launcher.LOCAL:
            return 0
        lost = 0
        for engine_set in self.cluster.engines.values():
            try:
                children = psutil.Process(engine_set.pid).children()
            except psutil.NoSuchProcess:
                continue
            alive = sum(1 for c in children if _alive(c) and not _session_leader(c.pid))
            most = self._most_engines[engine_set.pid] = max(
                alive, self._most_engines.get(engine_set.pid, 0)
            )
            lost += most - alive
        return lost

    def queue_status(self, timeout: float = QUERY_TIMEOUT_S) -> dict:
        """``Client.queue_status()`` with a time limit; ipyparallel 9 waits without one,
        which would hang the notebook on a stalled controller."""
        client = self.client
        assert client is not None  # asked by a session, connected since start()
        future = client._send(
            client._query_stream, "queue_request", content={"targets": None, "verbose": False}
        )
        done, _ = concurrent.futures.wait([future], timeout=timeout)
        if not done:
            raise DtlabError(
                f"the ipyparallel controller did not answer within {timeout:g} s; "
                f"run %dt_launch {self.config.num_ranks} --restart"
            )
        content = dict(future.result()["content"])
        if content.pop("status") != "ok":
            raise client._unwrap_exception(content)
        return ipp.util.int_keys(content)

    def controller_exited(self) -> bool:
        """True when the (always local) controller process is gone: nothing would answer."""
        process = getattr(self.cluster.controller, "process", None)
        return process is not None and not running([process.pid])

    def _reach_hint(self) -> str:
        if self.config.launcher == Launcher.LOCAL or self.config.listen:
            return ""
        return (
            "; engines on other hosts cannot reach a controller on 127.0.0.1: launch "
            "with --listen <interface or address> (e.g. --listen ib0)"
        )

    def job_ids(self) -> list[str]:
        """The batch jobs holding the engines (Slurm's job id), empty for other launchers."""
        sets = self.cluster.engines.values()
        return [str(s.job_id) for s in sets if getattr(s, "job_id", "")]

    def output_tail(self, launchers=None, lines: int = 15) -> str:
        """The last lines each launcher's process wrote (engines first)."""
        if launchers is None:
            launchers = [*self.cluster.engines.values(), self.cluster.controller]
        parts: list[str] = []
        for launcher in launchers:
            if launcher is not None:
                text = launcher.get_output() or ""
                parts.extend(text.splitlines()[-lines:])
        return "\n".join(parts) or "(no output)"

    def local_processes(self) -> list[psutil.Process]:
        """Controller, engine launchers and all their descendants on this host, including
        those seen earlier that still run (psutil.Process objects notice a reused pid)."""
        roots = [self.cluster.controller, *self.cluster.engines.values()]
        for launcher in roots:
            pid = getattr(launcher, "pid", -1) if launcher is not None else -1
            if pid > 0:
                try:
                    proc = psutil.Process(pid)
                    for p in [proc, *proc.children(recursive=True)]:
                        self._seen.setdefault(p.pid, p)
                except psutil.NoSuchProcess:
                    pass
        return [p for p in self._seen.values() if _alive(p)]

    def local_pids(self) -> list[int]:
        return sorted(p.pid for p in self.local_processes())

    def stop(self) -> None:
        """Stop engines, then the controller; SIGKILL whatever is left. Idempotent, and
        never cut short: a Ctrl-C while it runs (a second press during an interrupted
        launch, say) is held until everything is gone, then raised."""
        with held_interrupts():
            self._stop()

    def _stop(self) -> None:
        procs = self.local_processes()
        if self.client is not None:
            if self.config.launcher != Launcher.LOCAL:
                self._ask_engines_to_exit()
            self.client.close()
            self.client = None
        for step in (self.cluster.stop_engines_sync, self.cluster.stop_controller_sync):
            try:
                step()
            except Exception:  # a launcher that already died: its processes are reaped below
                pass
        _reap(procs)
        self._remove_logs()
        logger = self.cluster.log
        for handler in getattr(logger, "handlers", ()):  # the log file stays; its fd goes
            handler.close()

    def _ask_engines_to_exit(self) -> None:
        """Engines that exit by themselves end mpiexec (or the Slurm job) at once; the
        launcher's own stop interrupts them, which a kernel survives, and kills after 5 s."""
        try:
            # block=True waits for the engines' replies, without a limit: from a thread,
            # so that a dead controller or a stuck engine cannot hold the shutdown
            asking = threading.Thread(target=self._shutdown_request, daemon=True)
            asking.start()
            deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
            asking.join(ENGINE_EXIT_WAIT_S)
            processes: list[Any] = [
                getattr(s, "process", None) for s in self.cluster.engines.values()
            ]
            processes = [p for p in processes if p is not None and hasattr(p, "poll")]
            while time.monotonic() < deadline and any(p.poll() is None for p in processes):
                time.sleep(0.05)
        except Exception:  # dead engines or controller: the launcher's stop still runs
            pass

    def _shutdown_request(self) -> None:
        try:
            client = self.client
            if client is not None:  # (None: stop() is past it already)
                client.shutdown(targets="all", hub=False, block=True)
        except Exception:  # engines already gone: nothing to ask
            pass

    def _remove_logs(self) -> None:
        """The exit log, and the logs of engines that did not die (those of the
        dead stay, named in the errors that reported them)."""
        died = set(self.exits())  # (engines stopped with the cluster are not noted)
        try:
            os.unlink(exit_log_path(self.cluster))
        except OSError:
            pass
        folder = engine_logs_path(self.cluster)
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for name in names:
            pid = name.removeprefix("engine-").removesuffix(".log")
            if not (pid.isdigit() and int(pid) in died):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass
        try:
            os.rmdir(folder)  # (only once empty)
        except OSError:
            pass

    def engine_log(self, pid: int) -> str | None:
        """The file engine ``pid`` wrote its output to (local launcher), if there is one."""
        if self.config.launcher != Launcher.LOCAL:
            return None
        path = engine_log(engine_logs_path(self.cluster), pid)
        return path if os.path.isfile(path) else None

    def exits(self) -> dict[int, int]:
        """``{pid: exit code}`` of engines that exited on their own (local launcher; a
        negative code is the signal that ended it)."""
        import json

        try:
            with open(exit_log_path(self.cluster)) as log:
                return {e["pid"]: e["code"] for e in map(json.loads, log) if "pid" in e}
        except (OSError, ValueError):
            return {}


def _session_leader(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def _alive(proc: psutil.Process) -> bool:
    """Running, and not a zombie (a zombie has finished running)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running(pids: list[int]) -> list[int]:
    """The pids that are still running processes."""
    alive = []
    for pid in pids:
        try:
            if _alive(psutil.Process(pid)):
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _reap(procs: list[psutil.Process]) -> None:
    for proc in _wait_gone(procs, STOP_GRACE_S):
        try:
            proc.send_signal(signal.SIGKILL)  # psutil refuses if the pid was reused
        except psutil.NoSuchProcess:
            pass
    _wait_gone(procs, STOP_GRACE_S)

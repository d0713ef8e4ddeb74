"""What a launch asks for, validated where it is made."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from dtlab.control.errors import OptionError
from dtlab.control.launchers import (
    LAUNCHERS,
    Launcher,
    parse_hosts,
    slurm_config,
    ssh_config,
)
from dtlab.control.network import is_loopback, listen_address
from dtlab.control.options import option

LOCAL_NAMES = {"localhost", "127.0.0.1"}

BACKENDS = ("auto", "gloo", "nccl")

MAX_RANKS_PER_CORE = 16  # beyond this a local launch is refused unless forced


def checked_timeout(value, what: str = "timeout") -> float | None:
    """None (no limit) or a positive, finite number of seconds: every timeout dtlab takes,
    from a magic or from Python, is checked here (0 or -1 would time out at once, and
    interrupt ranks that were doing nothing wrong)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise OptionError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def seconds(text: str) -> float:
    """A flag's text -> a positive number of seconds: the type of every timeout flag."""
    try:
        value: object = float(text)
    except ValueError:
        value = text  # refused below, with what a timeout must be
    checked = checked_timeout(value, "a timeout")
    assert checked is not None  # (a value was given: None only for no value)
    return checked


def parse_env(items: Iterable[str]) -> dict[str, str]:
    """``["NCCL_DEBUG=INFO", "A=b=c"]`` -> ``{"NCCL_DEBUG": "INFO", "A": "b=c"}``."""
    env = {}
    for item in [items] if isinstance(items, str) else items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise OptionError(f"bad --env item {item!r}: expected KEY=VALUE, e.g. NCCL_DEBUG=INFO")
        env[key] = value
    return env


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What ``%dt_launch`` and ``dtlab.launch`` take, declared once: each field is a
    keyword of ``dtlab.launch`` and, unless Python only, a flag of the magic
    (``control/options.py``). ``launch_config`` makes the LaunchConfig, which checks them."""

    num_ranks: int = option(
        help="number of ranks (one ipyparallel engine each)", positional=True, type=int
    )
    backend: str = option(
        "auto", help=f"one of {', '.join(BACKENDS)}; auto picks nccl when every rank has a GPU"
    )
    launcher: str = option(
        "local", help=f"ipyparallel engine launcher: one of {', '.join(LAUNCHERS)}"
    )
    timeout: float = option(
        120.0,
        help="seconds for engines to register and ranks to join (default 120)",
        type=seconds,
    )
    threads: int | None = option(
        None, help="torch threads per rank (default: the host's cores / ranks on it)", type=int
    )
    env: Mapping[str, str] | Iterable[str] | None = option(
        None,
        help="environment variables for every rank, e.g. --env NCCL_DEBUG=INFO (from "
        "Python: a dict, or KEY=VALUE strings)",
        nargs="+",
        action="extend",
        metavar="KEY=VAL",
    )
    port: int = option(
        0, help="rendezvous port on rank 0's host (default: any free port)", type=int
    )
    pg_timeout: float = option(
        600.0,
        help="process-group timeout in seconds: frees ranks stuck in a collective",
        type=seconds,
    )
    hosts: str | Mapping[str, int] | None = option(
        None,
        help="ssh launcher: hosts and engines per host, e.g. node1:4,node2:4 (from Python "
        "also {'node1': 4, ...})",
    )
    partition: str | None = option(None, help="slurm launcher: the partition to submit to")
    sbatch_args: Iterable[str] = option(
        (),
        help="slurm launcher: an sbatch option for the engines' job, e.g. "
        "--sbatch-arg=--cpus-per-task=1 (repeatable)",
        flag="--sbatch-arg",
        action="append",
        metavar="OPTION",
    )
    listen: str = option(
        "", help="interface or address to listen on for ranks on other hosts (eth0, ib0, *)"
    )
    restart: bool = option(
        False,
        help="start fresh engines even if a live session with N ranks exists",
        action="store_true",
    )
    force: bool = option(
        False,
        help=f"start more than {MAX_RANKS_PER_CORE} ranks per core of this host (refused "
        "otherwise)",
        action="store_true",
    )
    profile: str = option(
        "", help="the ipyparallel profile the cluster runs in (default: ipyparallel's)"
    )
    launcher_config: Mapping[str, Mapping[str, object]] | None = option(
        None,
        help="traitlets settings for ipyparallel's launchers, e.g. "
        "{'SlurmEngineSetLauncher': {'queue': 'gpu'}}",
        flag=None,
    )


def launch_config(options: LaunchOptions) -> LaunchConfig:
    """The LaunchConfig ``options`` ask for: ``env`` items read, ``hosts`` and the slurm
    options turned into settings of ipyparallel's launchers (``launcher_config`` wins where
    both set one); every value checked on the way (OptionError)."""
    env = options.env or {}
    env = dict(env) if isinstance(env, Mapping) else parse_env(env)
    launcher_config = dict(options.launcher_config or {})
    if options.hosts:
        hosts = options.hosts
        engines = parse_hosts(hosts) if isinstance(hosts, str) else dict(hosts)
        launcher_config = {**ssh_config(engines), **launcher_config}
    if options.partition or options.sbatch_args:
        slurm = slurm_config(options.partition, tuple(options.sbatch_args))
        launcher_config = {**slurm, **launcher_config}
    return LaunchConfig(
        num_ranks=options.num_ranks,
        backend=options.backend,
        launcher=options.launcher,
        timeout_s=options.timeout,
        threads=options.threads,
        env=env,
        port=options.port,
        pg_timeout_s=options.pg_timeout,
        profile=options.profile,
        launcher_config=launcher_config,
        listen=options.listen,
        force=options.force,
    )


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What a launch is made with (``launch_config`` makes it from the LaunchOptions a
    user gave), checked as it is made: a bad value raises OptionError naming the flag.

    ``timeout_s`` bounds the whole launch (engines registering, ranks joining);
    ``pg_timeout_s`` is the process-group timeout, the only thing that frees a rank blocked
    in a gloo collective (SIGINT cannot; torch's default is 30 min).
    """

    num_ranks: int
    backend: str = "auto"
    launcher: str = "local"
    timeout_s: float = 120.0
    threads: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    pg_timeout_s: float = 600.0
    profile: str = ""
    launcher_config: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    listen: str = ""  # interface or address the notebook side listens on ("": loopback)
    force: bool = False  # start more local ranks than MAX_RANKS_PER_CORE allows

    def __post_init__(self):
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise OptionError(
                f"number of ranks must be a whole number >= 1, got {self.num_ranks!r}"
            )
        if self.backend not in BACKENDS:
            raise OptionError(
                f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.launcher not in LAUNCHERS:
            raise OptionError(
                f"unknown launcher {self.launcher!r}; choose one of {', '.join(LAUNCHERS)}"
            )
        checked_timeout(self.timeout_s, "--timeout")
        if self.threads is not None and self.threads < 1:
            raise OptionError(f"--threads must be >= 1, got {self.threads!r}")
        if not 0 <= self.port <= 65535:
            raise OptionError(f"--port must be 0 (any free port) or 1-65535, got {self.port!r}")
        checked_timeout(self.pg_timeout_s, "the process-group timeout (--pg-timeout)")
        address = listen_address(self.listen)  # OptionError names the interfaces
        if self.launcher == Launcher.LOCAL and not is_loopback(address):
            raise OptionError(
                "--listen is for ranks on other hosts; the local launcher's are "
                "all on this one and stay on 127.0.0.1"
            )
        engines = self.launcher_config.get("SSHEngineSetLauncher", {}).get("engines")
        if self.launcher == Launcher.SSH and not engines:
            raise OptionError("the ssh launcher needs hosts: --hosts node1:4,node2:4")
        if self.launcher == Launcher.SSH and is_loopback(address) and set(engines) - LOCAL_NAMES:
            raise OptionError(
                "engines on other hosts cannot reach a controller on 127.0.0.1: add --listen "
                "<interface or address of this machine> (e.g. --listen eth0)"
            )
        too_many = oversubscription(self)
        if too_many and not self.force and self.num_ranks > MAX_RANKS_PER_CORE * _cores():
            raise OptionError(
                f"{too_many}; dtlab refuses more than {MAX_RANKS_PER_CORE} "
                "ranks per core unless asked to (--force, or force=True)"
            )
        omp = self.env.get("OMP_NUM_THREADS", "1")
        if not (omp.isdigit() and int(omp) >= 1):
            raise OptionError(f"--env OMP_NUM_THREADS must be a whole number >= 1, got {omp!r}")

    def engine_settings(self) -> str:
        """What the engine processes are started with; a change means new engines (the
        environment is read when torch and OpenMP start, too late to change later)."""
        fixed = (
            self.num_ranks,
            self.launcher,
            self.profile,
            self.env,
            self.launcher_config,
            self.listen,
        )
        return json.dumps(fixed, sort_keys=True, default=str)

    def group_settings(self) -> tuple:
        """What the process group is built from besides the backend; a change means
        rebuilding the group on the same engines."""
        return (self.threads, self.port, self.pg_timeout_s)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription(config: LaunchConfig) -> str | None:
    """What a local launch of more ranks than this host has cores means (None: it fits).
    Ranks then take turns on the cores: steps are slower, and timings (stragglers, the
    partition editor's gains) carry the noise of the sharing."""
    cores = _cores()
    if config.launcher != Launcher.LOCAL or config.num_ranks <= cores:
        return None
    return (
        f"{config.num_ranks} ranks on {cores} cores: {config.num_ranks / cores:g} ranks "
        "per core, so they take turns and their timings are noisy"
    )


def keeping_threads(config: LaunchConfig, threads_by_rank: Mapping[int, int]) -> LaunchConfig:
    """``config`` with the thread count its ranks ran at, for fresh engines: a resume check
    or a replay on them is bitwise only at the same count (agent/threads.py), also when
    they land on a host with another number of cores."""
    counts = set(threads_by_rank.values())
    if config.threads is not None or len(counts) != 1:
        return config
    return replace(config, threads=counts.pop())

"""``%dt_doctor`` check: is the launch environment consistent, useful and not oversubscribed?

Collected on each rank at launch (:class:`dtlab.records.RankInfo`) plus the cores of each
host; this pure check combines them in three stages:

1. cross-rank differences in versions, threads and environment variables
   (:func:`dtlab.analysis.consistency.find_inconsistencies`);
2. variables harmful, or without effect, for the backend in use (:data:`ENV_RULES`);
3. CPU oversubscription: more OpenMP threads on a host than it has cores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from dtlab.analysis.consistency import Inconsistency, find_inconsistencies
from dtlab.analysis.grouping import group_by_value
from dtlab.analysis.ranks import format_ranks, label_ranks
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding, RankInfo

KIND = "environment"
# A rank on another torch / CUDA / NCCL build can compute or communicate differently.
VERSION_FIELDS = frozenset({"torch_version", "cuda_version", "nccl_version"})


class EnvRule(NamedTuple):
    """One variable setting worth a finding.

    ``variable`` is a name or a prefix ending in ``*``; ``match`` is the value that triggers
    the rule (compared case-insensitively) or a predicate ``(value, rank_info) -> bool``.
    """

    variable: str
    match: str | Callable[[str, RankInfo], bool]
    severity: str
    why: str
    fix: str


def _pure(backend: str) -> Callable[[str, RankInfo], bool]:
    return lambda value, info: info.backend == backend


INFORMATIONAL = {"NCCL_VERSION"}  # set by container images to describe, not to configure


def _on_gloo_not_informational(value: str, info: RankInfo) -> bool:
    return info.backend == "gloo"


def _nccl_debug_verbose(value: str, info: RankInfo) -> bool:
    return "nccl" in info.backend and value.upper() in ("INFO", "TRACE")


ENV_RULES: tuple[EnvRule, ...] = (
    # (no GLOO_* rule for NCCL jobs: CPU tensors, and dtlab's own agreement, use gloo there)
    EnvRule(
        "NCCL_*",
        _on_gloo_not_informational,
        "advice",
        "has no effect on a gloo group",
        "unset it, or launch with --backend nccl if NCCL was meant",
    ),
    EnvRule(
        "CUDA_LAUNCH_BLOCKING",
        "1",
        "warning",
        "serialises CUDA kernels, so every timing is distorted and steps run slower",
        "unset it once the failing kernel is found",
    ),
    EnvRule(
        "TORCH_DISTRIBUTED_DEBUG",
        "DETAIL",
        "warning",
        "adds consistency checks to every collective call, so steps run slower",
        "set it to INFO or OFF unless you are hunting a mismatched collective",
    ),
    EnvRule(
        "NCCL_DEBUG",
        _nccl_debug_verbose,
        "advice",
        "makes NCCL log every communicator and, at TRACE, every call (log volume)",
        "set NCCL_DEBUG=WARN once the communicator setup is understood",
    ),
)

# Measured on 2 cores, gloo DDP (docs/design.md, "Threads").
OVERSUBSCRIPTION_COST = (
    "OpenMP threads spin while they wait; measured on 2 cores, 8 ranks x 2 threads stepped "
    "~5.7x slower than with 1 thread (8x1024² MLP, ~17x for a small MLP), 4 x 2 ~3.7x (~18x)"
)
PASSIVE_COST = (
    "OMP_WAIT_POLICY=PASSIVE is set, which measured close to 1 thread per rank "
    "(8 x 2 on 2 cores: ~418 vs ~394 ms per step)"
)


@check("environment", order=10)
def check_environment(evidence: Evidence) -> CheckResult:
    """Findings on the ranks' versions, environment variables and threads per core."""
    infos = evidence.ranks
    findings = [
        *_inconsistency_findings(infos),
        *_env_rule_findings(infos),
        *_oversubscription_findings(infos, evidence.cores_by_host),
    ]
    return CheckResult(
        check=KIND,
        title="launch environment",
        findings=tuple(findings),
        looked_at=_looked_at(infos, evidence.cores_by_host),
        passed_because="" if findings else _passed_because(infos, evidence.cores_by_host),
    )


# --- 1. cross-rank differences ------------------------------------------------------------


def _inconsistency_findings(infos: Mapping[int, RankInfo]) -> list[Finding]:
    world = len(infos)
    return [
        _inconsistency_finding(found, world)
        for found in find_inconsistencies(infos)
        if not found.expected_per_rank
    ]


def _inconsistency_finding(found: Inconsistency, world: int) -> Finding:
    largest = max(found.groups, key=lambda group: len(group[0]))  # ties: lowest first rank
    minority = tuple(r for ranks, _ in found.groups if ranks != largest[0] for r in ranks)
    return Finding(
        kind=KIND,
        ranks=minority,
        summary=f"{label_ranks(minority)} out of step with the rest: {found.describe()}",
        evidence={"setting": found.name, "values": _values(found.groups)},
        fix=_inconsistency_fix(found.name, world),
        severity="error" if found.name in VERSION_FIELDS else "warning",
    )


def _inconsistency_fix(name: str, world: int) -> str:
    if name.startswith("env "):
        var = name[4:]
        return (
            f"set {var} the same way for every rank (`%dt_launch {world} --env {var}=...`), "
            "or unset it in the shell that starts the engines"
        )
    if name == "num_threads":
        return f"give every rank the same thread count: `%dt_launch {world} --threads 1`"
    return (
        "install the same build in every engine's environment (compare `pip show torch` "
        "on each host), then relaunch"
    )


def _values(groups) -> dict[str, object]:
    return {format_ranks(ranks): value for ranks, value in groups}


# --- 2. variables harmful or without effect -----------------------------------------------


def _env_rule_findings(infos: Mapping[int, RankInfo]) -> list[Finding]:
    findings = []
    for rule in ENV_RULES:
        names = sorted(
            {
                n
                for info in infos.values()
                for n in info.env
                if _names(rule, n) and n not in INFORMATIONAL
            }
        )
        for name in names:
            hits = {
                r: info.env[name]
                for r, info in infos.items()
                if name in info.env and _matches(rule, info.env[name], info)
            }
            if hits:
                findings.append(_env_finding(rule, name, hits))
    return findings


def _names(rule: EnvRule, name: str) -> bool:
    if rule.variable.endswith("*"):
        return name.startswith(rule.variable[:-1])
    return name == rule.variable


def _matches(rule: EnvRule, value: str, info: RankInfo) -> bool:
    if callable(rule.match):
        return rule.match(value, info)
    return value.strip().upper() == rule.match.upper()


def _env_finding(rule: EnvRule, name: str, hits: Mapping[int, str]) -> Finding:
    ranks = tuple(sorted(hits))
    groups = group_by_value(hits)
    shown = "; ".join(f"{label_ranks(g)} = {value!r}" for g, value in groups)
    return Finding(
        kind=KIND,
        ranks=ranks,
        summary=f"{name} {rule.why} ({shown})",
        evidence={"variable": name, "values": _values(groups)},
        fix=rule.fix,
        severity=rule.severity,
    )


# --- 3. CPU oversubscription --------------------------------------------------------------


def _ranks_by_host(infos: Mapping[int, RankInfo]) -> dict[str, list[RankInfo]]:
    by_host: dict[str, list[RankInfo]] = {}
    for rank in sorted(infos):
        by_host.setdefault(infos[rank].host, []).append(infos[rank])
    return by_host


def _oversubscription_findings(
    infos: Mapping[int, RankInfo], cores_by_host: Mapping[str, int]
) -> list[Finding]:
    findings = []
    for host, on_host in _ranks_by_host(infos).items():
        cores = cores_by_host.get(host)
        total = sum(info.num_threads for info in on_host)
        # More ranks than cores with 1 thread each is ordinary time sharing; the harm
        # comes from OpenMP threads of one rank spinning while another holds the core.
        if cores is None or total <= cores or max(i.num_threads for i in on_host) <= 1:
            continue
        findings.append(_oversubscription_finding(host, on_host, cores, len(infos)))
    return findings


def _oversubscription_finding(
    host: str, on_host: list[RankInfo], cores: int, world: int
) -> Finding:
    ranks = tuple(info.rank for info in on_host)
    threads = {info.rank: info.num_threads for info in on_host}
    total = sum(threads.values())
    passive = all(i.env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" for i in on_host)
    per_rank = "/".join(str(n) for n in sorted(set(threads.values())))
    fix = f"use 1 thread per rank: `%dt_launch {world} --threads 1`"
    if not passive:
        fix += ", or `--env OMP_WAIT_POLICY=PASSIVE` so waiting threads sleep"
    return Finding(
        kind=KIND,
        ranks=ranks,
        summary=(
            f"host {host}: {len(on_host)} ranks x {per_rank} threads = {total} threads on "
            f"{cores} cores; {PASSIVE_COST if passive else OVERSUBSCRIPTION_COST}"
        ),
        evidence={
            "host": host,
            "ranks": ranks,
            "threads": threads,
            "total_threads": total,
            "cores": cores,
            "passive_wait": passive,
        },
        fix=fix,
        severity="advice" if passive else "warning",
    )


# --- what was compared ---------------------------------------------------------------------


def _looked_at(infos: Mapping[int, RankInfo], cores_by_host: Mapping[str, int]) -> str:
    if not infos:
        return "no rank information (was the job launched with %dt_launch?)"
    hosts = _ranks_by_host(infos)
    num_vars = len({name for info in infos.values() for name in info.env})
    text = (
        f"{len(infos)} ranks on {len(hosts)} host{'s' if len(hosts) != 1 else ''}: versions, "
        f"{num_vars} environment variable{'s' if num_vars != 1 else ''}, "
        "threads x ranks vs cores"
    )
    unknown = sorted(h for h in hosts if h not in cores_by_host)
    if unknown:
        text += f" (cores unknown on {', '.join(unknown)})"
    return text


def _passed_because(infos: Mapping[int, RankInfo], cores_by_host: Mapping[str, int]) -> str:
    if not infos:
        return "nothing to compare"
    backends = ", ".join(sorted({info.backend for info in infos.values()}))
    fits = "; ".join(
        f"{host}: {len(on_host)} x {max(i.num_threads for i in on_host)} threads on "
        f"{cores_by_host.get(host, '?')} cores"
        for host, on_host in _ranks_by_host(infos).items()
    )
    return (
        "every rank runs the same torch/CUDA/NCCL build, thread count and variables "
        f"(per-rank CUDA_VISIBLE_DEVICES aside); no variable set is harmful or idle on "
        f"{backends}; no host has more threads than cores with >1 thread per rank ({fits})"
    )

"""Engine ids -> ranks, decided once per launch from what the engines report.

ipyparallel numbers engines in registration order, which is a race; ranks must not be.
The order is the launcher's own (fork index, MPI rank, SLURM_PROCID) when every engine
has a distinct one, else (host, pid). Only control/ ever sees engine ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from dtlab.analysis.ranks import label_ranks
from dtlab.records import EngineFacts, RankPlan

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class RankMap:
    """``engine_ids[r]`` is the engine that is rank r."""

    engine_ids: tuple[int, ...]
    hosts: tuple[str, ...]
    local_ranks: tuple[int, ...]
    local_world_sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.engine_ids)

    def engines(self, ranks) -> list[int]:
        return [self.engine_ids[r] for r in ranks]


def _order_key(facts: Mapping[int, EngineFacts]):
    indexes = [f.launch_index for f in facts.values()]
    if None not in indexes and len(set(indexes)) == len(indexes):
        return lambda eid: (facts[eid].launch_index,)
    return lambda eid: (facts[eid].host, facts[eid].pid)


def assign_ranks(facts: Mapping[int, EngineFacts]) -> RankMap:
    """Deterministic rank for every engine, plus node-local rank and node size."""
    if not facts:
        raise ValueError("no engines to assign ranks to")
    order = sorted(facts, key=_order_key(facts))
    hosts = tuple(facts[eid].host for eid in order)
    local_ranks, local_sizes = [], []
    for rank, host in enumerate(hosts):
        local_ranks.append(hosts[:rank].count(host))
        local_sizes.append(hosts.count(host))
    return RankMap(tuple(order), hosts, tuple(local_ranks), tuple(local_sizes))


def cuda_device(rank: int, rank_map: RankMap, facts: Mapping[int, EngineFacts]) -> int | None:
    """The GPU index rank ``rank`` should use as its process sees them, or None.

    All of a host's GPUs visible to each rank: one each, by local rank. One GPU visible
    to each process with its own CUDA_VISIBLE_DEVICES (Slurm --gpus-per-task): device 0.
    """
    own = facts[rank_map.engine_ids[rank]]
    if own.num_cuda_devices >= rank_map.local_world_sizes[rank]:
        return rank_map.local_ranks[rank]
    on_host = [
        facts[e]
        for r, e in enumerate(rank_map.engine_ids)
        if rank_map.hosts[r] == rank_map.hosts[rank]
    ]
    visible = [f.cuda_visible_devices for f in on_host]
    if own.num_cuda_devices >= 1 and None not in visible and len(set(visible)) == len(visible):
        return 0
    return None


def choose_backend(requested: str, rank_map: RankMap, facts: Mapping[int, EngineFacts]) -> str:
    """``auto`` -> nccl when every rank has a GPU of its own, else gloo."""
    short = [r for r in range(rank_map.world_size) if cuda_device(r, rank_map, facts) is None]
    if requested == "auto":
        return "gloo" if short else "nccl"
    if requested == "nccl" and short:
        seen = {facts[rank_map.engine_ids[r]].num_cuda_devices for r in short}
        raise ValueError(
            f"--backend nccl needs one CUDA device per rank, but {label_ranks(short)} "
            f"find none of their own (devices seen: {', '.join(map(str, sorted(seen)))}); "
            "use --backend gloo (or auto), or launch fewer ranks per host"
        )
    return requested


def threads_per_rank(requested: int | None, num_cpus: int, local_world_size: int) -> int:
    """Intra-op threads so that the ranks of one host do not oversubscribe its cores.

    Two OpenMP threads per rank on 8 ranks x 2 cores stepped a small MLP 15x slower
    (~842 ms vs ~58 ms, docs/design.md): spinning threads steal each other's cores.
    """
    if requested is not None:
        return requested
    return max(1, num_cpus // local_world_size)


def master_addr(rank_map: RankMap) -> str:
    """Rank 0's host, or loopback when every rank is on one host."""
    return LOCALHOST if len(set(rank_map.hosts)) == 1 else rank_map.hosts[0]


def make_plans(
    rank_map: RankMap,
    facts: Mapping[int, EngineFacts],
    *,
    backend: str,
    port: int,
    threads: int | None,
    timeout_s: float,
    env: Mapping[str, str],
) -> dict[int, RankPlan]:
    addr = master_addr(rank_map)
    if threads is None and "OMP_NUM_THREADS" in env:  # --env OMP_NUM_THREADS=K means K
        threads = int(env["OMP_NUM_THREADS"])
    nodes = list(dict.fromkeys(rank_map.hosts))  # torchrun's GROUP_RANK: rank 0's host is 0
    run_id = str(uuid.uuid4())  # as torchrun makes one (--standalone, one node)
    plans = {}
    for rank, eid in enumerate(rank_map.engine_ids):
        local_size = rank_map.local_world_sizes[rank]
        plans[rank] = RankPlan(
            rank=rank,
            world_size=rank_map.world_size,
            local_rank=rank_map.local_ranks[rank],
            local_world_size=local_size,
            master_addr=addr,
            master_port=port,
            backend=backend,
            cuda_device=cuda_device(rank, rank_map, facts) if backend == "nccl" else None,
            num_threads=threads_per_rank(threads, facts[eid].num_cpus, local_size),
            timeout_s=timeout_s,
            env=dict(env),
            group_rank=nodes.index(rank_map.hosts[rank]),
            group_world_size=len(nodes),
            run_id=run_id,
        )
    return plans

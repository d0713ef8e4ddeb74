"""Per-rank records built by hand, for the pure tests (no cluster)."""

from dataclasses import replace

from dtlab.records import RankInfo

_BASE = RankInfo(
    rank=0, world_size=4, local_rank=0, local_world_size=4, host="h", pid=100, device="cpu",
    backend="gloo", num_threads=1, python_version="3.11.7", torch_version="2.13.0+cpu",
    cuda_version=None, nccl_version=None, allreduce_sum=6, env={"OMP_NUM_THREADS": "1"},
)  # fmt: skip


def rank_info(rank: int, **changes) -> RankInfo:
    """A healthy rank of a 4-rank CPU world, with ``changes`` applied."""
    return replace(_BASE, **{"rank": rank, "local_rank": rank, "pid": 100 + rank, **changes})

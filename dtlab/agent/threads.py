"""The intra-op thread count a computation runs with, set in one place.

torch's CPU kernels split reductions (matmul, sum, layer norm) across intra-op threads, so
the same operations in the same order round differently at another thread count: a demo
pipeline's second-step loss differed in the 8th digit at 2 threads vs 1 on a 2-core AVX2
EPYC, while it matched on another 2-core machine. "Bitwise: same operations, same order"
holds only at the same thread count. So:

- a rank takes its count from its ``RankPlan`` through ``use_threads`` (rendezvous.join);
- fresh engines of a restart, a resume check or a replay keep the count the ranks had
  (Session.renew, control/session.py), even on a host with another core count;
- a reference computed in another process (a test's one-process run, a script under
  torchrun) runs inside ``same_threads(n)`` or with ``thread_env(n)`` in its environment.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def thread_env(num_threads: int) -> dict[str, str]:
    """Environment for a child process (a DataLoader worker, torchrun) to run at this count."""
    return {"OMP_NUM_THREADS": str(num_threads)}  # what torchrun sets, and torch reads


def use_threads(num_threads: int) -> None:
    """Run this process's torch CPU kernels at ``num_threads`` intra-op threads."""
    import torch

    if num_threads < 1:
        raise ValueError(f"a thread count must be >= 1, got {num_threads!r}")
    torch.set_num_threads(num_threads)


@contextmanager
def same_threads(num_threads: int) -> Iterator[None]:
    """Compute at ``num_threads`` intra-op threads inside the block, then restore."""
    import torch

    before = torch.get_num_threads()
    use_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def common_threads(counts: Mapping[int, int]) -> int:
    """The one thread count ``{rank: count}`` share; a clear error when they differ (a
    comparison across ranks at different counts is not bitwise)."""
    distinct = sorted(set(counts.values()))
    if len(distinct) != 1:
        by_count = {n: sorted(r for r, c in counts.items() if c == n) for n in distinct}
        raise ValueError(
            f"ranks run at different thread counts {by_count}: launch with --threads N"
        )
    return distinct[0]

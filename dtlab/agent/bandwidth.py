"""An all_reduce bandwidth sweep on this rank's process group (nccl-tests style).

Runs on every rank at once (the notebook calls :func:`sweep` on all). For each message
size: ``warmup`` untimed all_reduces, a barrier, then ``iters`` timed back to back in up to
five groups (their spread lets two sweeps be compared against noise); each rank reports
its own mean time per all_reduce, and the notebook takes the slowest rank's
(:mod:`dtlab.analysis.bandwidth`), as nccl-tests does. Tensors live on the rank's device
(CUDA under NCCL), so the sweep measures whatever backend the job uses.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

GROUPS = 5  # timed groups per size: a spread for comparisons (dtlab.analysis.timing)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def sweep(
    sizes: list[int],
    *,
    iters: int = 20,
    warmup: int = 5,
    dtype: str = "float32",
    device: str | None = None,
) -> list[tuple[int, float, tuple[float, ...]]]:
    """[(bytes, seconds per all_reduce on this rank, the same per timed group)] for each
    size in ``sizes`` (bytes, rounded down to whole elements, at least one)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {sorted(DTYPES)}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got {iters} and {warmup}")
    kind = DTYPES[dtype]
    where = torch.device(device) if device else _default_device()
    element = torch.tensor([], dtype=kind).element_size()
    results = []
    for size in sizes:
        count = max(1, int(size) // element)
        tensor = torch.ones(count, dtype=kind, device=where)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        _sync(where)
        dist.barrier()
        groups = []  # seconds per all_reduce in each group: the spread of the mean
        for size_of_group in _groups(iters):
            start = time.perf_counter()
            for _ in range(size_of_group):
                dist.all_reduce(tensor)
            _sync(where)
            groups.append((time.perf_counter() - start) / size_of_group)
        mean = sum(g * n for g, n in zip(groups, _groups(iters), strict=True)) / iters
        results.append((count * element, mean, tuple(groups)))
    return results


def _groups(iters: int) -> list[int]:
    """``iters`` split into up to GROUPS groups timed one by one (20 -> 4 each)."""
    k = min(GROUPS, iters)
    return [iters // k + (1 if i < iters % k else 0) for i in range(k)]


def _default_device() -> torch.device:
    from dtlab.agent.rendezvous import identity

    return torch.device(identity().device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # collectives are asynchronous on CUDA streams
        torch.cuda.synchronize(device)

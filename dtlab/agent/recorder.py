"""What a rank measures about its own tensors each step: norms, fingerprints, memory.

Cheap by design (FACTS.md, 8 ranks on 2 cores): one fused ``_foreach_norm`` for every
gradient, one ``torch.hash_tensor`` (xor of the elements' 64-bit patterns) per tensor, and
byte counts from tensor metadata. Nothing here moves a tensor off the rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

import torch

from dtlab.records import StepMemory

_MASK64 = (1 << 64) - 1


def fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit fingerprint of the tensor's bits: equal bits -> equal fingerprints."""
    return fingerprints([tensor])[0]


def _sum_of_bits(t: torch.Tensor) -> int:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.contiguous().view(as_int).sum(dtype=torch.int64)) & _MASK64


def fingerprints(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """Fingerprint per tensor; 0 for a missing one (a parameter without a gradient)."""
    present = [t.detach() for t in tensors if t is not None and t.numel()]
    if not present:
        hashes = []
    elif hasattr(torch, "hash_tensor"):  # one stack: a single copy back, not one per tensor
        hashes = torch.stack([torch.hash_tensor(t) for t in present]).tolist()
    else:  # torch < 2.9 has no hash_tensor
        hashes = [_sum_of_bits(t) for t in present]
    found = iter(hashes)
    return [next(found) & _MASK64 if t is not None and t.numel() else 0 for t in tensors]


def grad_stats(grads: Sequence[torch.Tensor | None]) -> tuple[list[float], list[int], list[int]]:
    """(L2 norm per gradient (nan if missing), non-finite count, indices of missing ones)."""
    present = [g.detach() for g in grads if g is not None]
    norms_iter = iter(torch.stack(torch._foreach_norm(present)).tolist()) if present else iter(())
    norms, nonfinite, missing = [], [], []
    for i, g in enumerate(grads):
        if g is None:
            norms.append(math.nan)
            nonfinite.append(0)
            missing.append(i)
            continue
        norm = next(norms_iter)
        norms.append(norm)
        # a finite norm means finite elements, so only a bad norm pays for the full count
        nonfinite.append(0 if math.isfinite(norm) else int((~torch.isfinite(g)).sum()))
    return norms, nonfinite, missing


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
        for state in optimizer.state.values()
    )


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc, else psutil)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def memory(params: Sequence[torch.Tensor], optimizer, device: torch.device) -> StepMemory:
    cuda = {}
    if device.type == "cuda":
        cuda = {
            "cuda_allocated": torch.cuda.memory_allocated(device),
            "cuda_reserved": torch.cuda.memory_reserved(device),
            "cuda_peak": torch.cuda.max_memory_allocated(device),
        }
    return StepMemory(
        rss=rss_bytes(),
        param_bytes=tensor_bytes(params),
        grad_bytes=tensor_bytes(p.grad for p in params),
        optimizer_bytes=optimizer_bytes(optimizer),
        **cuda,
    )

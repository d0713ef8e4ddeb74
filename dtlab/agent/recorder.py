"""What a rank measures about its own tensors each step: norms, fingerprints, memory.

Cheap by design (docs/design.md, 8 ranks on 2 cores): one fused ``_foreach_norm`` for every
gradient; a fingerprint per tensor that is XXH3-64 of its bytes on the host (~10 GB/s, a
few microseconds a tensor: ~60 us for the demo model's 44 tensors, where a weighted sum
in torch took ~400 us) and a position-weighted sum of its bit patterns on an accelerator
(one host sync for all of a call's tensors); byte counts from tensor metadata. Nothing
here moves a tensor off the rank, except that a sharded (FSDP2) tensor is gathered whole
to be fingerprinted: one all-gather per parameter per recorded step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Sequence

import torch
import xxhash

from dtlab.records import StepMemory, combine_fingerprints

_MASK64 = (1 << 64) - 1
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads index bits
_weights: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _position_weights(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Odd weights from the element index alone (the same on every rank and in every run;
    a longer table starts with the shorter one)."""
    table = _weights.get((dtype, device))
    if table is None or table.numel() < numel:
        index = torch.arange(1, max(numel, 1024) + 1, dtype=torch.int64)
        table = ((index * _GOLDEN) >> 29).to(dtype) | 1  # int64 products wrap; that is fine
        table = _weights[(dtype, device)] = table.to(device)
    return table[:numel]


PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a DTensor (or another subclass)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a plain strided one, outside autograd (a gradient already is: the
    checks cost less than the detach they save, a microsecond a tensor)."""
    flat = tensor.detach() if tensor.requires_grad or type(tensor) not in PLAIN else tensor
    return flat.to_dense() if flat.layout != torch.strided else flat


def _host_print(tensor: torch.Tensor) -> int:
    """XXH3-64 of a host tensor's bytes in element order (strided ones copied first)."""
    flat = _dense(tensor)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    try:
        data = flat.numpy()  # no copy; numpy's buffer is what xxhash reads
    except (TypeError, RuntimeError):  # bfloat16, float8, a conjugate view: read the bytes
        data = flat.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data) or 1


def _weighted_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over elements of (bit pattern x weight of its position), as a 0-d int64 tensor
    on the tensor's device (read back by the caller, one sync for many tensors)."""
    flat = _dense(tensor).reshape(-1)  # reshape copies if strided
    if flat.element_size() == 4:  # the common case: products wrap in int32, no widening copy
        bits = flat.view(torch.int32)
        weights = _position_weights(bits.numel(), torch.int32, bits.device)
        return (bits * weights).sum(dtype=torch.int64)
    as_int = {1: torch.uint8, 2: torch.int16, 8: torch.int64}[flat.element_size()]
    bits = flat.view(as_int).to(torch.int64)
    return (bits * _position_weights(bits.numel(), torch.int64, bits.device)).sum()


def _read_back(sums: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """Fingerprints from (weighted sum, element count) pairs: one host sync per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for value, _ in sums:
        by_device.setdefault(value.device, []).append(value)
    read = {device: iter(torch.stack(parts).tolist()) for device, parts in by_device.items()}
    return [((next(read[v.device]) + numel * _GOLDEN) & _MASK64) or 1 for v, numel in sums]


def device_prints(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Fingerprints of accelerator tensors: a position-weighted sum of each one's bit
    patterns, all read back at once. Changing any element, swapping two, or transposing
    changes it (so does a constant tensor changing value, which an xor would miss)."""
    return _read_back([(_weighted_bits(t), t.numel()) for t in tensors])


def fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit fingerprint of the tensor's bits and their positions; never 0 (0 means
    "no tensor": a parameter without a gradient). On the host XXH3-64 of its bytes, on an
    accelerator :func:`device_prints`: ranks compare tensors on the same kind of device.
    Two different tensors share a fingerprint only by coincidence."""
    if tensor.device.type == "cpu":
        return _host_print(tensor)
    return device_prints([tensor])[0]


def whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A sharded tensor (FSDP2's DTensor) gathered whole, so that ranks can compare it;
    a collective, so every rank must ask for the same tensors in the same order."""
    if type(tensor) in PLAIN:
        return tensor
    if tensor is not None and hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    return tensor


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a sharded tensor (what it holds in memory), else the tensor."""
    if type(tensor) in PLAIN:
        return tensor
    if tensor is not None and hasattr(tensor, "to_local"):
        return tensor.to_local()
    return tensor


def fingerprints(tensors: Sequence[torch.Tensor | None]) -> list[int]:
    """Fingerprint per tensor (of the whole tensor when sharded: under FSDP the gathered
    gradients and parameters must agree across ranks); 0 for a missing one."""
    prints = [0] * len(tensors)
    on_device = []  # (index, (weighted sum, numel)): read back together; a gathered
    for i, tensor in enumerate(tensors):  # tensor is dropped before the next is gathered
        if tensor is None:
            continue
        tensor = whole(tensor)
        if tensor.device.type == "cpu":
            prints[i] = _host_print(tensor)
        else:
            on_device.append((i, (_weighted_bits(tensor), tensor.numel())))
    for (i, _), value in zip(on_device, _read_back([s for _, s in on_device]), strict=True):
        prints[i] = value
    return prints


def grad_stats(grads: Sequence[torch.Tensor | None]) -> tuple[list[float], list[int], list[int]]:
    """(L2 norm per gradient (nan if missing), non-finite count, indices of missing ones)."""
    dense = [None if g is None else _dense(whole(g)) for g in grads]
    present = [g for g in dense if g is not None]
    norms_iter = iter(torch.stack(torch._foreach_norm(present)).tolist()) if present else iter(())
    norms, nonfinite, missing = [], [], []
    for i, g in enumerate(dense):
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


def grad_summary(grads: Sequence[torch.Tensor | None]):
    """(norms, non-finite counts, missing indices, fingerprints) of the gradients. Sharded
    ones are gathered one at a time and dropped before the next: holding them all whole
    at once would undo what FSDP saves."""
    if not any(g is not None and hasattr(g, "full_tensor") for g in grads):
        return (*grad_stats(grads), fingerprints(grads))
    norms, nonfinite, missing, prints = [], [], [], []
    for i, grad in enumerate(grads):
        one = whole(grad)
        (norm,), (bad,), gone = grad_stats([one])
        norms.append(norm)
        nonfinite.append(bad)
        if gone:
            missing.append(i)
        prints.append(0 if one is None else fingerprint(one))
    return norms, nonfinite, missing, prints


def grad_fields(norms, nonfinite, missing, prints) -> dict:
    """A step record's gradient fields from the per-parameter summaries."""
    grad_prints = tuple(prints)  # not "fingerprints": that is this module's function
    return {
        "grad_norms": tuple(norms),
        "grad_fingerprints": grad_prints,
        "nonfinite": tuple(nonfinite),
        "missing_grads": tuple(missing),
        "grad_norm": math.sqrt(math.fsum(n * n for n in norms if not math.isnan(n))),
        "grad_fingerprint": combine_fingerprints(grad_prints),
        "num_nonfinite": sum(nonfinite),
    }


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank holds (its shard of a sharded tensor). A plain loop: every step
    counts parameters, gradients and optimizer state (~300 tensors for the demo)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        if type(tensor) not in PLAIN:
            tensor = local(tensor)
        total += tensor.nbytes
    return total


def optimizer_bytes(optimizer) -> int:
    """Bytes of this rank's optimizer state (ZeroRedundancyOptimizer: its shard's); of
    each, given a list of optimizers (a container's)."""
    if isinstance(optimizer, (list, tuple)):
        return sum(optimizer_bytes(o) for o in optimizer)
    optimizer = getattr(optimizer, "optim", optimizer)
    return tensor_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc, else psutil)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def object_bytes(record) -> int:
    """Bytes of a step record with its tuples and numbers (sys.getsizeof, one level down)."""
    total = sys.getsizeof(record)  # its slots: the references to the values below
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        total += sys.getsizeof(value)
        if isinstance(value, tuple):
            total += sum(sys.getsizeof(v) for v in value)
    return total


def memory(
    params: Sequence[torch.Tensor], optimizer, device: torch.device, dtlab_bytes: int = 0
) -> StepMemory:
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
        dtlab_bytes=dtlab_bytes,
        **cuda,
    )


INPUT_PRINT_ELEMENTS = 1 << 20  # a batch is told apart by its first million values


def input_fingerprints(data) -> list[int]:
    """Fingerprints of the data tensors in ``data`` (a batch, or a forward's arguments:
    tensors inside tuples, lists and dicts), skipping tensors that need gradients (those
    are activations of an earlier module, not data). What lets the doctor see ranks fed
    the same inputs when no sample index was recorded."""
    found: list[int] = []
    stack = [data]
    while stack and len(found) < 64:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if not item.requires_grad and item.numel():
                found.append(fingerprint(item.detach().reshape(-1)[:INPUT_PRINT_ELEMENTS]))
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found

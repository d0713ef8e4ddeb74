"""All_reduce bandwidth from a sweep's per-rank times, as nccl-tests reports it.

Pure. ``algbw = bytes / time`` (the slowest rank's time); ``busbw = algbw * 2(n-1)/n``, the
rate each link must carry in a ring all_reduce, comparable across rank counts and against
the hardware's peak (nccl-tests' PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtlab.analysis.errors import InputError

DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class BandwidthPoint:
    size: int  # bytes per rank
    time_s: float  # slowest rank's mean time per all_reduce
    algbw: float  # bytes per second
    busbw: float  # bytes per second


@dataclass(frozen=True)
class Sweep:
    label: str
    world_size: int
    backend: str
    dtype: str
    points: tuple[BandwidthPoint, ...]

    @property
    def peak_busbw(self) -> float:
        return max((p.busbw for p in self.points), default=0.0)


def combine(
    times: Mapping[int, Sequence[tuple[int, float]]], *, label: str, backend: str, dtype: str
) -> Sweep:
    """{rank: [(bytes, seconds)]} from every rank -> one Sweep (slowest rank per size)."""
    if not times:
        raise ValueError("no rank reported a sweep")
    sizes = {tuple(s for s, _ in rows) for rows in times.values()}
    if len(sizes) != 1:
        raise ValueError(f"ranks swept different sizes: {sorted(sizes)}")
    n = len(times)
    points = []
    for i, size in enumerate(next(iter(sizes))):
        slowest = max(rows[i][1] for rows in times.values())
        algbw = size / slowest if slowest > 0 else float("inf")
        points.append(BandwidthPoint(size, slowest, algbw, algbw * 2 * (n - 1) / n))
    return Sweep(label, n, backend, dtype, tuple(points))


def sizes_between(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """min, min*factor, ... up to max (nccl-tests' -b/-e/-f)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise InputError(
            f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, "
            f"{factor}"
        )
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def compare_sweeps(a: Sweep, b: Sweep) -> str:
    """One line: how B's bus bandwidth compares with A's at small and large messages."""
    if [p.size for p in a.points] != [p.size for p in b.points]:
        raise ValueError("the two sweeps measured different message sizes")
    small, large = a.points[0], a.points[-1]
    small_b, large_b = b.points[0], b.points[-1]
    return (
        f"{b.label} vs {a.label}: latency at {small.size} B {small_b.time_s * 1e6:.0f} vs "
        f"{small.time_s * 1e6:.0f} us ({small.time_s / small_b.time_s:.2f}x); bus bandwidth "
        f"at {large.size / 2**20:g} MiB {large_b.busbw / 1e9:.2f} vs {large.busbw / 1e9:.2f}"
        f" GB/s ({large_b.busbw / large.busbw:.2f}x)"
    )

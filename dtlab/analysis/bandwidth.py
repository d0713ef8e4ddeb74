"""All_reduce bandwidth from a sweep's per-rank times, as nccl-tests reports it.

Pure. ``algbw = bytes / time`` (the slowest rank's time); ``busbw = algbw * 2(n-1)/n``, the
rate each link must carry in a ring all_reduce, comparable across rank counts and against
the hardware's peak (nccl-tests' PERFORMANCE.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtlab.analysis import timing
from dtlab.records.errors import InputError

DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class BandwidthPoint:
    size: int  # bytes per rank
    time_s: float  # slowest rank's mean time per all_reduce
    algbw: float  # bytes per second
    busbw: float  # bytes per second
    # seconds per all_reduce in each timed group, the slowest rank's per group: the spread
    samples: tuple[float, ...] = ()


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


def combine(times: Mapping[int, Sequence[tuple]], *, label: str, backend: str, dtype: str) -> Sweep:
    """{rank: [(bytes, seconds, (seconds per timed group, ...))]} from every rank -> one
    Sweep (the slowest rank per size, and per group); the groups may be left out."""
    if not times:
        raise ValueError("no rank reported a sweep")
    sizes = {tuple(row[0] for row in rows) for rows in times.values()}
    if len(sizes) != 1:
        raise ValueError(f"ranks swept different sizes: {sorted(sizes)}")
    n = len(times)
    points = []
    for i, size in enumerate(next(iter(sizes))):
        slowest = max(rows[i][1] for rows in times.values())
        algbw = size / slowest if slowest > 0 else float("inf")
        groups = [tuple(rows[i][2]) if len(rows[i]) > 2 else () for rows in times.values()]
        samples = tuple(map(max, zip(*groups, strict=True))) if all(groups) else ()
        points.append(BandwidthPoint(size, slowest, algbw, algbw * 2 * (n - 1) / n, samples))
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
    """One line: how B's latency (smallest message) and bus bandwidth (largest) compare
    with A's, each judged against the spread of its timed groups (within noise or not)."""
    if [p.size for p in a.points] != [p.size for p in b.points]:
        raise ValueError("the two sweeps measured different message sizes")
    small, large = a.points[0], a.points[-1]
    small_b, large_b = b.points[0], b.points[-1]
    return (
        f"{b.label} vs {a.label}: latency at {small.size} B {small_b.time_s * 1e6:.0f} vs "
        f"{small.time_s * 1e6:.0f} us ({small.time_s / small_b.time_s:.2f}x, "
        f"{_verdict(small, small_b)}); bus bandwidth at {large.size / 2**20:g} MiB "
        f"{large_b.busbw / 1e9:.2f} vs {large.busbw / 1e9:.2f} GB/s "
        f"({large_b.busbw / large.busbw:.2f}x, {_verdict(large, large_b)})"
    )


def _verdict(a: BandwidthPoint, b: BandwidthPoint) -> str:
    """B's time against A's: "faster"/"slower" beyond the spread, "within noise", or why
    there is no verdict."""
    if not (a.samples and b.samples):
        return "no spread measured: no verdict"
    found = timing.change(a.samples, b.samples)
    if found.verdict in ("faster", "slower"):
        return f"{found.verdict}, beyond the spread"
    if found.verdict == "within noise":
        return "within noise"
    return f"{min(len(a.samples), len(b.samples))} timed groups: too few to judge"

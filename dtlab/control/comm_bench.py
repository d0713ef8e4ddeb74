"""Communication measured on the live ranks (``dt.bandwidth_sweep()``, ``dt.comm``).

Collect (each rank times its all_reduces, :mod:`dtlab.agent.bandwidth`) -> combine (the
slowest rank per size, :mod:`dtlab.analysis.bandwidth`) -> present (views).
"""

from __future__ import annotations

from dtlab.agent import api
from dtlab.analysis.bandwidth import Sweep, combine, sizes_between
from dtlab.control.errors import OptionError
from dtlab.control.world import World

SWEEP_TIMEOUT_S = 600.0


class Comm:
    """Bandwidth sweeps on the job's process group (``dt.comm``)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sweeps: list[Sweep] = []  # dt.bandwidth_sweep() results, oldest first

    def bandwidth_sweep(
        self,
        *,
        min_bytes: int = 1024,
        max_bytes: int = 16 * 2**20,
        factor: int = 4,
        iters: int = 20,
        warmup: int = 5,
        dtype: str = "float32",
        label: str | None = None,
    ) -> Sweep:
        """All_reduce time, algorithm and bus bandwidth per message size on the job's
        process group (nccl-tests' all_reduce_perf, on whatever backend is up). Sweeps are
        kept in ``dt.sweeps`` to compare settings (A/B)."""
        if iters < 1 or warmup < 0:  # said here, not as a traceback from every rank
            raise OptionError(
                f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}"
            )
        sizes = sizes_between(min_bytes, max_bytes, factor)
        times = self.world.run(
            api.bandwidth_sweep, sizes, iters, warmup, dtype, timeout=SWEEP_TIMEOUT_S
        )
        label = label or f"sweep {len(self.sweeps) + 1}"
        result = combine(times, label=label, backend=self.world.backend, dtype=dtype)
        self.sweeps.append(result)
        return result

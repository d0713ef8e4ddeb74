"""Where to cut a pipeline: the bounds behind the partition methods.

Pure (runs anywhere) and plan-free: these functions take block weights or costs in model
order and return bounds (DeepSpeed's ``parts`` list); :mod:`dtlab.analysis.partition`
checks the inputs, raises its :class:`~dtlab.analysis.partition.PlanError`, and wraps the
bounds in a ``Plan``. Importing nothing from it keeps the two modules free of a cycle.

    uniform_bounds(7, 3)                 # (0, 3, 5, 7): DeepSpeed's "uniform"
    min_max_bounds([7, 2, 5, 10, 8], 2)  # (0, 3, 5): the smallest largest stage
    measured_bounds(costs, 4)            # fastest, then leanest in memory
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

from dtlab.records.stages import BlockCost

# plans whose slowest stage is this close to the fastest possible count as equally fast, so
# "measured" may give up that much time for a stage memory that fits more easily
TIME_TOLERANCE = 0.02
# parameter + gradient + Adam's two moments, all the parameter's dtype
STATE_BYTES_PER_PARAM_BYTE = 4


def uniform_bounds(n: int, num_stages: int) -> tuple[int, ...]:
    """Equal block counts (DeepSpeed's ``uniform``)."""
    size, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (s < extra))  # as DeepSpeed: extras go first
    return tuple(bounds)


def min_max_bounds(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The split whose largest stage sum is smallest, most even among equals; ``weights``
    finite and >= 0, ``num_stages`` in 1..len(weights) (the caller checks)."""
    prefix = _prefix(weights)
    return _most_even(prefix, num_stages, _within(prefix, _min_max(prefix, num_stages, _any)))


def _measured_s(cost: BlockCost) -> float:
    assert cost.forward_s is not None and cost.backward_s is not None  # the caller checks
    return cost.forward_s + cost.backward_s


def measured_bounds(costs: Sequence[BlockCost], num_stages: int) -> tuple[int, ...]:
    """Fastest split (within :data:`TIME_TOLERANCE`), then the one lightest on its heaviest
    stage's memory, then the most even in time; every cost measured (the caller checks)."""
    time = _prefix([_measured_s(c) for c in costs])
    memory = _prefix(
        [c.param_bytes * STATE_BYTES_PER_PARAM_BYTE + (c.activation_bytes or 0) for c in costs]
    )
    fast = _within(time, _min_max(time, num_stages, _any) * (1 + TIME_TOLERANCE))
    lean = _within(memory, _min_max(memory, num_stages, fast))
    return _most_even(time, num_stages, lambda i, j: fast(i, j) and lean(i, j))


# -- contiguous-partition DP (O(stages * blocks^2): blocks number in the hundreds at most) --

Fits = Callable[[int, int], bool]  # may blocks[i:j] form one stage?


def _prefix(values: Sequence[float]) -> list[float]:
    return list(accumulate(values, initial=0.0))


def _any(i: int, j: int) -> bool:
    return True


def _within(prefix: list[float], limit: float) -> Fits:
    slack = 1e-9 * max(1.0, abs(limit))  # float sums of the same blocks may differ in the ulp
    return lambda i, j: prefix[j] - prefix[i] <= limit + slack


def _min_max(prefix: list[float], num_stages: int, fits: Fits) -> float:
    """Smallest achievable largest stage sum over the splits whose stages all fit."""
    n = len(prefix) - 1
    best = [0.0] + [math.inf] * n  # best[j]: blocks[:j] in the stages so far
    for k in range(1, num_stages + 1):
        row = [math.inf] * (n + 1)
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                if best[i] < math.inf and fits(i, j):
                    row[j] = min(row[j], max(best[i], prefix[j] - prefix[i]))
        best = row
    return best[n]


def _most_even(prefix: list[float], num_stages: int, fits: Fits) -> tuple[int, ...]:
    """The fitting split with the smallest sum of squared stage sums (earlier stages larger
    on ties). A sum of squares adds up stage by stage, so this DP is exact."""
    n = len(prefix) - 1
    cost = [0.0] + [math.inf] * n
    choice: list[list[int]] = []
    for k in range(1, num_stages + 1):
        row, picks = [math.inf] * (n + 1), [-1] * (n + 1)
        for j in range(k, n - (num_stages - k) + 1):
            # latest cut first, kept on a tie: earlier stages larger
            for i in range(j - 1, k - 2, -1):
                if cost[i] == math.inf or not fits(i, j):
                    continue
                value = cost[i] + (prefix[j] - prefix[i]) ** 2
                if value < row[j] and not math.isclose(value, row[j], rel_tol=1e-12):
                    row[j], picks[j] = value, i
        cost = row
        choice.append(picks)
    assert cost[n] < math.inf, "no fitting split: the limits come from a feasible split"
    bounds = [n]
    for picks in reversed(choice):
        bounds.append(picks[bounds[-1]])
    return tuple(reversed(bounds))

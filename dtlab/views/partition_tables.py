"""Text and tables for a pipeline partition: per stage, what it holds and what it costs."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

from dtlab.analysis.timing import Spread
from dtlab.records import JobInfo
from dtlab.views.tables import Table

MIB = 2**20


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.2f}"


def balance_table(balance, recent: Spread | None = None) -> Table:
    """One row per stage: blocks, parameters, memory, time per micro-batch; ``recent``:
    the step time's spread over the last steps (one step's schedule is noisy)."""
    rows = tuple(
        (
            str(s.stage),
            "-" if s.rank is None else str(s.rank),
            _span(s.blocks),
            f"{s.num_params:,}",
            _mib(s.param_bytes),
            _mib(s.grad_bytes),
            _mib(s.optimizer_bytes),
            _mib(s.activation_bytes),
            _ms(s.forward_s),
            _ms(s.backward_s),
        )
        for s in balance.stages
    )
    kind = "measured" if balance.measured else "predicted"
    facts = [
        f"{balance.schedule}, {microbatches_text(balance.microbatches)}",
        *balance_facts(balance, "slowest stage / mean"),
    ]
    notes = [f"{kind}: " + "; ".join(facts)]
    if recent is not None:
        notes.append(
            f"step time over the last {recent.n} steps: median {_ms(recent.median)} ms "
            f"(IQR {_ms(recent.low)}-{_ms(recent.high)} ms); the stage times are the last step's"
        )
    if any(s.forward_s is None for s in balance.stages):
        notes.append("times per block come from profiling: %dt_partition --profile")
    headers = (
        "stage",
        "rank",
        "blocks",
        "params",
        "param MiB",
        "grad MiB",
        "optim MiB",
        "activ. MiB",
        "fwd ms/mb",
        "bwd ms/mb",
    )
    return Table("pipeline stages", headers, rows, tuple(notes))


def microbatches_text(n: int) -> str:
    """``1 micro-batch``, ``4 micro-batches``."""
    return f"{n} micro-batch" if n == 1 else f"{n} micro-batches"


def balance_facts(balance, imbalance: str = "imbalance") -> list[str]:
    """Step time, bubble and imbalance, those known so far (for titles and notes)."""
    facts = []
    if balance.step_s is not None:
        facts.append(f"step {balance.step_s * 1e3:.1f} ms")
    if balance.bubble is not None:
        facts.append(f"bubble {balance.bubble:.0%}")
    if balance.imbalance is not None:
        facts.append(f"{imbalance} {balance.imbalance:.2f}x")
    return facts


def _span(blocks) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


LINE_WIDTH = 100  # characters of a printed summary line: fits a 1280 px notebook


def pipeline_summary(infos: Mapping[int, JobInfo]) -> str:
    """One line for a job whose ranks hold different parameters (one stage each)."""
    counts = {r: sum(p.numel for p in i.params) for r, i in sorted(infos.items())}
    per_rank = ", ".join(f"rank {r}: {n:,}" for r, n in counts.items())
    info = infos[min(infos)]
    line = (
        f"pipeline attached on {len(infos)} ranks, one stage each ({per_rank} values; "
        f"{sum(counts.values()):,} in all), {info.optimizer}; %dt_partition shows the "
        "balance"
    )
    # broken between words: an output area wraps where the line meets its edge, which may
    # be in the middle of "53,376"
    return textwrap.fill(line, width=LINE_WIDTH, break_long_words=False, break_on_hyphens=False)

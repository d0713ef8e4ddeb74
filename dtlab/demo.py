"""The built-in demo job on every rank of the live session (what ``%dt_demo`` runs).

A tiny DeepSeek-style language model (4 transformer blocks, one with a top-2 mixture of
experts) on a synthetic token stream, DDP-wrapped, data sharded with DistributedSampler;
see :mod:`dtlab.agent.demo_model`.
"""

from __future__ import annotations

from dtlab.records import JobInfo


def _attach_on_rank(ddp: bool, record: bool, lr: float, config: dict) -> JobInfo:
    from dtlab.agent.demo_job import attach_demo

    return attach_demo(ddp=ddp, record=record, lr=lr, **config)


def attach(
    session=None, *, ddp: bool = True, record: bool = True, lr: float = 3e-3, **config
) -> dict[int, JobInfo]:
    """Attach the demo job on every rank; ``config`` overrides DemoConfig fields
    (e.g. ``num_layers=6``). Returns ``{rank: JobInfo}``."""
    from dtlab.control import lifecycle

    session = session or lifecycle.current()
    infos = session.run(_attach_on_rank, ddp, record, lr, dict(config))
    session.set_job_setup(_attach_on_rank, ddp, record, lr, dict(config))  # fresh engines
    return infos

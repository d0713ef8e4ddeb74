"""The built-in demo job on every rank of the live session (what ``%dt_demo`` runs;
``dtlab.demo`` is this module).

A tiny DeepSeek-style language model (4 transformer blocks, one with a top-2 mixture of
experts) on a synthetic token stream, DDP-wrapped, data sharded with DistributedSampler;
see :mod:`dtlab.agent.demo_model`.
"""

from __future__ import annotations

from typing import Any

from dtlab.agent import api
from dtlab.control import lifecycle
from dtlab.control.errors import RankError
from dtlab.control.session import Session
from dtlab.records import JobInfo, PlanError


def attach(
    session: Session | None = None,
    *,
    ddp: bool = True,
    record: bool = True,
    lr: float = 3e-3,
    **config,
) -> dict[int, JobInfo]:
    """Attach the demo job on every rank; ``config`` overrides DemoConfig fields
    (e.g. ``num_layers=6``). Returns ``{rank: JobInfo}``."""
    session = session or lifecycle.current()
    infos = session.world.run(api.attach_demo, ddp, record, lr, dict(config))
    session.checkpointing.set_job_setup(
        api.attach_demo, ddp, record, lr, dict(config)
    )  # fresh engines
    return infos


def attach_pipeline(
    session: Session | None = None,
    *,
    plan: Any = "uniform",
    microbatches: int = 4,
    schedule: str = "gpipe",
    record: bool = True,
    lr: float = 3e-3,
    **config,
) -> dict[int, JobInfo]:
    """Attach the demo as a pipeline, one stage per rank split by ``plan`` (a form
    :func:`dtlab.analysis.partition.parse_plan` reads; not ``measured``, which needs a
    running job). A bad plan raises PlanError (read alike on every rank)."""
    session = session or lifecycle.current()
    options = {"plan": plan, "microbatches": microbatches, "schedule": schedule}
    try:
        infos = session.world.run(api.attach_demo_pipeline, record, lr, dict(config), **options)
    except RankError as e:  # every rank reads the plan alike: one PlanError, not N
        said = {(f.ename, f.evalue) for f in e.failures.values()}
        if len(said) == 1 and next(iter(said))[0] == "PlanError" and not e.stuck:
            raise PlanError(next(iter(said))[1]) from None
        raise
    session.checkpointing.set_job_setup(
        api.attach_demo_pipeline, record, lr, dict(config), **options
    )
    return infos

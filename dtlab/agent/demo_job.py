"""Attach the built-in demo job (:mod:`dtlab.agent.demo_model`) on this rank."""

from __future__ import annotations

import torch

from dtlab.agent.attach import attach
from dtlab.agent.demo_model import (
    DemoConfig,
    DemoLM,
    build_demo,
    next_token_loss,
    pipeline_data,
    split_tokens,
    warmup_schedule,
)
from dtlab.agent.rendezvous import identity
from dtlab.agent.state import RANK
from dtlab.records import JobInfo


def attach_demo(
    *,
    ddp: bool = True,
    record: bool = True,
    lr: float = 3e-3,
    accumulate: int = 1,
    no_sync: bool = True,
    scaler: bool = False,
    sharding: str | None = None,
    **config,
) -> JobInfo:
    """Build the demo (same weights on every rank, data sharded by DistributedSampler) and
    attach it. ``ddp`` wraps it in DistributedDataParallel when there is more than one rank;
    ``scaler`` adds a GradScaler; ``accumulate``/``no_sync`` as for dtlab.attach;
    ``sharding``: ``"fsdp2"`` or ``"zero"`` (see build_demo)."""
    me = identity()
    # kept for a closer look from a %%dt cell, and for dtlab.inject's data faults
    RANK.demo = demo = build_demo(
        DemoConfig(**config),
        rank=me.rank,
        world_size=me.world_size,
        ddp=ddp and me.world_size > 1,
        lr=lr,
        device=me.device,
        sharding=sharding,
    )
    # a GradScaler as mixed-precision jobs use it (it scales the loss on CPU too)
    grad_scaler = torch.amp.GradScaler(me.device.split(":")[0], init_scale=2.0**10)
    return attach(
        demo.model,
        demo.optimizer,
        demo.data,
        demo.loss_fn,
        scheduler=demo.scheduler,
        scaler=grad_scaler if scaler else None,
        record=record,
        on_epoch=demo.sampler.set_epoch,
        accumulate=accumulate,
        no_sync=no_sync,
    )


def attach_demo_pipeline(
    *,
    plan="uniform",
    microbatches: int = 4,
    schedule: str = "gpipe",
    record: bool = True,
    lr: float = 3e-3,
    **config,
) -> JobInfo:
    """The demo model as a pipeline: its blocks (embed, blocks.0.., norm, head) split into
    one stage per rank by ``plan``; every rank reads the same batches."""
    from dtlab.agent.pipeline_job import attach_pipeline

    c = DemoConfig(**config)
    torch.manual_seed(c.seed)  # every rank builds identical weights, keeps its own blocks
    model = DemoLM(c).to(identity().device)
    data = pipeline_data(c)
    return attach_pipeline(
        model,
        lambda params: torch.optim.AdamW(params, lr=lr),
        data,
        next_token_loss,
        split_batch=split_tokens,
        plan=plan,
        microbatches=microbatches,
        schedule=schedule,
        make_scheduler=warmup_schedule,
        record=record,
        on_epoch=data.sampler.set_epoch,
    )

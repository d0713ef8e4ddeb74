"""A pipeline-parallel job: each rank holds one stage and steps it with torch's schedules.

Runs on each rank. The user's code builds an ordinary model and hands over its blocks::

    dtlab.attach_pipeline(model, make_optimizer, loader, loss_fn,
                          split_batch=lambda b: (b["x"], b["y"]), plan="parameters")

One step: next batch (every stage draws the same one, so data position is the same on all)
-> ``torch.distributed.pipelining`` runs the micro-batches (GPipe or 1F1B) -> the last
stage's mean micro-batch loss is broadcast so every rank records it -> optimizer step on
this stage's parameters. Gradients are averaged over micro-batches (the schedule's
``scale_grads``), so the maths equals one process accumulating the same micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from dtlab.agent import job as jobs
from dtlab.agent.groups import control_group
from dtlab.agent.pipeline_stage import (
    InputCapture,
    StageModule,
    TimedStage,
    block_sizes,
    ordered_blocks,
    profile_block,
)
from dtlab.analysis.partition import parse_plan
from dtlab.records import Plan
from dtlab.records.stages import BlockCost, StageReport

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def attach_pipeline(
    model: Any,
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    data: Iterable,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    split_batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    plan: Any = "uniform",
    microbatches: int = 4,
    schedule: str = "gpipe",
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    record: bool = True,
    indices: Callable[[Any], Iterable[int]] | None = None,
    on_epoch: Callable[[int], None] | None = None,
):
    """Hand this rank's share of a pipeline job to dtlab (call it on every rank, with the
    same model on each: the rank keeps its stage's blocks and lets go of the rest).

    ``model``: an ``nn.Sequential``, ``(name, module)`` pairs, or a model whose top-level
    children (ModuleLists opened) run in order. ``loss_fn(output, target)`` runs on the
    last stage; ``split_batch(batch) -> (inputs, target)``. ``make_optimizer(params)``
    and ``make_scheduler(optimizer)`` are called again when blocks move between ranks.
    ``plan``: any form :func:`dtlab.analysis.partition.parse_plan` reads but ``measured``
    (which needs a running job: use ``dt.repartition("measured")`` after a few steps).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose one of {sorted(SCHEDULES)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be at least 1, got {microbatches}")
    blocks = ordered_blocks(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    names = [name for name, _ in blocks]
    sizes = {c.name: c for c in block_sizes(StageModule(blocks))}
    chosen = parse_plan(plan, names, world, costs=sizes)
    mine = dict(blocks)
    stage = StageModule([(n, mine[n]) for n in chosen.stage_blocks(rank)])
    del blocks, mine  # the other stages' blocks are freed unless the caller keeps them
    job = PipelineJob(
        stage,
        chosen,
        make_optimizer,
        make_scheduler,
        data,
        loss_fn,
        split_batch=split_batch,
        microbatches=microbatches,
        schedule=schedule,
        record=record,
        indices=indices,
        on_epoch=on_epoch,
    )
    jobs.install(job)
    return job.info


def current() -> PipelineJob:
    job = jobs.current()
    if not isinstance(job, PipelineJob):
        raise RuntimeError(
            f"the attached job is a {type(job).__name__}, not a pipeline: attach one with "
            "dtlab.attach_pipeline(...) or %dt_demo --pipeline"
        )
    return job


class PipelineJob(jobs.Job):
    """One rank's stage of a pipeline job; ``step()`` runs one schedule and records it."""

    def __init__(
        self,
        stage: StageModule,
        plan: Plan,
        make_optimizer,
        make_scheduler,
        data,
        loss_fn,
        *,
        split_batch,
        microbatches,
        schedule,
        record=True,
        indices=None,
        on_epoch=None,
    ):
        self.plan = plan
        self.make_optimizer = make_optimizer
        self.make_scheduler = make_scheduler
        self.split_batch = split_batch
        self.stage_loss = loss_fn
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.stage_index = dist.get_rank()
        self.costs: dict[str, BlockCost] = {}
        self.last_step_s: float | None = None
        self.last_events: tuple = ()
        self.last_clock_start: float | None = None
        self.last_target: torch.Tensor | None = None
        optimizer = make_optimizer(stage.parameters())
        scheduler = make_scheduler(optimizer) if make_scheduler else None
        super().__init__(
            stage,
            optimizer,
            data,
            _unused_loss,
            scheduler=scheduler,
            record=record,
            indices=indices,
            on_epoch=on_epoch,
        )
        self._build_schedule()

    def _build_schedule(self) -> None:
        world = dist.get_world_size()
        # self._now syncs CUDA first: events time kernels, not their launches
        self.timed = TimedStage(self.module, self.stage_index, world, self.device, clock=self._now)
        self.runner = SCHEDULES[self.schedule_name](
            self.timed, n_microbatches=self.microbatches, loss_fn=self._loss
        )
        self.capture = InputCapture(self.module, self.timed)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.timed.current_microbatch == 0:  # kept to profile the last block with it
            self.last_target = target.detach()
        return self.stage_loss(output, target)

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.plan.num_stages - 1

    def _accumulate(self):
        """One schedule over the micro-batches of one batch (dtlab's Job times it)."""
        t0 = self._now()
        batch = self._next_batch()
        epoch = self.stream.epoch
        self._epoch_starts = ()  # one batch a step: an epoch can only begin at its start
        inputs, target = self.split_batch(batch)
        t1 = self._now()
        self.timed.reset_clock()
        losses: list = []
        if self.stage_index == 0:
            self.runner.step(inputs.to(self.device), return_outputs=False)
        elif self.is_last:
            self.runner.step(target=target.to(self.device), losses=losses, return_outputs=False)
        else:
            self.runner.step(return_outputs=False)
        t2 = self._now()
        self.last_events, self.last_step_s = tuple(self.timed.events), t2 - t1
        self.last_clock_start = self.timed.started
        loss = self._share_loss(losses)
        forward = sum(e.end - e.start for e in self.last_events if e.phase == "F")
        indices = tuple(int(i) for i in self.indices(batch))
        return loss, indices, epoch, [t1 - t0, forward, (t2 - t1) - forward]

    def _share_loss(self, losses: Sequence[torch.Tensor]) -> float:
        """The last stage's mean micro-batch loss, on every rank (one small broadcast)."""
        value = math.fsum(float(x.detach()) for x in losses) / len(losses) if losses else 0.0
        box = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(box, src=self.plan.num_stages - 1, group=control_group())
        return float(box.item())

    # --- what the notebook asks ---------------------------------------------------------
    def profile(self, repeats: int = 3) -> list[BlockCost]:
        """Measure each of this stage's blocks on the inputs of the last step's first
        micro-batch (run a step first); kept for the ``measured`` plan."""
        missing = [n for n in self.module.order if n not in self.capture.inputs]
        if missing:
            raise RuntimeError(
                f"no input recorded yet for {missing}: run at least one step (%dt_step) "
                "before profiling blocks"
            )
        costs = [
            profile_block(
                n,
                self.module.block(n),
                self.capture.inputs[n],
                repeats=repeats,
                clock=self._now,
                loss=self._profile_loss(n),
            )
            for n in self.module.order
        ]
        self.costs.update({c.name: c for c in costs})
        return costs

    def _profile_loss(self, block: str):
        """The loss on the model's last block (the schedule computes it on that stage)."""
        if block != self.plan.blocks[-1] or self.last_target is None:
            return None
        target = self.last_target
        return lambda output: self.stage_loss(output, target)

    def report(self) -> StageReport:
        params = list(self.module.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        optim = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
        costs = tuple(self.costs.get(c.name, c) for c in block_sizes(self.module))
        activations = [c.activation_bytes for c in costs]
        return StageReport(
            rank=dist.get_rank(),
            stage=self.stage_index,
            blocks=tuple(self.module.order),
            num_params=sum(p.numel() for p in params),
            param_bytes=param_bytes,
            grad_bytes=grads,
            optimizer_bytes=optim,
            activation_bytes=None if None in activations else sum(activations),
            microbatches=self.microbatches,
            schedule=self.schedule_name,
            step=self.step_count,
            step_s=self.last_step_s,
            events=self.last_events,
            costs=costs,
            clock_start=self.last_clock_start,
        )

    @contextlib.contextmanager
    def hooks_off(self):
        """dtlab's own hooks off (they are closures: a block carrying one cannot be
        serialised to move), back on afterwards."""
        watching, outputs = bool(self.watcher.handles), self.recording_outputs
        self.watcher.watch(False)
        self.outputs.record(False)
        self.capture.remove()
        try:
            yield
        finally:
            self.capture = InputCapture(self.module, self.timed)
            self.watcher.watch(watching)
            self.record_outputs(outputs)

    def rebind(self, stage: StageModule, plan: Plan, optimizer, scheduler) -> None:
        """Take over a new stage (after blocks moved): hooks, names and schedule follow."""
        watching, outputs = bool(self.watcher.handles), self.recording_outputs
        self.watcher.watch(False)
        self.outputs.record(False)
        self.capture.remove()
        self.model = self.module = stage
        self.optimizer, self.scheduler, self.plan = optimizer, scheduler, plan
        self.names, self.params = zip(*stage.named_parameters(), strict=True)
        self.watcher = type(self.watcher)(stage)
        self.outputs = type(self.outputs)(stage)
        self.watcher.watch(watching)
        self.record_outputs(outputs)
        if any(True for _ in stage.buffers()):
            stage.register_forward_pre_hook(self._snapshot_buffers)
        self.costs = {n: c for n, c in self.costs.items() if n in stage.order}
        self.info = self._describe(self.records.maxlen or jobs.DEFAULT_CAPACITY)
        self._build_schedule()


def _unused_loss(model, batch):  # the schedule computes the loss on the last stage
    raise AssertionError("a pipeline job's loss is computed by its schedule")

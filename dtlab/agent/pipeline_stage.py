"""One rank's pipeline stage: its blocks, timed per micro-batch, and profiled per block.

Runs on each rank (pure torch). The model stays ordinary code: it is seen as an ordered
sequence of *blocks* (:func:`ordered_blocks`) and a stage is a module that holds a
contiguous run of them under their names in the whole model (``blocks.1.attn.qkv.weight``
keeps its name on whichever rank holds it), so records, checkpoints and plans line up
across ranks and across re-partitions.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dtlab.records.stages import BlockCost, ScheduleEvent


def ordered_blocks(
    model: nn.Module | Iterable[tuple[str, nn.Module]],
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` in order: an ``nn.Sequential``'s children, a list of
    ``(name, module)``, or a model's top-level children with ``ModuleList``s opened up
    (``embed, blocks.0, ..., blocks.3, norm, head``: its forward must apply them in that
    order, as the demo model's does)."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if not isinstance(model, nn.Module):
        blocks = list(model)
        for item in blocks:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], nn.Module)):
                raise TypeError(f"blocks must be (name, nn.Module) pairs, got {item!r:.80}")
        return blocks
    blocks = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            blocks.extend((f"{name}.{i}", block) for i, block in enumerate(child))
        else:
            blocks.append((name, child))
    return blocks


class StageModule(nn.Module):
    """The blocks one rank runs, applied in order, registered under their full names."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.order = [name for name, _ in blocks]
        for name, block in blocks:
            *path, leaf = name.split(".")
            parent: nn.Module = self
            for part in path:  # "blocks.1" -> a container "blocks" holding "1"
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, block)

    def block(self, name: str) -> nn.Module:
        return self.get_submodule(name)

    def forward(self, x):
        for name in self.order:
            x = self.get_submodule(name)(x)
        return x


class TimedStage(PipelineStage):
    """torch's pipeline stage, with each micro-batch's forward and backward timed.

    The events are the compute of this stage only; the gaps between them are waiting for
    neighbours (the bubble) and sending activations."""

    def __init__(self, *args, clock=time.perf_counter, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.events: list[ScheduleEvent] = []
        self.started = 0.0
        self.current_microbatch = -1

    def reset_clock(self) -> None:
        self.events, self.started = [], self.clock()

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.current_microbatch = fwd_chunk_id
        start = self.clock()
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self._event(fwd_chunk_id, "F", start)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        start = self.clock()
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self._event(bwd_chunk_id, "B", start)

    def _event(self, microbatch: int, phase: str, start: float) -> None:
        end = self.clock()
        self.events.append(
            ScheduleEvent(
                self.stage_index, microbatch, phase, start - self.started, end - self.started
            )
        )


def block_sizes(stage: StageModule) -> list[BlockCost]:
    """Parameter counts and bytes of each block the stage holds (no timing)."""
    costs = []
    for name in stage.order:
        params = list(stage.block(name).parameters())
        costs.append(
            BlockCost(
                name,
                sum(p.numel() for p in params),
                sum(p.numel() * p.element_size() for p in params),
            )
        )
    return costs


def profile_block(
    name: str,
    block: nn.Module,
    sample: torch.Tensor,
    *,
    repeats: int = 3,
    clock=time.perf_counter,
    loss=None,
) -> BlockCost:
    """Time one micro-batch's forward and backward through ``block`` from the input it saw
    in training, and count what autograd keeps for the backward (parameters excluded).
    ``loss(output)``, for the model's last block: its cost belongs to that block's stage.

    Leaves the job as it was: gradients come back from ``autograd.grad`` instead of
    landing in ``.grad``, and the RNG (dropout) is restored afterwards."""
    params = [p for p in block.parameters() if p.requires_grad]
    param_ptrs = {p.data_ptr() for p in block.parameters()}
    forward, backward, saved = [], [], [0]

    def pack(t: torch.Tensor):
        if t.data_ptr() not in param_ptrs:
            saved[0] += t.numel() * t.element_size()
        return t

    devices = [sample.device] if sample.device.type == "cuda" else []
    buffers = {name: b.detach().clone() for name, b in block.named_buffers()}
    with torch.random.fork_rng(devices=devices), _buffers_restored(block, buffers):
        for attempt in range(repeats + 1):  # the first one warms up
            x = sample.detach().requires_grad_(sample.is_floating_point())
            saved[0] = 0
            t0 = clock()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(x)
                if loss is not None:
                    out = loss(out)
            t1 = clock()
            inputs = params + ([x] if x.requires_grad else [])
            if inputs and out.requires_grad:
                torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)
            t2 = clock()
            if attempt:
                forward.append(t1 - t0)
                backward.append(t2 - t1)
    size = sum(p.numel() for p in block.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in block.parameters())
    return BlockCost(
        name, size, nbytes, statistics.median(forward), statistics.median(backward), saved[0]
    )


@contextlib.contextmanager
def _buffers_restored(block: nn.Module, saved: dict[str, torch.Tensor]):
    """Buffers as they were (a BatchNorm's running statistics move in every forward)."""
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in block.named_buffers():
                buffer.copy_(saved[name])


class InputCapture:
    """Keeps each block's input of micro-batch 0 of the last step (detached), so blocks
    can be profiled on real activations without running a step for it."""

    def __init__(self, stage: StageModule, timed: TimedStage | None = None) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.timed = timed
        self.handles = [
            stage.block(name).register_forward_pre_hook(self._hook(name)) for name in stage.order
        ]

    def _hook(self, name: str):
        def keep(module, args):
            if self.timed is not None and self.timed.current_microbatch == 0 and args:
                if isinstance(args[0], torch.Tensor):
                    self.inputs[name] = args[0].detach()

        return keep

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

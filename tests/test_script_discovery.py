"""How a script's model, optimizers and micro-batches are told, in one process: models in
lists and in parts, dead weak proxies, optimizer containers, chunked losses, and the
forwards dtlab leaves alone (activation checkpointing's recompute, dispatch modes)."""

from __future__ import annotations

import functools
import gc
import types
import weakref

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from dtlab.agent import script_job, script_observe, step_observer
from dtlab.agent.state import RANK


class Container(torch.optim.Optimizer):
    """torchtitan's form: one AdamW per part, its own param_groups without an LR."""

    def __init__(self, parts):
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-3) for p in parts]
        torch.optim.Optimizer.__init__(self, [q for p in parts for q in p.parameters()], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()


def _run(forwards=()):
    observer = types.SimpleNamespace(draft=step_observer.StepDraft(forwards=list(forwards)))
    return types.SimpleNamespace(observer=observer, module=types.ModuleType("__main__"))


def test_a_model_held_in_a_list_is_found_and_a_dead_weak_proxy_is_not_touched():
    class Trainer:
        def __init__(self):
            self.model_parts = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))]

    trainer = Trainer()
    gone = torch.nn.Linear(2, 2)
    trainer.hooks = [weakref.proxy(gone)]  # isinstance() on it raises ReferenceError
    del gone
    optimizer = torch.optim.SGD(trainer.model_parts[0].parameters(), lr=0.1)
    objects = script_job._frames_objects(_run())  # this frame: trainer, optimizer
    assert script_job._modules_in(gc.get_objects())  # the fallback meets the proxy too
    assert trainer.model_parts[0] in [o for o in objects if isinstance(o, torch.nn.Module)]
    model = script_job._find_model(_run(), [optimizer], objects)
    assert model is trainer.model_parts[0]


def test_parts_no_module_owns_are_one_model_and_a_containers_optimizers_update():
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
    container = Container(parts)
    inner = script_job.inner_optimizers(container)
    assert inner == container.optimizers
    assert script_job.inner_optimizers(inner[0]) == []
    model = script_job._find_model(_run(), [container, *inner], [parts])
    assert isinstance(model, script_job.ModelParts) and model.parts == parts
    assert [n for n, _ in model.named_parameters()][:1] == ["part0.weight"]


def test_the_step_loss_is_the_scripts_whatever_backward_calls_it_takes():
    observer = step_observer.Observer(lambda kind, opt: None)
    model, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    part_of = {id(model): 0}.get

    def forward(module):
        observer.draft.forwards.append((module, (), None, None))

    def loss(value):
        observer.add_loss(torch.tensor(value))
        observer.draft.backward_calls += 1

    # a chunked loss: one forward, a backward per chunk (head called outermost), the total
    forward(model)
    for _ in range(4):
        forward(head)
        loss(0.25)
    loss(1.0)
    assert observer.step_loss(observer.take_draft(), lambda m: part_of(id(m))) == (1.0, 1)
    # accumulation: forward, backward per micro-batch, each a micro-batch's loss
    for value in (0.5, 0.75):
        forward(model)
        loss(value)
    assert observer.step_loss(observer.take_draft(), lambda m: part_of(id(m))) == (1.25, 2)
    # a pipeline schedule: every forward first, then every backward
    forward(model), forward(model), loss(0.5), loss(0.25)
    assert observer.step_loss(observer.take_draft(), lambda m: part_of(id(m))) == (0.75, 2)
    # no forward seen (recording off): each backward a micro-batch, as before
    loss(0.5), loss(0.5)
    assert observer.step_loss(observer.take_draft(), lambda m: part_of(id(m))) == (1.0, 2)


def _policy(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_forwards_in_a_recompute_or_a_dispatch_mode_are_left_alone():
    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    context = functools.partial(create_selective_checkpoint_contexts, _policy)
    boundaries: list[str] = []
    observer = step_observer.Observer(lambda kind, opt: boundaries.append(kind))
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
    script_observe.install(observer)
    try:
        for _ in range(2):
            x = torch.randn(4, 8)
            for block in blocks:  # each block outermost, checkpointed: SAC's caching mode
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
            x[:, :4].sum().backward()  # recompute inside backward: seen by no hook of dtlab's
            optimizer.step()
            optimizer.zero_grad()
    finally:
        script_observe.uninstall()
    assert boundaries == ["pre", "step", "step"]
    # the blocks ran under SAC's caching mode and again in the recompute: neither is seen
    assert observer.draft.forwards == [] and observer.draft.backward_calls == 2
    assert observer.off == set() and RANK.observer is None

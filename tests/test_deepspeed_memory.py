"""How a DeepSpeed step's memory is counted (``deepspeed_observe.model_state`` and
``step_memory``), without ranks: engines laid out the way DeepSpeed's ZeRO-2 and ZeRO-3
optimizers lay out their tensors on rank 1 of 4 (flat buffers, views into them, a cloned
fp32 master partition, a gradient partition), built by hand. What DeepSpeed really holds
is checked on 4 live ranks in tests/test_deepspeed_live.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtlab.agent import deepspeed_observe
from dtlab.agent.deepspeed_observe import Held, model_state, step_memory
from dtlab.agent.step_observer import Observer

RANKS, RANK = 4, 1
CPU = torch.device("cpu")


class Engine:
    """What of a DeepSpeedEngine the counting reads (a weakly referable, hashable object,
    as an engine is: the count taken before an update is kept per engine)."""

    def __init__(self, **attributes):
        vars(self).update(attributes)


@pytest.fixture(autouse=True)
def _rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: RANK)


def test_held_counts_each_storage_range_once():
    flat = torch.zeros(100)
    held = Held()
    held.add_all([flat[:60], flat[40:80], flat[:10], None, torch.zeros(0)])
    assert held.nbytes() == 80 * 4  # [0, 80), the overlap once
    held.add(flat)
    assert held.nbytes() == 100 * 4
    grid = torch.zeros(8, 10, dtype=torch.float64)
    column = Held()
    column.add(grid[:, 3])  # strided: the span it reaches, row 0 col 3 to row 7 col 3
    assert column.nbytes() == (7 * 10 + 1) * 8
    minus = Held()
    minus.add(flat[:30])
    assert held.nbytes(minus=minus) == 70 * 4


def adamw_after_a_step(master: torch.Tensor) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW([master], lr=0.1)
    master.grad = torch.ones_like(master)
    optimizer.step()
    master.grad = None  # DeepSpeed drops the master's gradient after the update
    return optimizer


def zero2_engine():
    """ZeRO-2's layout: the model's parameters are views into one flat buffer, each rank
    owns a quarter of it with an fp32 master copy (a clone), and after the backward its
    reduced gradient partition is in ``averaged_gradients``."""
    model = torch.nn.Linear(16, 32)  # 544 parameters, 136 a rank
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    parts = list(flat.chunk(RANKS))
    master = parts[RANK].clone()
    grads = torch.randn(flat.numel() // RANKS)
    zero = SimpleNamespace(
        bit16_groups_flat=[flat],
        parallel_partitioned_bit16_groups=[parts],
        real_dp_process_group=[None],
        single_partition_of_fp32_groups=[master],
        averaged_gradients={0: [grads[:100], grads[100:]]},
        all_grad_tensors={0: None},
        grads_in_partition=None,
        ipg_buckets={},
    )
    zero.optimizer = adamw_after_a_step(master)
    return Engine(module=model, optimizer=zero, basic_optimizer=zero.optimizer, global_steps=3)


def zero3_engine():
    """ZeRO-3's layout: each parameter empty between uses, its partition (``ds_tensor``) a
    view into one flat buffer, an fp32 master copy of that, and the gradient partition
    buffer ZeRO-3 allocates once and keeps."""
    model = torch.nn.Linear(16, 32)
    params = list(model.parameters())
    sizes = [-(-p.numel() // RANKS) for p in params]  # each parameter split 4 ways: 128 + 8
    flat = torch.zeros(sum(sizes))
    offset = 0
    for p, size in zip(params, sizes, strict=True):
        p.ds_tensor = flat[offset : offset + size]
        p.data = torch.empty(0)
        offset += size
    master = flat.clone()
    zero = SimpleNamespace(
        fp16_partitioned_groups_flat=[flat],
        fp32_partitioned_groups_flat=[master],
        grad_partitions_flat_buffer=torch.zeros(flat.numel()),
        averaged_gradients={0: None},
        ipg_buckets={},
    )
    zero.optimizer = adamw_after_a_step(master)
    return Engine(module=model, optimizer=zero, basic_optimizer=zero.optimizer, global_steps=3)


def test_zero2_counts_the_whole_model_the_master_partition_and_its_gradients():
    engine = zero2_engine()
    size = 544 * 4  # P: the model in fp32
    state = model_state(engine)
    assert state.model.nbytes() == size  # the flat buffer, each parameter a view into it
    assert state.partition.nbytes(minus=state.model) == 0  # a view into it too
    # params: P + P/4 (master); grads: the partition P/4; AdamW: 2 P/4 and its step
    assert state.nbytes() == (size + size // 4, size // 4, 2 * size // 4 + 4)


def test_zero3_counts_the_partition_its_master_copy_and_the_gradient_buffer():
    engine = zero3_engine()
    partition = (128 + 8) * 4  # every parameter split in 4 (the bias: 32 = 4 x 8)
    state = model_state(engine)
    assert state.model.nbytes() == 0  # the model's tensors are empty between uses
    assert state.nbytes() == (2 * partition, partition, 2 * partition + 4)


def test_a_step_counts_the_gradients_deepspeed_held_when_its_update_began():
    """ZeRO-2 frees the gradient partition inside engine.step(): the record, made after
    it, counts the bytes the observer saw just before the update, for that update only."""
    engine = zero2_engine()
    size = 544 * 4
    engine.get_lr = lambda: [0.1]
    observer = Observer(lambda kind, optimizer: None)
    observer.recording = False  # no full gradients (a collective through DeepSpeed)
    deepspeed_observe._before_update(observer, engine)
    engine.optimizer.averaged_gradients[0] = None  # what step() does, then counts the step
    engine.global_steps += 1
    memory = step_memory(engine, CPU, dtlab_bytes=7)
    assert (memory.param_bytes, memory.grad_bytes) == (size + size // 4, size // 4)
    assert memory.optimizer_bytes == 2 * size // 4 + 4 and memory.dtlab_bytes == 7
    assert memory.rss > 0
    # taken once: a record without an update since counts what is held now (nothing)
    assert step_memory(engine, CPU).grad_bytes == 0
    deepspeed_observe._before_update(observer, engine)
    engine.global_steps += 2  # not the update that count was for
    assert step_memory(engine, CPU).grad_bytes == 0

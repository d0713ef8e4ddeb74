"""A DeepSpeedEngine handed to ``dtlab.attach`` on 4 live ranks (tests/scripts/ds_attach.py
builds it; the same loop under torchrun gives the losses to match): ZeRO-2 with
accumulation, stepped one DeepSpeed update at a time, as ``loss_fn`` and as ``step=fn``,
losses bit-identical to torchrun's, the model's own names, the doctor clean; ZeRO-3's
whole-tensor fingerprints agreeing across ranks; what does not fit an engine refused."""

from __future__ import annotations

import math

import pytest

from dtlab.control.errors import RankError
from tests.conftest import untimed
from tests.test_deepspeed_live import config_file
from tests.test_script_live import SCRIPTS, losses_in, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]

BUILD = f"""
import sys
if {str(SCRIPTS)!r} not in sys.path:
    sys.path.insert(0, {str(SCRIPTS)!r})
import dtlab, ds_attach, torch
engine, loader = ds_attach.build({{config!r}})
"""

STEP_FN = """
def micro_batch(batch):  # one micro-batch, the loop's body
    loss = ds_attach.loss_fn(engine, batch)
    engine.backward(loss)
    engine.step()
    return loss
"""


@pytest.fixture(scope="module", autouse=True)
def _ops(deepspeed_ops):
    """DeepSpeed's CPU ops, built before the first test (conftest.deepspeed_ops)."""


def attach(dt, config: str, call: str = "dtlab.attach(engine, None, loader, ds_attach.loss_fn)"):
    dt.execute(BUILD.format(config=config) + STEP_FN + call)


def per_step(micro_losses: list[float], accumulation: int) -> list[float]:
    """Each update's loss as dtlab records it: the mean of its micro-batches' losses."""
    chunks = range(0, len(micro_losses), accumulation)
    return [math.fsum(micro_losses[i : i + accumulation]) / accumulation for i in chunks]


def test_a_zero2_engine_with_accumulation_steps_like_torchrun(live4, tmp_path):
    dt = live4
    config = config_file(tmp_path)  # ZeRO-2, accumulation 2, AdamW, WarmupLR, clipping
    torchrun(dt, "ds_attach.py", ["--config", config, "--steps", "4", "--out", str(tmp_path)])
    expected = {r: per_step(losses, 2) for r, losses in losses_in(tmp_path).items()}
    attach(dt, config)
    dt.step(4)
    info = dt.trace.jobs[0]
    assert (info.wrapper, info.model) == ("DeepSpeedEngine", "Sequential")
    assert [p.name for p in info.params] == NAMES  # the model's own, not ZeRO's partitions
    assert (info.deepspeed.zero_stage, info.deepspeed.accumulation) == (2, 2)
    assert "ZeRO stage 2" in info.optimizer and info.scheduler == "WarmupLR"
    assert info.data == "DeepSpeedDataLoader, DistributedSampler"
    recs = dt.trace.records
    assert {r: [rec.loss for rec in recs[r]] for r in recs} == expected  # bit for bit
    assert all(rec.micro_batches == 2 and not rec.skipped for r in recs for rec in recs[r])
    lrs = [rec.lr for rec in recs[0]]
    assert lrs == sorted(lrs) and 0 <= lrs[0] < lrs[-1] <= 0.001  # WarmupLR's, as used
    assert all(rec.grad_norm > 0 for rec in recs[0])  # whole, through safe_get_full_grad
    assert {len(rec.indices) for r in recs for rec in recs[r]} == {16}  # 2 x 8 samples
    firsts = [set(recs[r][0].indices) for r in range(4)]
    assert len(set().union(*firsts)) == 64  # DistributedSampler: disjoint shards
    assert len({recs[r][-1].param_fingerprint for r in recs}) == 1
    assert all(rec.memory.optimizer_bytes > 0 for rec in recs[0])
    assert untimed(dt.doctor()) == []

    attach(dt, config, "dtlab.attach(engine, step=micro_batch)")  # the same, as step=fn
    dt.step(4)
    recs = dt.trace.records
    assert {r: [rec.loss for rec in recs[r]] for r in recs} == expected
    assert [rec.micro_batches for rec in recs[0]] == [2] * 4
    assert [rec.lr for rec in recs[0]] == lrs
    assert {len(rec.indices) for rec in recs[0]} == {16}  # from the DataLoader's iterator
    assert untimed(dt.doctor()) == []


def test_a_zero3_engine_records_whole_tensors_that_agree_across_ranks(live4, tmp_path):
    dt = live4
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # partition every one
    attach(dt, config_file(tmp_path, zero_optimization=zero))
    dt.step(3)
    info = dt.trace.jobs[0]
    assert info.deepspeed.zero_stage == 3 and "ZeRO stage 3" in info.optimizer
    assert [p.name for p in info.params] == NAMES
    assert [p.shape for p in info.params] == [(32, 16), (32,), (1, 32), (1,)]  # not (0,)
    last = {r: recs[-1] for r, recs in dt.trace.records.items()}
    for field in ("param_fingerprints", "grad_fingerprints", "grad_norms"):
        assert len({getattr(rec, field) for rec in last.values()}) == 1, field
    assert all(p != 0 for p in last[0].grad_fingerprints)  # every gradient, whole
    full = 4 * sum(p.numel for p in info.params)
    # each rank holds its partition (a quarter) and DeepSpeed's fp32 master copy of it,
    # each padded by under one element per rank: not the whole model
    held = last[0].memory.param_bytes
    assert full / 2 <= held <= full / 2 + 2 * 4 * 4 and held < full, (held, full)
    first = dt.trace.records[0]
    assert first[0].param_fingerprint != first[-1].param_fingerprint  # the updates moved them
    assert untimed(dt.doctor()) == []


def test_what_does_not_fit_an_engine_is_refused_with_what_to_do(live4, tmp_path):
    dt = live4
    config = config_file(tmp_path)  # gradient_accumulation_steps 2
    with pytest.raises(RankError, match="accumulate=3, but the DeepSpeed engine's gradient"):
        attach(dt, config, "dtlab.attach(engine, None, loader, ds_attach.loss_fn, accumulate=3)")
    with pytest.raises(RankError, match="the DeepSpeed engine owns its optimizer: pass None"):
        attach(
            dt,
            config,
            "dtlab.attach(engine, torch.optim.SGD(engine.parameters(), lr=0.1), "
            "loader, ds_attach.loss_fn)",
        )
    attach(dt, config, "dtlab.attach(engine, None, loader, ds_attach.loss_fn, accumulate=2)")
    dt.step(1)
    dt.checkpoint_root = tmp_path / "checkpoints"
    with pytest.raises(Exception, match="checkpoints of an attached DeepSpeed engine are not"):
        dt.checkpoint()
    assert dt.step(1).last_step == 2  # the job steps on

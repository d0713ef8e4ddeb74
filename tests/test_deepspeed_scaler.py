"""DeepSpeed's fp16 loss scaler as the doctor sees it, without a live job: fp16 does not run
on CPU (test_deepspeed_live.py), so the scale and skipped steps are made here by DeepSpeed's
own code. Each test builds a DeepSpeedEngine from its real ds_config (``DeepSpeedConfig``,
its ``__init__`` not run: no process group, no model) holding the optimizer that owns the
scaler (ZeRO's ``DeepSpeedZeroOptimizer`` with its ``DynamicLossScaler``, or stage 0's
``FP16_Optimizer``), and steps the scaler as ``engine.step()`` does: an overflow when the
largest gradient times the scale is over fp16's maximum. Each step is recorded as
``deepspeed_observe`` records it (the scale through ``_loss_scale`` before the update,
skipped when the step was not applied, inf in the gradients then), on 4 ranks alike (the
overflow flag is all-reduced: every rank skips together), with ``describe(engine)`` as
``JobInfo.deepspeed``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from deepspeed import comm  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import (  # noqa: E402
    CreateLossScaler,
    LossScaleConfig,
    LossScaleProfile,
)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: E402

from dtlab.agent.deepspeed_observe import _loss_scale, describe  # noqa: E402
from dtlab.analysis.checks_training import check_numerics  # noqa: E402
from dtlab.records import Evidence  # noqa: E402
from tests.fakes import PARAMS, job_info, step_record  # noqa: E402

FP16_MAX = 65504.0
RANKS = 4


def ds_config(stage=2, **fp16) -> dict:
    return {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": True, "loss_scale": 0, **fp16},
    }


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    """DeepSpeed asks its comm for the rank (to log "OVERFLOW! ..." on rank 0 only, and in
    the config): rank 0, without a process group."""
    monkeypatch.setattr(comm, "get_rank", lambda group=None: 0)


def engine_for(config: dict) -> DeepSpeedEngine:
    """A DeepSpeedEngine of 4 data-parallel ranks on ``config``, with the optimizer (and
    loss scaler) ``deepspeed.initialize`` gives it for the config's ZeRO stage."""
    mpu = SimpleNamespace(get_data_parallel_world_size=lambda: RANKS)
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    torch.nn.Module.__init__(engine)
    engine.config, engine._config, engine.dp_world_size = config, DeepSpeedConfig(config, mpu), 4
    static, dynamic = engine.loss_scale(), engine.dynamic_loss_scale()
    args = engine.dynamic_loss_scale_args()
    if engine.zero_optimization_stage() == 0:
        optimizer = FP16_Optimizer.__new__(FP16_Optimizer)
        optimizer.custom_loss_scaler, optimizer.verbose = False, False
        optimizer.loss_scale_config = LossScaleConfig(
            torch.half, dynamic, static, args, profile=LossScaleProfile.FUSED
        )
    else:
        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
        optimizer.custom_loss_scaler = False
        optimizer.loss_scaler = CreateLossScaler(torch.half, static, dynamic, args)
    engine.optimizer = optimizer
    return engine


def run(config: dict, grad_max, steps: int):
    """Evidence of ``steps`` optimizer steps whose largest unscaled gradient is
    ``grad_max(step)``, ending early where DeepSpeed ends the run (ZeRO's scaler raises on
    an overflow at its minimum scale); and that error, if any."""
    engine = engine_for(config)
    records, error = [], None
    for step in range(1, steps + 1):
        scale = _loss_scale(engine)  # before step(), as deepspeed_observe reads it
        overflow = scale * grad_max(step) > FP16_MAX
        try:
            engine.optimizer._update_scale(overflow)  # what step() does at the boundary
        except Exception as e:  # "Current loss scale already at minimum ..."
            error = e
            break
        bad = (5, 0, 0, 0) if overflow else (0,) * len(PARAMS)
        records.append((step, scale, overflow, bad))
    by_rank = {
        r: [step_record(s, r, scale=sc, skipped=o, nonfinite=n) for s, sc, o, n in records]
        for r in range(RANKS)
    }
    jobs = {r: job_info(r, scaler=False, deepspeed=describe(engine)) for r in range(RANKS)}
    return Evidence(by_rank, tuple(p.name for p in PARAMS), jobs=jobs), error


def skipped_steps(evidence: Evidence) -> list[int]:
    return [rec.step for rec in evidence.records[0] if rec.skipped]


def healthy(step: int) -> float:
    """Gradients that fit fp16 at a scale of 8192 (not 16384), with a spike now and then."""
    return 40.0 if step in (333, 777) else 6.0


# --- the records' scale as deepspeed_observe reads it ------------------------------------


def test_the_loss_scale_is_read_from_zeros_optimizer_and_from_stage_0s():
    for stage in (0, 2):
        engine = engine_for(ds_config(stage, initial_scale_power=12))
        assert _loss_scale(engine) == 4096.0
        engine.optimizer._update_scale(True)  # hysteresis (ZeRO) or halved (stage 0)
        engine.optimizer._update_scale(True)
        assert _loss_scale(engine) == (2048.0 if stage else 1024.0)


def test_no_fp16_no_scale_and_describe_says_what_the_engine_made_of_the_config():
    engine = engine_for(ds_config(min_loss_scale=4))
    info = describe(engine)
    assert (info.zero_stage, info.micro_batch, info.accumulation) == (2, 8, 2)
    assert (info.train_batch, info.dp_world, info.precision) == (64, 4, "fp16")
    assert '"min_loss_scale": 4' in info.config
    bf16 = {**ds_config(), "fp16": {"enabled": False}, "bf16": {"enabled": True}}
    assert _loss_scale(engine_for(bf16)) is None
    assert describe(engine_for(bf16)).precision == "bf16"


def test_deepspeed_refuses_a_train_batch_size_that_is_not_micro_x_accumulation_x_world():
    """Why the doctor has no finding for it: every rank's engine stops at
    ``deepspeed.initialize`` (DeepSpeedConfig) before a step is made."""
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        engine_for({**ds_config(), "train_batch_size": 32})


# --- the doctor on the scaler's history --------------------------------------------------


def test_a_healthy_scaler_with_an_occasional_overflow_is_no_finding():
    evidence, error = run(ds_config(loss_scale_window=250), healthy, 1000)
    assert error is None
    skipped = skipped_steps(evidence)
    # calibration from 2**16 to 8192 (hysteresis first), then after each 250 clean steps the
    # scale doubles, overflows twice (hysteresis again) and halves back; a spike halves it
    assert skipped[:4] == [1, 2, 3, 4] and 333 in skipped and 777 in skipped
    assert 8 <= len(skipped) <= 16
    result = check_numerics(evidence)
    assert result.findings == () and "occasional overflow" in result.passed_because


def test_a_scaler_that_keeps_overflowing_is_named_with_its_history():
    # from step 61 the gradients overflow fp16 whatever the scale (inf before scaling), on
    # 3 micro-batch steps of every 4: ZeRO halves the scale at each, down to its minimum,
    # and ends the run at the next overflow there
    def blowing_up(step):
        return math.inf if step > 60 and step % 4 else healthy(step)

    evidence, error = run(ds_config(), blowing_up, 200)
    # the overflow after the scale reached 1 ended the run: its step has no record
    assert "Current loss scale already at minimum" in str(error)
    assert evidence.records[0][-1].step == 77
    [found] = check_numerics(evidence).findings
    assert (found.kind, found.ranks, found.step) == ("numerics", (0, 1, 2, 3), 61)
    later = [s for s in skipped_steps(evidence) if s >= 61]
    assert f"ranks 0-3: DeepSpeed's fp16 loss scaler skipped {len(later)} steps, up to 3 " in (
        found.summary
    )
    assert "in a row, from step 61 (13 of the 17 steps since)" in found.summary
    assert "scale 65536 at first, 2 at least, 2 now" in found.summary  # 2: the last one used
    history = found.evidence["scaler"][0]
    assert history["skipped_runs"][:2] == [[61, 63], [65, 67]]
    assert history["scale_changes"][:3] == [(60, 8192.0), (62, 4096.0), (63, 2048.0)]
    assert history["floor"] == 1.0
    assert '"OVERFLOW! Skipping step"' in found.fix and "bf16" in found.fix


def test_overflow_on_most_steps_is_named_even_in_short_runs():
    # consecutive_hysteresis: each clean step gives the hysteresis back, so overflowing 2
    # steps of 3 halves the scale only once per 3 steps and never skips 3 in a row
    def two_of_three(step):
        return math.inf if step > 60 and step % 3 else healthy(step)

    config = ds_config(consecutive_hysteresis=True)
    evidence, _ = run(config, two_of_three, 90)
    [found] = check_numerics(evidence).findings
    assert found.step == 61 and "up to 2 in a row" in found.summary
    assert "DeepSpeed's fp16 loss scaler" in found.summary


def test_a_scale_collapsed_to_min_loss_scale_is_named():
    # from step 41 the gradients grow 1.5x a step up to 50000: fp16 fits them only at a
    # scale of 1. Each overflow (one step in two) halves the scale until it sits at
    # min_loss_scale, where stage 0's scaler keeps it (no run of skips, no error)
    def growing(step):
        return healthy(step) if step <= 40 else min(50000.0, 6.0 * 1.5 ** (step - 40))

    evidence, error = run(ds_config(stage=0), growing, 120)
    assert error is None
    skipped = skipped_steps(evidence)
    assert skipped[0] == 1 and min(s for s in skipped if s > 10) > 40
    [found] = check_numerics(evidence).findings
    trouble = found.evidence["scaler"][0]
    assert trouble["floor"] == 1.0 and trouble["steps_at_floor"] > 50
    first = min(s for s in skipped if s > 40)
    assert found.step == first and trouble["last_scale"] == 1.0
    assert "DeepSpeed's fp16 loss scaler" in found.summary
    assert f"at its floor (fp16.min_loss_scale 1) on {trouble['steps_at_floor']} steps" in (
        found.summary
    )


def test_a_higher_min_loss_scale_is_the_floor():
    def plateau(step):
        return healthy(step) if step <= 40 else 3000.0  # fits at 16, overflows at 32

    evidence, _ = run(ds_config(min_loss_scale=16), plateau, 100)
    [found] = check_numerics(evidence).findings
    assert found.step == 41 and "fp16.min_loss_scale 16" in found.summary


def test_calibration_from_a_higher_initial_scale_is_no_finding():
    # initial_scale_power 32 (DeepSpeed's own default without a config): 2**32 down to
    # 8192 is 19 halvings after the hysteresis, then healthy
    evidence, _ = run(ds_config(initial_scale_power=32), healthy, 300)
    assert skipped_steps(evidence) == list(range(1, 21))
    assert check_numerics(evidence).findings == ()

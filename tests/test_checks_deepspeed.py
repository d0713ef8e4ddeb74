"""The doctor's DeepSpeed check as a pure function of per-rank job descriptions and
records (the live counterpart runs a ZeRO script: test_deepspeed_live.py)."""

from __future__ import annotations

import json

from dtlab.analysis.checks_deepspeed import check_deepspeed, fp16_scaler
from dtlab.analysis.checks_training import check_numerics
from dtlab.records import DeepSpeedInfo, Evidence
from tests.fakes import job_info, step_record

CONFIG = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 2},
}


def ds(base=CONFIG, **changes) -> DeepSpeedInfo:
    config = base
    fields = dict(
        zero_stage=config["zero_optimization"]["stage"],
        micro_batch=config["train_micro_batch_size_per_gpu"],
        accumulation=config["gradient_accumulation_steps"],
        train_batch=config["train_batch_size"],
        dp_world=4,
        precision="fp32",
        config=json.dumps(config, sort_keys=True),
    )
    return DeepSpeedInfo(**{**fields, **changes})


def evidence(infos, micro_batches=2, steps=3) -> Evidence:
    records = {
        r: [step_record(s, r, micro_batches=micro_batches) for s in range(1, steps + 1)]
        for r in infos
    }
    jobs = {r: job_info(r, deepspeed=info) for r, info in infos.items()}
    return Evidence(records, ("w",), jobs=jobs)


def test_the_same_config_followed_by_every_rank_passes_and_says_what_it_read():
    result = check_deepspeed(evidence({r: ds() for r in range(4)}))
    assert result.outcome == "passed"
    assert "4 ranks' ds_config (ZeRO stage 2; accumulation 2)" in result.looked_at
    assert "12 rank-steps" in result.looked_at


def test_a_job_without_deepspeed_passes_with_nothing_to_compare():
    result = check_deepspeed(evidence({r: None for r in range(2)}))
    assert result.outcome == "passed" and "does not run in DeepSpeed" in result.passed_because


def test_a_key_that_differs_on_one_rank_names_that_rank_and_both_values():
    odd = {**CONFIG, "gradient_clipping": 0.5}
    infos = {0: ds(), 1: ds(), 2: ds(odd), 3: ds()}
    [found] = check_deepspeed(evidence(infos)).findings
    assert found.kind == "deepspeed_config" and found.ranks == (2,)
    assert 'gradient_clipping: "(not set)" on ranks 0-1,3, 0.5 on rank 2' in found.summary


def test_what_the_engine_made_of_it_counts_even_without_the_json():
    infos = {0: ds(zero_stage=1, config=""), 1: ds(config="")}
    [found] = check_deepspeed(evidence(infos)).findings
    assert "(engine) zero stage: 1 on rank 0, 2 on rank 1" in found.summary
    assert found.ranks == (0, 1)  # no majority: both are named


def test_micro_batches_that_differ_from_the_accumulation_steps_are_an_error():
    [found] = check_deepspeed(evidence({0: ds(), 1: ds()}, micro_batches=4)).findings
    assert (found.kind, found.ranks, found.step, found.severity) == (
        "deepspeed_accumulation",
        (0, 1),
        1,
        "error",
    )
    assert "backward() 4 times per optimizer step, but gradient_accumulation_steps is 2" in (
        found.summary
    )


def test_options_idle_for_the_stage_or_precision_in_use_are_advice():
    config = {
        **CONFIG,
        "zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 10},
        "fp16": {"loss_scale": 0},  # no "enabled": fp16 stays off
        "bf16": {"enabled": False, "immediate_grad_update": True},  # off on purpose
    }
    [found] = check_deepspeed(evidence({0: ds(config)})).findings
    assert found.severity == "advice"
    assert "zero_optimization.stage3_prefetch_bucket_size (ZeRO stage 3 only" in found.summary
    assert "fp16.loss_scale (fp16 is not enabled)" in found.summary
    assert "bf16" not in found.summary


def test_the_fp16_scalers_floor_and_hysteresis_come_from_the_config():
    fp16 = {**CONFIG, "fp16": {"enabled": True, "min_loss_scale": 8, "hysteresis": 4}}
    assert fp16_scaler(ds(fp16, precision="fp16")) == (8.0, 4)
    assert fp16_scaler(ds({**CONFIG, "fp16": {"enabled": True}}, precision="fp16")) == (1.0, 2)
    static = {**CONFIG, "fp16": {"enabled": True, "loss_scale": 1024}}
    assert fp16_scaler(ds(static, precision="fp16")) == (None, 2)  # nothing to collapse
    assert fp16_scaler(ds(precision="bf16"))[0] is None
    auto = {**CONFIG, "fp16": {"enabled": "auto", "min_loss_scale": "auto"}}
    assert fp16_scaler(ds(auto, precision="fp16")) == (1.0, 2)


def test_a_static_loss_scale_that_overflows_every_step_is_named_as_deepspeeds():
    """fp16.loss_scale 1024: DeepSpeed skips each overflowing step and never lowers it."""
    config = {**CONFIG, "fp16": {"enabled": True, "loss_scale": 1024}}
    infos = {r: ds(config, precision="fp16") for r in range(2)}
    records = {
        r: [step_record(s, r, scale=1024.0, skipped=s >= 30) for s in range(1, 41)] for r in infos
    }
    jobs = {r: job_info(r, deepspeed=info) for r, info in infos.items()}
    [found] = check_numerics(Evidence(records, ("w",), jobs=jobs)).findings
    assert found.step == 30 and "floor" not in found.summary
    assert found.summary.startswith(
        "ranks 0-1: DeepSpeed's fp16 loss scaler skipped 11 steps, up to 11 in a row, from step "
        "30 (every step since); scale 1024 at first, 1024 at least, 1024 now"
    )
    assert "OVERFLOW! Skipping step" in found.fix

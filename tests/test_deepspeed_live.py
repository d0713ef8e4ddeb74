"""A DeepSpeed ZeRO script with accumulation (tests/scripts/ds_zero.py), unchanged, on 4 live
ranks: stepped at DeepSpeed's accumulation boundaries, bit-identical to torchrun, recorded
with the model's own names, and the doctor's DeepSpeed check on planted bugs (a rank that
read another ds_config, a script that accumulates on top of DeepSpeed).

DeepSpeed's CPU accelerator falls back to gloo and builds its shared-memory comm op with
the system compiler on first use (cached in ~/.cache/torch_extensions afterwards); fp16,
and with it DeepSpeed's loss scaler, is refused on CPU ("Type fp16 is not supported on
your device"), so the loss-scaler history is not exercised here.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import untimed
from tests.test_script_live import SCRIPTS, losses_in, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]


@pytest.fixture(scope="module", autouse=True)
def _ops(deepspeed_ops):
    """DeepSpeed's CPU ops, built before the first test (conftest.deepspeed_ops)."""


CONFIG = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 5},
    },
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 1.0,
}


def config_file(tmp_path, name: str = "ds_config.json", **changes) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({**CONFIG, **changes}))
    return str(path)


def ds_args(config: str, *more: str) -> list[str]:
    return ["--deepspeed", "--deepspeed_config", config, *more]


def test_a_zero2_script_with_accumulation_steps_at_deepspeeds_boundaries(live4, tmp_path):
    dt = live4
    args = ds_args(config_file(tmp_path), "--steps", "8")
    torchrun(dt, "ds_zero.py", [*args, "--out", str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "ds_zero.py"), [*args, "--out", str(tmp_path / "dt")])
    assert status.wrapper == "DeepSpeedEngine" and status.model == "Sequential"
    assert set(status.backward_calls.values()) == {2}  # paused before the first update
    argv = dt.run(_script_argv)  # as the deepspeed launcher passes it
    assert {rank: a[1] for rank, a in argv.items()} == {r: f"--local_rank={r}" for r in range(4)}
    dt.step(3)
    info = dt.trace.jobs[0]
    assert [p.name for p in info.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert info.deepspeed is not None
    assert (info.deepspeed.zero_stage, info.deepspeed.accumulation) == (2, 2)
    assert info.deepspeed.dp_world == 4 and info.deepspeed.precision == "fp32"
    assert "ZeRO stage 2" in info.optimizer
    recs = dt.trace.records[1]
    assert [r.micro_batches for r in recs] == [2, 2, 2]  # DeepSpeed's boundaries
    lrs = [r.lr for r in recs]
    assert lrs == sorted(lrs) and 0 <= lrs[0] < lrs[-1] <= 0.001  # WarmupLR's, as used
    assert all(r.grad_norm > 0 for r in recs)  # full gradients, through DeepSpeed's accessor
    check_memory(dt, stage=2)
    assert len({r.indices for r in (dt.trace.records[k][0] for k in range(4))}) == 4
    assert untimed(dt.doctor()) == []
    dt.step(2)
    assert dt.continue_script().last_step == 8
    assert losses_in(tmp_path / "dt") == losses_in(tmp_path / "torchrun")


def test_a_rank_that_read_another_ds_config_is_named(live4, tmp_path):
    dt = live4
    odd = config_file(tmp_path, "odd.json", gradient_clipping=0.5)
    args = ds_args(config_file(tmp_path), "--steps", "4", "--odd-rank", "2", "--odd-config", odd)
    dt.run_script(str(SCRIPTS / "ds_zero.py"), args)
    dt.step(2)
    [found] = [f for f in dt.doctor() if f.kind == "deepspeed_config"]
    assert found.ranks == (2,) and found.severity == "error"
    assert re.search(r"gradient_clipping: 1(\.0)? on ranks 0-1,3, 0\.5 on rank 2", found.summary)


def test_a_script_that_accumulates_on_top_of_deepspeed_is_named(live4, tmp_path):
    dt = live4
    args = ds_args(config_file(tmp_path), "--steps", "4", "--own-accumulation", "2")
    dt.run_script(str(SCRIPTS / "ds_zero.py"), args)
    dt.step(2)
    assert {r.micro_batches for r in dt.trace.records[0]} == {4}
    [found] = [f for f in dt.doctor() if f.kind == "deepspeed_accumulation"]
    assert found.ranks == (0, 1, 2, 3)
    assert "calls backward() 4 times per optimizer step, but gradient_accumulation_steps is 2" in (
        found.summary
    )


def test_options_idle_for_the_stage_in_use_are_advice(live4, tmp_path):
    dt = live4
    zero = {"stage": 2, "stage3_max_live_parameters": 1000000, "offload_param": {"device": "cpu"}}
    args = ds_args(config_file(tmp_path, zero_optimization=zero), "--steps", "3")
    dt.run_script(str(SCRIPTS / "ds_zero.py"), args)
    dt.step(2)
    [found] = [f for f in dt.doctor() if f.kind == "deepspeed_config"]
    assert found.severity == "advice" and found.ranks == (0, 1, 2, 3)
    assert "zero_optimization.stage3_max_live_parameters (ZeRO stage 3 only" in found.summary
    assert "zero_optimization.offload_param.device (ZeRO stage 3 only" in found.summary


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_1_and_3_step_like_torchrun_with_whole_parameters_recorded(live4, tmp_path, stage):
    dt = live4
    # ZeRO-3 keeps parameters under 100k elements whole unless told not to: partition all
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    args = ds_args(config_file(tmp_path, zero_optimization=zero), "--steps", "7")
    torchrun(dt, "ds_zero.py", [*args, "--out", str(tmp_path / "torchrun")])
    dt.run_script(str(SCRIPTS / "ds_zero.py"), [*args, "--out", str(tmp_path / "dt")])
    dt.step(6)
    info = dt.trace.jobs[0]
    assert info.deepspeed.zero_stage == stage and f"ZeRO stage {stage}" in info.optimizer
    assert [p.shape for p in info.params] == [(32, 16), (32,), (1, 32), (1,)]  # not (0,)
    last = {r: recs[-1] for r, recs in dt.trace.records.items()}
    assert len({rec.param_fingerprint for rec in last.values()}) == 1  # whole, and agreeing
    recs = dt.trace.records[0]
    moved = [
        a.param_fingerprint != b.param_fingerprint for a, b in zip(recs, recs[1:], strict=False)
    ]
    assert moved == [b.lr > 0 for b in recs[1:]] and any(moved)  # WarmupLR starts at 0
    check_memory(dt, stage)
    assert untimed(dt.doctor()) == []  # a 577-parameter model mostly waits on its data
    dt.continue_script()
    assert losses_in(tmp_path / "dt") == losses_in(tmp_path / "torchrun")


def check_memory(dt, stage: int) -> None:
    """Each rank's memory in its last record against the model's size P (fp32) on N ranks,
    with Adam's two moments: ZeRO-1/2 hold the whole model plus the fp32 master copy of
    their partition (P + P/N), ZeRO-3 its partition and the master copy (2P/N); the
    gradients are the reduced partition (P/N) and the optimizer state the partition's
    (2P/N). Off by padding only: DeepSpeed pads ZeRO-1/2's flat buffer to a multiple of 2N
    elements and each parameter to a multiple of N under ZeRO-3, so a partition is at most
    (parameters + 2N) elements over P/N."""
    info = dt.trace.jobs[0]
    n = info.deepspeed.dp_world
    size = 4 * sum(p.numel for p in info.params)
    pad = 4 * (len(info.params) + 2 * n) + 8  # and a step counter in the optimizer state
    part = size / n
    expected = {
        "param": (2 * part, 2 * pad) if stage == 3 else (size + part, 2 * pad),
        "grad": (part, pad),
        "optimizer": (2 * part, 2 * pad),
    }
    for rank, recs in dt.trace.records.items():
        memory = recs[-1].memory
        for kind, (bytes_, slack) in expected.items():
            got = getattr(memory, f"{kind}_bytes")
            assert abs(got - bytes_) <= slack, (rank, kind, got, bytes_, memory)


def _script_argv() -> list[str]:
    from dtlab.agent.state import RANK

    return RANK.script_run.argv

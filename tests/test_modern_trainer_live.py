"""A modern LLM trainer, unchanged, under %dt_script on 4 live ranks and under torchrun in
the same test: tests/scripts/titan_train.py + titan_lib.py, written the way torchtitan
users write theirs (the model as a list of parts, an optimizer container with one AdamW
per part whose own param_groups carry no LR, a LambdaLR per inner optimizer, a Trainer
whose train_step is a method in another module, logging through a StreamHandler bound to
sys.stdout at set-up, gc disabled and collected every few steps, data sharded by the
data-parallel index of a device mesh), in each of the forms below.

For each: the losses equal torchrun's step by step on every rank, ``dt.step(5)`` pauses
every rank after step 5, what dtlab recorded as the loss is what the script logged, the
micro-batches are the model's forwards (not its backward calls), the LR is the inner
optimizers', and the doctor is clean. Planted bugs are named with their ranks.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import untimed
from tests.test_script_live import SCRIPTS, losses_in, recorded, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]
SCRIPT = str(SCRIPTS / "titan_train.py")
STEPS = 7
FORMS = {
    "selective activation checkpointing": ["--ac", "selective"],
    "parts, plain checkpointing": ["--parts", "2", "--ac", "full"],
    "chunked loss": ["--loss-chunks", "8"],
    "FSDP2 + tensor parallel 2x2": ["--fsdp", "--tp", "2"],
    "compiled": ["--compile"],
    "pipeline schedule": ["--pp", "2"],
}


def _warmup_lr(step: int, lr: float = 1e-2, warmup: int = 2) -> float:
    """titan_lib's LambdaLR: linear warm-up over ``warmup`` steps, then flat."""
    return lr * min(1.0, (step + 1) / (warmup + 1))


@pytest.mark.parametrize("form", list(FORMS))
def test_a_modern_trainer_runs_unchanged_paused_at_its_steps(live4, tmp_path, form):
    dt = live4
    args = ["--steps", str(STEPS), *FORMS[form]]
    torchrun(dt, "titan_train.py", [*args, "--out", str(tmp_path / "torchrun")])
    status = dt.run_script(SCRIPT, [*args, "--out", str(tmp_path / "dt")])
    assert status.paused and set(status.steps.values()) == {0}, status
    assert not [n for n in status.notes if "observation failed" in n], status.notes
    assert status.optimizers == ("OptimizersContainer",)

    result = dt.step(5)
    assert result.last_step == 5
    assert {r: recs[-1].step for r, recs in dt.trace.records.items()} == {r: 5 for r in range(4)}
    # paused inside Trainer.train_step (titan_lib.py), its locals readable from %%dt
    seen = dt.execute("type(script_locals['self']).__name__")
    assert {o.result for o in seen.values()} == {"'Trainer'"}

    end = dt.continue_script()
    assert end.stopped == "ended" and end.last_step == STEPS, end
    for rank, text in dt.scripts.output.items():  # its logging handler, bound at set-up
        logged = re.findall(r"titan_lib - INFO - step +(\d+) +loss", text)
        assert logged == [str(s) for s in range(1, STEPS + 1)], (rank, text[-2000:])
        assert text.count("Training completed") == 1, rank
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")  # bit for bit, every rank, every step
    pipeline = "--pp" in args
    for rank, losses in recorded(dt).items():
        if pipeline and rank < 2:  # the first stage computes no loss (it logs -1.0)
            assert all(math.isnan(v) for v in losses) and mine[rank] == [-1.0] * STEPS
            continue
        assert losses == pytest.approx(mine[rank], rel=1e-6), rank  # the loss it logged
    micro = {rec.micro_batches for recs in dt.trace.records.values() for rec in recs}
    assert micro == ({2} if pipeline else {1}), micro  # forwards of the model, per step
    lrs = recorded(dt, "lr")[0]
    assert lrs == pytest.approx([_warmup_lr(s) for s in range(STEPS)])  # the inner AdamWs'
    assert untimed(dt.doctor()) == [], [f.summary for f in dt.doctor()]
    info = dt.trace.jobs[0]
    assert info.optimizer.startswith("OptimizersContainer (AdamW x")


def test_a_planted_lr_on_one_rank_under_fsdp2_is_named(live4):
    dt = live4
    dt.run_script(SCRIPT, ["--steps", "5", "--fsdp", "--lr-rank", "1", "--lr-mult", "2"])
    assert dt.continue_script().stopped == "ended"
    findings = dt.doctor()
    [found] = [f for f in findings if f.kind == "learning_rate"]  # its inner AdamW's LR
    assert found.ranks == (1,) and found.step == 1, found.summary
    # at the shard: Adam moves each element by about the LR, so rank 1's update is 2x;
    # its LR explains it, so the update check has nothing more to say
    rms = {r: recs[0].update_rms for r, recs in dt.trace.records.items()}
    others = sorted(v for r, v in rms.items() if r != 1)
    assert rms[1] / others[1] == pytest.approx(2.0, rel=0.2), rms
    assert not [f for f in findings if f.kind == "update_size"]


def test_a_rank_whose_optimizer_updates_its_shard_differently_is_named(live4):
    dt = live4
    dt.run_script(SCRIPT, ["--steps", "6", "--fsdp"])
    # paused at step 0: rank 2's inner AdamW gets another eps (same LR, smaller updates)
    dt.execute(
        "for o in script_locals['self'].optimizers.optimizers:\n    o.param_groups[0]['eps'] = 0.1",
        ranks=[2],
    )
    assert dt.continue_script().stopped == "ended"
    findings = dt.doctor()
    [found] = [f for f in findings if f.kind == "update_size"]
    assert found.ranks == (2,) and found.step in (1, 2), found.summary
    assert not [f for f in findings if f.kind == "learning_rate"]


@pytest.mark.parametrize("mesh", [[], ["--fsdp", "--tp", "2"]], ids=["dp4", "dp2xtp2"])
def test_ranks_reading_the_same_shard_are_named_with_shard_advice(live4, mesh):
    dt = live4
    dt.run_script(SCRIPT, ["--steps", "5", "--same-data", *mesh])
    assert dt.continue_script().stopped == "ended"
    [found] = [f for f in dt.doctor() if f.kind == "data_order"]
    assert found.ranks == (0, 1, 2, 3), found.summary
    assert "shard" in found.fix.split(";")[0].lower(), found.fix  # advice leads with shards

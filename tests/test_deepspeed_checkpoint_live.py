"""DeepSpeed's own checkpoints under dtlab, on 4 live ranks (tests/scripts/ds_zero.py):
``%dt_resume_check`` saves through ``engine.save_checkpoint``, loads into fresh engines as
``deepspeed.initialize`` returns them and names what the checkpoint did not restore; a
script that restores its data position resumes identically (ZeRO-3 too); a rank that dies
is restarted by running the script again, which resumes from its own latest DeepSpeed
checkpoint, and goes on as the run under torchrun that never died."""

from __future__ import annotations

import os

import pytest

from dtlab.views.reports import restart_summary
from tests.test_deepspeed_live import config_file, ds_args
from tests.test_script_live import SCRIPTS, losses_in, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]


@pytest.fixture(scope="module", autouse=True)
def _ops(deepspeed_ops):
    """DeepSpeed's CPU ops, built before the first test (conftest.deepspeed_ops)."""


def test_resume_check_goes_through_deepspeeds_checkpoint_and_names_what_it_lost(live4, tmp_path):
    dt = live4
    dt.run_script(str(SCRIPTS / "ds_zero.py"), ds_args(config_file(tmp_path), "--steps", "12"))
    dt.step(4)
    report = dt.resume_check(3)
    summary = report.summary()
    assert not report.identical
    assert summary.startswith(
        "the script resumed at step 4 on fresh engines from DeepSpeed's checkpoint "
    ), summary
    assert "global_step4" in summary
    assert "first difference at step 5, from what the checkpoint did not restore: " in summary
    assert "data position lost: rank 0 read samples " in summary
    assert "Python random RNG of ranks 0-3 not restored" in summary
    saved = os.listdir(report.checkpoint)  # what engine.save_checkpoint wrote
    assert "mp_rank_00_model_states.pt" in saved
    assert sum(name.endswith("_optim_states.pt") for name in saved) == 4  # ZeRO: a part each
    assert dt.trace.last_step == 7 and dt.scripts.refresh().steps == {r: 7 for r in range(4)}


def test_a_script_that_restores_its_data_position_resumes_identically_zero3(live4, tmp_path):
    dt = live4
    config = config_file(tmp_path, zero_optimization={"stage": 3})
    args = ds_args(config, "--steps", "12", "--resumable-data")
    dt.run_script(str(SCRIPTS / "ds_zero.py"), args)
    dt.step(4)
    report = dt.resume_check(3, fresh=False)
    assert report.identical, report.summary()
    assert report.summary().endswith("global_step4, then 3 steps: identical")
    assert report.comparison.steps == (5, 6, 7) and report.comparison.ranks == (0, 1, 2, 3)
    assert dt.trace.jobs[0].deepspeed.zero_stage == 3


def test_a_dead_rank_restarts_from_the_scripts_own_deepspeed_checkpoint(live4, tmp_path, ip):
    dt = live4
    ckpt, marker = tmp_path / "ckpt", tmp_path / "died"
    base = ds_args(config_file(tmp_path), "--steps", "8", "--resumable-data")
    saving = ["--save-dir", str(ckpt), "--save-every", "2"]
    torchrun(dt, "ds_zero.py", [*base, "--out", str(tmp_path / "torchrun")])
    dying = ["--die-rank", "2", "--die-at", "5", "--die-once", str(marker)]
    dt.run_script(
        str(SCRIPTS / "ds_zero.py"), [*base, *saving, *dying, "--out", str(tmp_path / "dt")]
    )
    dt.auto_restart(1)
    dt.step(8)  # rank 2 exits in step 5; the script resumes from global_step4 and goes on
    assert marker.exists() and dt.trace.last_step == 8
    [event] = dt.restarts
    assert (event["rerun"], event["resumed_at"], event["differ"]) == (True, 4, []), event
    # the step the job was at as the notebook last heard: at least the first (a run's first
    # step is reported at once; after it records come in batches, and a death can take the
    # last ones with it), at most the 4 steps every rank made
    assert 1 <= event["step"] <= 4, event
    assert "rank 2 died" in event["reason"]
    # it resumed at (or past) that step: no step of the run again to compare, and so said,
    # never "bit for bit"
    said = restart_summary(4, event)
    assert not event["compared"] and "not compared with the first run" in said, said
    assert said.endswith("the job is at step 4")
    dt.continue_script()
    # the micro-batches the script made after its restart (its file holds those) are the
    # ones the run that never died made from there, bit for bit
    ours, theirs = losses_in(tmp_path / "dt"), losses_in(tmp_path / "torchrun")
    assert ours and all(ours[r] == theirs[r][-len(ours[r]) :] for r in ours), (ours, theirs)
    assert all(len(ours[r]) == 2 * (8 - 4) for r in ours)

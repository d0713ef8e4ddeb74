"""Checkpoints on live ranks: bit-identical resume, a forgotten RNG named, corrupt and
partial checkpoints refused, resharding 4 -> 2 ranks, a full disk, a rank killed mid-save,
and bisection naming an injected fault's step and module."""

import glob
import math
import os
import signal
import threading
import time

import pytest

import dtlab
from dtlab import demo
from dtlab.control.checkpointing import CheckpointFailed
from dtlab.control.errors import RankError
from tests.conftest import quiet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def dt(live4, tmp_path):
    live4.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(live4, dropout=0.1, num_samples=512)  # dropout: steps draw from torch's RNG
    yield live4
    live4.record_outputs(False)


def rank_steps(session):
    from dtlab.agent.job import current

    return session.run(lambda: current().step_count)


def mean_loss(session, step):
    recs = session.trace.at(step)
    return math.fsum(r.loss for r in recs.values()) / len(recs)


def test_resume_on_fresh_engines_is_bit_identical(dt):
    dt.step(5)
    pids_before = set(dt.pids())
    report = dt.resume_check(10)
    assert report.identical, report.summary()
    assert report.comparison.steps == tuple(range(6, 16))
    assert report.loaded["missing"] == {}
    assert {"model", "optimizer", "scheduler", "data", "torch", "python"} <= set(
        report.loaded["restored"]
    )
    assert not pids_before & set(dt.pids()), "fresh engines must be new processes"
    assert dt.trace.last_step == 15  # the job goes on from the resumed state
    (saved,) = [c for c in dt.checkpoints() if c.tag == "resume-check"]
    assert saved.ok and saved.step == 5 and saved.ranks == (0, 1, 2, 3)


def test_a_forgotten_rng_is_caught_and_named(dt):
    dt.step(3)
    dt.execute("dtlab.inject.checkpoint_without('torch')", ranks=[3])
    report = dt.resume_check(4)
    first = report.comparison.first
    assert not report.identical
    assert (first.field, first.ranks, first.step) == ("rng:torch", (3,), 4)
    assert "torch CPU RNG" in first.explanation and "rank 3" in first.explanation
    assert report.loaded["missing"] == {"torch": [3]}
    assert "lacks torch (rank 3)" in report.summary()


def test_truncated_and_corrupted_checkpoints_are_refused(dt):
    dt.step(2)
    good = dt.checkpoint()
    dt.step(2)
    bad = dt.checkpoint()
    loss_after_good = mean_loss(dt, 3)
    victim = sorted(bad.path.glob("__1_*.distcp"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFailed, match=r"rank 1's file .*__1_0\.distcp has \d+ bytes"):
        dt.load_checkpoint(bad.step)
    assert "corrupt" == {c.path: c for c in dt.checkpoints()}[bad.path].status
    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # same size
    with pytest.raises(CheckpointFailed, match=r"has checksum .* the manifest says") as refused:
        dt.load_checkpoint(bad.step)
    assert f"dt.load_checkpoint({good.step})" in str(refused.value)
    assert dt.trace.last_step == 4  # refused: the job did not move
    assert set(rank_steps(dt).values()) == {4}
    dt.load_checkpoint(good.step)
    dt.step(1)
    assert mean_loss(dt, 3) == loss_after_good  # replayed from the good one, bit for bit


def test_a_checkpoint_of_another_model_is_refused(dt):
    dt.step(1)
    saved = dt.checkpoint()
    demo.attach(dt, num_layers=3)
    dt.step(2)
    with pytest.raises(CheckpointFailed, match="from another model .*blocks.3"):
        dt.load_checkpoint(saved.step)
    assert set(rank_steps(dt).values()) == {2}
    dt.step(1)  # and it still steps
    assert dt.trace.last_step == 3


def test_ranks_that_diverged_are_saved_apart_and_stay_diverged(dt):
    dt.step(2)
    dt.execute("dtlab.inject.perturb_param('blocks.0.attn.qkv.weight')", ranks=[2])
    saved = dt.checkpoint()
    import json

    assert json.loads((saved.path / "manifest.json").read_text())["replicated"] is False
    dt.step(1)
    original = {r: rec.param_fingerprint for r, rec in dt.trace.at(3).items()}
    assert original[2] != original[0] == original[1] == original[3]
    before = dt.trace.folder
    dt.load_checkpoint(saved.step)
    # the new timeline names the one before it (the report draws both)
    assert dt.trace.meta["before"] == str(before.resolve()) and dt.trace.meta["step"] == 2
    dt.step(1)
    assert {r: rec.param_fingerprint for r, rec in dt.trace.at(3).items()} == original


def test_resharding_4_ranks_onto_2_keeps_the_loss(live4, tmp_path):
    root = tmp_path / "checkpoints"
    live4.checkpoint_root = root
    demo.attach(live4, num_samples=512)  # 4 ranks x 8 samples a step
    live4.step(3)
    saved = live4.checkpoint()
    live4.step(2)
    expected = [mean_loss(live4, s) for s in (4, 5)]
    two = dtlab.launch(2, progress=quiet)
    two.checkpoint_root = root
    demo.attach(two, num_samples=512, batch_size=16)  # 2 x 16: the same samples a step
    loaded = two.load_checkpoint(saved.step)
    assert "world size 4 -> 2" in loaded["notes"][0]
    two.step(2)
    got = [mean_loss(two, s) for s in (4, 5)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_full_disk_on_one_rank_fails_the_save_and_loses_nothing(dt):
    dt.step(1)
    good = dt.checkpoint()
    dt.execute("dtlab.inject.limit_file_size(64 * 1024)", ranks=[2])
    try:
        with pytest.raises(CheckpointFailed, match=r"rank 2: .*came up short: a full disk"):
            dt.checkpoint()
    finally:
        dt.execute("dtlab.inject.limit_file_size(None)", ranks=[2])
    assert [c.step for c in dt.checkpoints()] == [good.step]  # no partial left behind
    dt.step(1)  # the job goes on
    assert dt.trace.last_step == 2


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(dt, tmp_path):
    dt.step(2)
    good = dt.checkpoint()
    dt.step(1)
    dt.execute("dtlab.inject.stall_save(60)", ranks=[1])
    pid = dt.run(os.getpid, ranks=[1])[1]
    pattern = str(dt.checkpoint_root / ".partial-*" / "rank-1.pt")

    def kill_when_written():
        deadline = time.monotonic() + 60
        while not glob.glob(pattern) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_written, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died"):
        dt.checkpoint()
    assert time.monotonic() - t0 < 60
    killer.join(5)
    statuses = {c.step: c.status for c in dt.checkpoints()}
    assert statuses == {good.step: "complete"}  # the failed save's partial folder is gone
    fresh = dtlab.launch(4, restart=True, progress=quiet)
    fresh.checkpoint_root = dt.checkpoint_root
    demo.attach(fresh, dropout=0.1, num_samples=512)
    assert fresh.load_checkpoint("latest")["step"] == good.step
    fresh.step(1)
    assert fresh.trace.last_step == good.step + 1


@pytest.mark.parametrize("when", ["before_commit", "after_commit"])
def test_a_save_that_fails_is_never_committed_wherever_the_rank_dies(dt, when):
    """What the call says and what is on disk agree: a rank killed while the others
    finish the checkpoint (rank 0 had renamed it into place before the last agreement)
    means no new checkpoint, and no partial folder left behind."""
    dt.step(2)
    good = dt.checkpoint()
    dt.step(1)
    dt.execute(f"dtlab.inject.kill_in_save({when!r})", ranks=[2])
    with pytest.raises(RankError, match="rank 2 died"):
        dt.checkpoint()
    assert [(c.step, c.status) for c in dt.checkpoints()] == [(good.step, "complete")]
    assert not list(dt.checkpoint_root.glob(".partial-*"))
    dt.restart("latest")  # fresh engines from the last good one
    assert dt.current_step() == good.step


def test_bisect_finds_the_step_and_module_of_a_transient_fault(dt):
    dt.record_outputs(True)
    dt.step(3)
    dt.checkpoint()
    dt.execute("dtlab.inject.corrupt_once('blocks.1.ffn', step=6)", ranks=[2])
    dt.step(5)
    found = dt.bisect(3, 8)
    assert found.step == 6, found.verdict
    assert found.module == "blocks.1.ffn", found.verdict
    assert found.ranks == (2,)
    assert not found.nondeterministic
    assert found.replay.replay_step_s is not None
    assert dt.trace.last_step == 8  # the job is back where it was


def test_bisect_reports_a_non_deterministic_step_as_such(dt):
    dt.record_outputs(True)
    dt.step(2)
    dt.checkpoint()
    dt.execute("dtlab.inject.jitter('blocks.2.ffn')", ranks=[0])
    dt.step(3)
    found = dt.bisect(2, 5)
    assert found.nondeterministic, found.verdict
    assert (found.step, found.module, found.ranks) == (3, "blocks.2.ffn", (0,))
    assert "non-deterministic" in found.verdict and "not the checkpoint" in found.verdict

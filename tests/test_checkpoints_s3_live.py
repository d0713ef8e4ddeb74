"""Checkpoints of a live 4-rank job in object storage (a moto S3 server on loopback):
saved, listed, verified and loaded from the bucket, a resume check identical from it,
a save to a missing bucket refused with the job as it was, and the planted secret key in
no output, message or run folder."""

import math

import pytest

from dtlab import demo
from dtlab.control.checkpointing import CheckpointFailed
from dtlab.control.errors import RankError
from tests.test_checkpoints_s3 import SECRET, MotoServer, objects, s3_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def server():
    s = MotoServer()
    yield s
    s.stop()


@pytest.fixture
def dt(live4, server, monkeypatch, tmp_path, request):
    s3_env(monkeypatch, tmp_path, server.url)
    server.client().create_bucket(Bucket="live")
    live4.checkpoint_root = f"s3://live/{request.node.name[:40]}"  # one prefix per test
    demo.attach(live4, dropout=0.1, num_samples=512)
    yield live4
    live4.checkpoint_root = tmp_path / "checkpoints"


def mean_loss(session, step):
    recs = session.trace.at(step)
    return math.fsum(r.loss for r in recs.values()) / len(recs)


def test_save_list_verify_load_and_resume_check_from_a_bucket(dt, server, runs_dir, capsys, ip):
    dt.step(3)
    saved = dt.checkpoint()
    root = _root(dt).url
    assert saved.ok and saved.url == f"{root}/step-0000003" and saved.ranks == (0, 1, 2, 3)
    assert not list(_root(dt).staging().iterdir()), "the staging copy is removed"
    loss_at_3 = mean_loss(dt, 3)
    dt.step(3)
    (listed,) = [c for c in dt.checkpoints(verify=True) if c.tag is None]
    assert listed.ok and listed.url == saved.url and listed.size_bytes == saved.size_bytes
    loaded = dt.load_checkpoint(3)
    assert loaded["path"] == saved.url and loaded["missing"] == {}
    dt.step(1)
    assert dt.trace.last_step == 4
    assert not list(_root(dt).fetched.iterdir()), "the fetched copy is removed"
    report = dt.resume_check(4)
    assert report.identical, report.summary()
    (check,) = [c for c in dt.checkpoints() if c.tag == "resume-check"]
    assert check.ok and check.url.startswith(f"{root}/")
    ip.run_line_magic("dt_checkpoint", "--list")
    ip.run_line_magic("dt_checkpoint", f"--tag magic --to {root}")
    assert any("/step-0000008/" in k for k in objects(server, _root(dt)))
    out = capsys.readouterr()
    assert f"{root}/step-0000008" in out.out
    said = out.out + out.err + repr(dt.checkpoints()) + report.summary()
    assert SECRET not in said and loss_at_3 > 0
    for path in runs_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), path


def _root(dt):
    return dt.checkpointing.checkpoint_root


def test_a_save_to_a_missing_bucket_is_refused_and_the_job_goes_on(dt, tmp_path):
    dt.step(2)
    with pytest.raises(CheckpointFailed, match="'nobody-made-this' does not exist") as e:
        dt.checkpoint(to="s3://nobody-made-this/x")
    said = str(e.value)
    assert "Nothing of it lists as complete" in said and SECRET not in said
    dt.step(1)
    assert dt.trace.last_step == 3
    with pytest.raises(CheckpointFailed, match="no checkpoint of step 2"):
        dt.load_checkpoint(2)  # not in the bucket
    kept = said.split("dt.load_checkpoint('")[1].split("')")[0]
    assert dt.load_checkpoint(kept)["step"] == 2  # the local copy, complete
    assert dt.current_step() == 2


def test_a_rank_killed_mid_save_then_a_restart_from_the_bucket(dt):
    dt.step(2)
    good = dt.checkpoint()
    dt.step(1)
    dt.execute("dtlab.inject.kill_in_save('before_commit')", ranks=[2])
    with pytest.raises(RankError, match="rank 2 died"):
        dt.checkpoint()
    assert [(c.url, c.status) for c in dt.checkpoints()] == [(good.url, "complete")]
    assert not list(_root(dt).staging().iterdir()), "the staging folder is cleared"
    dt.restart("latest")  # fresh engines, the checkpoint fetched from the bucket
    assert dt.current_step() == good.step
    dt.step(1)
    assert dt.trace.last_step == good.step + 1


def test_one_save_to_a_bucket_while_the_root_is_a_folder(dt, tmp_path):
    dt.checkpoint_root = tmp_path / "local"
    dt.step(2)
    sent = dt.checkpoint(to="s3://live/one-off/")
    assert sent.url == "s3://live/one-off/step-0000002"
    assert dt.checkpoints() == []  # the root, a folder, holds none
    dt.step(2)
    assert dt.load_checkpoint(sent.url)["step"] == 2
    assert dt.current_step() == 2
    with pytest.raises(CheckpointFailed, match="is not a checkpoint in s3://live/one-off"):
        dt.load_checkpoint("s3://live/one-off/step-0000009")

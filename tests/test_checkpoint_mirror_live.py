"""A mirror of a live 4-rank job's checkpoints in object storage (a moto S3 server on
loopback): every checkpoint saved locally, by dt.checkpoint() or periodic saves, copied
in the background; the listing says local, mirrored or both; a load falls back to the
bucket when the local copy is gone or damaged; a server that is gone fails the copy with
a clear word and leaves the local checkpoints and the job as they were."""

import math
import shutil

import pytest

from dtlab import demo
from tests.test_checkpoints_s3 import SECRET, MotoServer, s3_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def dt(live4, monkeypatch, tmp_path):
    s3_env(monkeypatch, tmp_path, "http://127.0.0.1:1")  # each test points at its server
    demo.attach(live4, dropout=0.1, num_samples=512)
    live4.checkpoint_root = tmp_path / "checkpoints"
    yield live4
    live4.checkpoint_mirror = None


def mean_loss(session, step):
    recs = session.trace.at(step)
    return math.fsum(r.loss for r in recs.values()) / len(recs)


def test_every_checkpoint_is_mirrored_and_a_load_falls_back_to_the_bucket(
    dt, monkeypatch, tmp_path, ip, capsys
):
    server = MotoServer()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        server.client().create_bucket(Bucket="mirror")
        url = "s3://mirror/job"
        ip.run_line_magic("dt_checkpoint", f"--mirror {url}")
        assert f"to {url} in the background" in capsys.readouterr().out
        dt.step(2)
        first = dt.checkpoint()  # handed to the mirror at once; the job steps on
        loss_at_3 = None
        dt.checkpoint_every(2)
        dt.step(4)  # periodic saves at steps 4 and 6, written by the ranks: found by a scan
        dt.checkpoint_every(0)
        loss_at_3 = mean_loss(dt, 3)
        done = dt.mirror.wait(timeout=120)
        assert {u.step: u.state for u in done} == {2: "mirrored", 4: "mirrored", 6: "mirrored"}
        assert all(u.sent_bytes == u.size_bytes > 0 for u in done), done
        listed = dt.checkpoints(verify=True)
        assert {c.step: c.copies for c in listed} == {2: "both", 4: "both", 6: "both"}
        keys = server.client().list_objects_v2(Bucket="mirror", Prefix="job/")["Contents"]
        assert {k["Key"].split("/")[1] for k in keys} == {c.path.name for c in listed}

        shutil.rmtree(first.path)  # the local copy of step 2 is gone (the node's disk)
        (damaged,) = [c for c in listed if c.step == 4]
        part = next(p for p in damaged.path.iterdir() if p.name != "manifest.json")
        part.write_bytes(part.read_bytes()[:-1])  # and step 4's is cut short
        now = {c.step: c for c in dt.checkpoints()}
        assert (now[2].copies, now[2].url) == ("mirrored", f"{url}/{first.path.name}")
        assert now[4].copies == "mirrored" and "local copy corrupt" in now[4].mirror
        assert now[6].copies == "both"
        loaded = dt.load_checkpoint(2)  # fetched from the bucket, checked, then loaded
        assert loaded["path"] == now[2].url and loaded["missing"] == {}
        dt.step(1)
        assert mean_loss(dt, 3) == loss_at_3  # the run goes on as it did from step 2
        ip.run_line_magic("dt_checkpoint", "--list")
        shown = capsys.readouterr().out
        assert "copies" in shown and "mirrored" in shown and "both" in shown, shown
        ip.run_line_magic("dt_checkpoint", "--mirror off")
        assert "no mirror" in capsys.readouterr().out and dt.mirror is None
        assert {c.copies for c in dt.checkpoints()} == {None}
    finally:
        server.stop()


def test_a_mirror_whose_server_is_gone_fails_the_copy_and_keeps_everything_local(
    dt, monkeypatch, capsys
):
    server = MotoServer()
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    server.client().create_bucket(Bucket="mirror")
    dt.checkpoint_mirror = "s3://mirror/gone"
    server.stop()  # the network or the storage is gone from here on
    dt.step(2)
    saved = dt.checkpoint()
    dt.step(2)  # the job steps on while the copy fails
    (upload,) = dt.mirror.wait(timeout=120)
    assert upload.state == "failed" and "the server cannot be reached" in upload.error, upload
    assert SECRET not in upload.error
    with pytest.warns(UserWarning, match="the mirror cannot be listed"):
        (listed,) = dt.checkpoints()
    assert listed.ok and listed.copies == "local" and listed.mirror.startswith("mirror failed")
    assert dt.load_checkpoint(2)["path"] == str(saved.path)  # the local copy, intact
    assert dt.step(1).last_step == 3  # and the job goes on from it

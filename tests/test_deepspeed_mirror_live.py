"""DeepSpeed's own checkpoints (``engine.save_checkpoint``) of a script on 4 live ranks,
mirrored to object storage (a moto S3 server on loopback): every complete save copied in
the background; after the save folder is lost with its disk, the last copy is fetched
back, checked, and the script run again resumes from it as the run that never stopped."""

from __future__ import annotations

import shutil

import pytest

from dtlab.control.deepspeed_copies import complete_tags
from tests.test_checkpoints_s3 import MotoServer, s3_env
from tests.test_deepspeed_live import config_file, ds_args
from tests.test_script_live import SCRIPTS, losses_in, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]


@pytest.fixture(scope="module", autouse=True)
def _ops(deepspeed_ops):
    """DeepSpeed's CPU ops, built before the first test (conftest.deepspeed_ops)."""


def test_deepspeeds_own_saves_are_mirrored_and_resumed_from_after_the_disk_is_lost(
    live4, tmp_path, monkeypatch
):
    server = MotoServer()
    try:
        s3_env(monkeypatch, tmp_path, server.url)
        server.client().create_bucket(Bucket="mirror")
        dt = live4
        dt.checkpoint_root = tmp_path / "checkpoints"
        dt.checkpoint_mirror = "s3://mirror/ds"
        ckpt = tmp_path / "ckpt"
        dt.mirror.watch_deepspeed(ckpt)
        config = config_file(tmp_path)
        whole = ds_args(config, "--steps", "8", "--resumable-data")
        torchrun(dt, "ds_zero.py", [*whole, "--out", str(tmp_path / "torchrun")])
        first = ds_args(config, "--steps", "6", "--resumable-data", "--save-dir", str(ckpt),
                        "--save-every", "2", "--out", str(tmp_path / "first"))  # fmt: skip
        dt.run_script(str(SCRIPTS / "ds_zero.py"), first)
        dt.continue_script()  # saves global_step2, 4 and 6, then ends
        tags = ["global_step2", "global_step4", "global_step6"]
        assert [t for t, _, _ in complete_tags(ckpt)] == tags
        done = {u.name: u for u in dt.mirror.wait(timeout=180)}
        for tag in tags:
            copy = done[f"deepspeed/{tag}"]
            assert copy.state == "mirrored" and copy.sent_bytes == copy.size_bytes > 0, copy
        copies = dt.mirror.deepspeed_copies()
        assert [(c.tag, c.step, c.status) for c in copies] == [(t, int(t[11:]), "complete")
                                                              for t in tags]  # fmt: skip
        local = {p.name: p.read_bytes() for p in (ckpt / "global_step6").iterdir()}

        shutil.rmtree(ckpt)  # the save folder is lost with the node's disk
        restored = dt.mirror.restore_deepspeed(ckpt)
        assert restored == ckpt / "global_step6" and (ckpt / "latest").read_text() == "global_step6"
        assert {p.name: p.read_bytes() for p in restored.iterdir()} == local  # bit for bit
        again = ds_args(config, "--steps", "8", "--resumable-data", "--save-dir", str(ckpt),
                        "--out", str(tmp_path / "again"))  # fmt: skip
        dt.run_script(str(SCRIPTS / "ds_zero.py"), again)  # its own load_checkpoint(ckpt)
        dt.continue_script()
        ours, theirs = losses_in(tmp_path / "again"), losses_in(tmp_path / "torchrun")
        # steps 7 and 8, two micro-batches each: as the run that never stopped made them
        assert all(len(ours[r]) == 4 and ours[r] == theirs[r][-4:] for r in range(4)), ours
        with pytest.raises(Exception, match="exists: remove it first"):
            dt.mirror.restore_deepspeed(ckpt, "global_step6")
    finally:
        live4.checkpoint_mirror = None
        server.stop()

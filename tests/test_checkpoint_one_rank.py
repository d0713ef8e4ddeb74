"""Checkpoints on one rank in this process (no cluster): exact resume with a shuffling
loader mid-epoch, RNG round trips, and refusals that leave the job unchanged."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dtlab.agent import checkpoint, restore, rng
from dtlab.agent import job as jobs
from dtlab.agent.attach import attach as attach_job
from dtlab.agent.state import RANK
from dtlab.records.checkpoints import MANIFEST, CheckpointError, catalogue

# DCP says it assumes one process: it is one process
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def attach(shuffle=True, batch_size=4, lr=1e-2, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    samples = TensorDataset(torch.randn(40, 6), torch.randn(40, 1), torch.arange(40))
    data = DataLoader(samples, batch_size=batch_size, shuffle=shuffle)

    def loss_fn(model, batch):
        x, y, _ = batch
        noise = random.random() + float(np.random.rand())  # Python and numpy RNGs matter too
        return torch.nn.functional.mse_loss(model(x), y) * (1 + 1e-3 * noise)

    attach_job(
        model,
        optimizer(model.parameters(), lr=lr),
        data,
        loss_fn,
        indices=lambda batch: batch[2].tolist(),
    )
    return jobs.current()


def outcome(recs):
    return [(r.loss, r.param_fingerprint, r.rng, r.indices) for r in recs]


def test_resume_mid_epoch_with_a_shuffling_loader_is_exact(tmp_path):
    job = attach()
    for _ in range(13):  # 10 batches an epoch: into the second epoch, mid-way
        job.step()
    saved = checkpoint.save(str(tmp_path), "t")
    expected = outcome(job.step() for _ in range(12))
    random.random(), np.random.rand(), torch.rand(3)  # move every RNG on
    loaded = restore.load(saved["path"])
    assert loaded["missing"] == [] and {"data", "torch", "python", "numpy"} <= set(
        loaded["restored"]
    )
    assert job.step_count == 13 and job.stream.epoch == 1 and job.stream.offset == 3
    assert all(indices for *_, indices in expected)
    assert outcome(job.step() for _ in range(12)) == expected


def test_a_checkpoint_without_the_epoch_rng_reshuffles(tmp_path):
    job = attach()
    for _ in range(13):
        job.step()
    RANK.fault_omitted_parts.add("torch")  # the sampler's order comes from torch's RNG
    saved = checkpoint.save(str(tmp_path), "t")
    expected = [r.indices for r in (job.step() for _ in range(3))]
    assert all(expected)
    torch.rand(5)
    restore.load(saved["path"])
    assert [r.indices for r in (job.step() for _ in range(3))] != expected


def test_rng_capture_and_restore_round_trip():
    states = rng.capture()
    before = rng.fingerprints()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert rng.fingerprints() != before
    assert set(rng.restore(states)) >= {"python", "numpy", "torch"}
    assert rng.fingerprints() == before
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws


def unchanged(job):
    return job.step_count, [p.detach().clone() for p in job.params]


def same(a, b):
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_refusals_name_the_problem_and_leave_the_job_as_it_was(tmp_path):
    job = attach()
    job.step()
    saved = checkpoint.save(str(tmp_path), "t")
    job.step()
    before = unchanged(job)
    folder = tmp_path / "copy"
    shutil.copytree(saved["path"], folder)
    (folder / "rank-0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank 0's file .*rank-0\.pt is missing"):
        restore.load(str(folder))
    assert same(before, unchanged(job))

    RANK.job = None
    sgd = attach(optimizer=torch.optim.SGD)  # SGD state into an AdamW job: another optimizer
    sgd.optimizer.param_groups[0]["momentum"] = 0.9
    sgd.step()
    other = checkpoint.save(str(tmp_path), "u")
    RANK.job = job
    with pytest.raises(CheckpointError, match="another optimizer"):
        restore.load(other["path"])
    assert same(before, unchanged(job))

    RANK.job = None
    short = attach(batch_size=20)  # 2 batches an epoch, the checkpoint says batch 1 of 10
    with pytest.raises(CheckpointError, match="not the data it was saved with|cannot carry"):
        restore.load(saved["path"])
    assert short.step_count == 0


def test_manifest_lists_every_file_and_a_corrupt_one_is_marked(tmp_path):
    job = attach()
    job.step()
    saved = checkpoint.save(str(tmp_path), "t", tag="x")
    manifest = json.loads((tmp_path / saved["path"] / MANIFEST).read_text())
    names = {f["name"] for f in manifest["files"]}
    assert {"rank-0.pt", ".metadata"} <= names and any(n.endswith(".distcp") for n in names)
    assert manifest["replicated"] and manifest["step"] == 1 and manifest["tag"] == "x"
    (info,) = catalogue(tmp_path, verify=True)
    assert info.ok and info.ranks == (0,)
    data = tmp_path / saved["path"] / ".metadata"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))
    (info,) = catalogue(tmp_path, verify=True)
    assert info.status == "corrupt" and "has checksum" in info.problem
    assert catalogue(tmp_path)[0].ok  # sizes alone cannot tell: --verify can

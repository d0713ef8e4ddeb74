"""The foundation, stepping and checkpoint checks on GPUs with NCCL, when the machine has
them; skipped with the reason otherwise (CI has no GPU).

On a machine with G GPUs: G ranks, ``--backend auto`` must pick NCCL, each rank must hold
``cuda:LOCAL_RANK``, steps must record CUDA memory, the demo job's fingerprints must agree
across ranks, and a resume check on fresh engines must come out identical with the CUDA
RNG part of the checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

import dtlab
from dtlab import demo
from tests.conftest import quiet


def _gpus() -> int:
    """GPUs this machine has, asked of nvidia-smi (the notebook need not import CUDA)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def _torch_has_cuda() -> bool:
    import torch

    return torch.backends.cuda.is_built() and torch.cuda.is_available()


NUM_GPUS = _gpus()
WHY = (
    "no GPU here (nvidia-smi lists none)"
    if NUM_GPUS == 0
    else "this torch is a CPU build: install a CUDA torch to run the GPU tests"
)
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.skipif(NUM_GPUS == 0 or not _torch_has_cuda(), reason=WHY),
]


@pytest.fixture(scope="module")
def gpu_ranks():
    session = dtlab.launch(NUM_GPUS, backend="auto", progress=quiet, restart=True)
    yield session
    session.shutdown()


def test_auto_picks_nccl_and_pins_cuda_local_rank(gpu_ranks):
    dt = gpu_ranks
    assert dt.backend == "nccl"
    for rank, info in dt.infos.items():
        assert info.device == f"cuda:{info.local_rank}", (rank, info)
    out = dt.execute("t = torch.ones(1, device=device) * rank; dist.all_reduce(t); t.item()")
    total = sum(range(NUM_GPUS))
    assert {r: float(o.result) for r, o in out.items()} == dict.fromkeys(dt.ranks, total)


def test_demo_steps_on_gpus_record_cuda_memory_and_agree(gpu_ranks):
    dt = gpu_ranks
    demo.attach(dt)
    dt.step(5)
    last = dt.trace.at(5)
    assert all(r.memory.cuda_allocated and r.memory.cuda_peak for r in last.values())
    assert len({r.param_fingerprint for r in last.values()}) == 1
    assert dt.doctor() == []


def test_resume_on_gpus_is_identical_with_the_cuda_rng(gpu_ranks, tmp_path):
    dt = gpu_ranks
    dt.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(dt, dropout=0.1)  # steps draw from the CUDA RNG
    dt.step(3)
    report = dt.resume_check(5)
    assert report.identical, report.summary()
    saved = dt.checkpoints()[-1]
    assert saved.status == "complete"

"""Healthy jobs of six shapes come out of %dt_doctor with nothing above advice, on a
loaded machine: a second dtlab job (8 ranks of its own) steps in another process the whole
time, so the 2 cores run 12 ranks and the timing checks must say "too noisy to judge"
rather than name a straggler or a rank waiting for data. Each shape runs 30 steps, and the
whole set runs twice. A false finding fails the test, with the finding in the message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dtlab import demo
from dtlab.control.cluster import running

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]

STEPS = 30
# the other job: 8 ranks of the demo stepping until SIGTERM, then shut down
LOAD = Path(__file__).resolve().parent.parent / "benchmarks" / "background_load.py"

CNN_JOB = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
model = DDP(net)  # BatchNorm statistics: rank 0's, broadcast by DDP each forward
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 3, 8, 8, generator=g)
dataset = TensorDataset(x, torch.randint(0, 4, (1024,), generator=g))
sampler = DistributedSampler(dataset, seed=0)
data = DataLoader(dataset, batch_size=16, sampler=sampler)
dtlab.attach(model, opt, data, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
             on_epoch=sampler.set_epoch)
"""

MANUAL_ALLREDUCE_JOB = """
import torch
import torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(64)]

def step(batch):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    for p in model.parameters():  # what DDP does, by hand
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss

dtlab.attach(model, opt, data, step=step)
"""


def _attach_lm(dt):
    demo.attach(dt, num_samples=1024)


def _attach_accumulation(dt):
    demo.attach(dt, num_samples=1024, accumulate=2)


def _attach_fsdp2(dt):
    demo.attach(dt, num_samples=1024, sharding="fsdp2")


def _attach_pipeline(dt):
    demo.attach_pipeline(dt, microbatches=2, num_samples=1024)


def _attach_cnn(dt):
    dt.execute("import dtlab\n" + CNN_JOB)


def _attach_manual_allreduce(dt):
    dt.execute("import dtlab\n" + MANUAL_ALLREDUCE_JOB)


SHAPES = {
    "DDP transformer LM": _attach_lm,
    "CNN with BatchNorm": _attach_cnn,
    "gradient accumulation": _attach_accumulation,
    "manual all-reduce": _attach_manual_allreduce,
    "pipeline": _attach_pipeline,
    "FSDP2": _attach_fsdp2,
}


@pytest.fixture(scope="module")
def other_job(tmp_path_factory):
    """The load: another dtlab job of 8 ranks stepping in its own process."""
    log = tmp_path_factory.mktemp("load") / "load.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(LOAD), "--ranks", "8"],
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            start_new_session=True,
            env={**os.environ, "DTLAB_RUNS_DIR": str(log.parent / "runs")},
        )
    try:
        deadline = time.monotonic() + 300
        line = proc.stdout.readline()  # blocks until it steps (or dies)
        if not line.startswith("stepping") or time.monotonic() > deadline:
            pytest.fail(f"the load job did not start stepping: {Path(log).read_text()[-2000:]}")
        yield proc
    finally:
        started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)  # it finishes its step and shuts its cluster down
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in running(started)], timeout=30)
        for leftover in alive:
            leftover.kill()
        assert [p.pid for p in alive] == [], "the load job left processes behind"


@pytest.mark.parametrize("round_", [1, 2])
def test_healthy_jobs_of_six_shapes_come_out_clean_under_load(live4, other_job, round_):
    dt = live4
    false_findings = {}
    for shape, attach in SHAPES.items():
        assert other_job.poll() is None, "the load job stopped: the machine is not loaded"
        attach(dt)
        dt.step(STEPS)
        results = dt.checks()
        worse = [
            f"{f.severity} {f.kind} {f.ranks} step {f.step}: {f.summary}"
            for r in results
            for f in r.findings
            if f.severity != "advice"
        ]
        if worse:
            false_findings[shape] = worse
        outcomes = {r.check: r.outcome for r in results}
        assert outcomes["numerics"] == "passed", (shape, outcomes)
    assert false_findings == {}, f"round {round_}: findings on healthy jobs: {false_findings}"

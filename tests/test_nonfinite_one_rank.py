"""A non-finite loss names the module it came from without anyone watching in advance:
the job re-runs that micro-batch's forward with hooks, leaving no trace (this process, no
cluster)."""

from __future__ import annotations

import math

import torch

from dtlab.agent import job as jobs
from dtlab.agent.attach import attach
from dtlab.agent.state import RANK
from tests.test_job_one_rank import batches, mse


class Blowup(torch.nn.Module):
    """Its output is inf on the calls ``bad(count)`` says (counted from 1)."""

    def __init__(self, bad):
        super().__init__()
        self.bad, self.calls = bad, 0

    def forward(self, x):
        self.calls += 1
        return x * math.inf if self.bad(self.calls) else x


def model_with(blowup: Blowup) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Dropout(0.5),
        blowup,
        torch.nn.ReLU(),
        torch.nn.Linear(8, 1),
    )


def test_the_first_module_with_an_inf_output_is_named_and_nothing_else_changes():
    blowup = Blowup(lambda call: call >= 3)  # steps 1-2 fine, then every forward blows up
    model = model_with(blowup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attach(model, opt, batches(), mse, accumulate=2)
    job = jobs.current()
    try:
        first = job.step()
        assert first.nonfinite_module is None and first.nonfinite_found == ""
        bn = model[1]
        stats = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
        rng = torch.get_rng_state()
        bad = job.step()  # micro-batches 3 and 4 of the run: the first bad one is index 0
        assert not math.isfinite(bad.loss)
        assert bad.nonfinite_module == "3"
        assert bad.nonfinite_found.startswith("found by re-running micro-batch 0")
        # the re-run left the job as the step would have: BatchNorm counted 2 batches
        # (its statistics went nan with the inf, as in any such step), and the RNG moved
        # only as the step's two forwards drew from it
        assert int(bn.num_batches_tracked) == stats[2] + 2
        assert blowup.calls == 5  # 4 forwards of the job + 1 re-run
        assert not torch.equal(torch.get_rng_state(), rng)
    finally:
        RANK.reset()


def test_an_inf_that_does_not_come_back_is_said_so_and_the_rng_is_the_steps():
    blowup = Blowup(lambda call: call == 1)  # once, never again
    model = model_with(blowup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attach(model, opt, batches(), mse)
    job = jobs.current()
    try:
        torch.manual_seed(7)
        bad = job.step()
        after_rerun = torch.get_rng_state()
        assert not math.isfinite(bad.loss) and bad.nonfinite_module is None
        assert "did not come back" in bad.nonfinite_found
        # the same step without the re-run draws the same random numbers: the re-run
        # forked the RNG and gave it back untouched
        torch.manual_seed(7)
        torch.nn.Dropout(0.5)(torch.ones(8, 8))  # the step's one dropout draw
        assert torch.equal(torch.get_rng_state(), after_rerun)
    finally:
        RANK.reset()


def test_a_model_with_sync_batchnorm_is_not_re_run():
    blowup = Blowup(lambda call: True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), blowup, torch.nn.Linear(8, 1))
    model.add_module("sync", torch.nn.SyncBatchNorm(1))  # present, not called
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    attach(model, opt, batches(), lambda m, b: mse(m[:3], b))
    try:
        bad = jobs.current().step()
        assert bad.nonfinite_module is None and blowup.calls == 1
        assert "SyncBatchNorm" in bad.nonfinite_found
    finally:
        RANK.reset()

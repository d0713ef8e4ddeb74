"""%dt_doctor on 4 live ranks where it used to give a false all-clear: batches that carry
no sample index (``(x, y)`` tuples, as most loaders make), and a job that learns nothing
(the DDP tutorial's one-output classifier under cross-entropy). Each fault is found with
its ranks and step; each healthy twin stays silent."""

import pytest

from dtlab.views.reports import doctor_summary

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

TUPLE_JOB = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed({seed})
data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(40)]
dtlab.attach(model, opt, data, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
"""

CLASSIFIER_JOB = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(10, {outputs}))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
data = [(torch.randn(20, 10, generator=g), torch.randint(0, {outputs}, (20,), generator=g))
        for _ in range(40)]
dtlab.attach(model, opt, data, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
"""


def by_check(dt):
    return {r.check: r for r in dt.checks()}


def test_every_rank_fed_the_same_tuple_batches_is_found_without_sample_indices(live4):
    dt = live4
    dt.execute(TUPLE_JOB.format(seed="0"))  # the bug: the same seed on every rank
    dt.step(6)
    assert dt.trace.records[0][-1].indices == ()  # (x, y): nothing says which samples
    result = by_check(dt)["data_order"]
    assert result.outcome == "found"
    (finding,) = result.findings
    assert finding.ranks == (0, 1, 2, 3) and finding.step == 1
    assert "same inputs" in finding.summary
    # advice from the evidence: a list, not a DataLoader, the same on every rank
    assert (
        finding.fix.startswith("batches come from list, not a DataLoader") and "seed" in finding.fix
    )
    assert dt.trace.jobs[0].data == "no DataLoader: list"


LOADER_JOB = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(640, 8, generator=g), torch.randn(640, 1, generator=g))
data = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
dtlab.attach(model, opt, data, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
"""


def test_a_dataloader_that_is_not_sharded_gets_the_sampler_advice(live4):
    dt = live4
    dt.execute(LOADER_JOB)  # shuffled, the same seed everywhere: no DistributedSampler
    dt.step(6)
    (finding,) = by_check(dt)["data_order"].findings
    assert finding.ranks == (0, 1, 2, 3) and "same inputs" in finding.summary
    assert finding.fix.startswith("the DataLoader (RandomSampler sampler) is the same")
    assert "DistributedSampler" in finding.fix


def test_its_healthy_twin_is_checked_and_passes(live4):
    dt = live4
    dt.execute(TUPLE_JOB.format(seed="rank"))  # each rank its own samples
    dt.step(12)
    results = dt.checks()
    assert [f.summary for r in results for f in r.findings] == []
    outcomes = {r.check: r.outcome for r in results}
    assert outcomes["data_order"] == "passed"  # it looked: the inputs' fingerprints
    assert outcomes["learning"] == "passed"


def test_a_one_output_classifier_that_learns_nothing_is_named(live4):
    dt = live4
    dt.execute(CLASSIFIER_JOB.format(outputs=1))  # cross-entropy of one logit: always 0
    dt.step(6)
    assert {rec.loss for recs in dt.trace.records.values() for rec in recs} == {0.0}
    found = [f for f in dt.doctor() if f.kind == "not_learning"]
    assert [(f.ranks, f.step, f.severity) for f in found] == [((0, 1, 2, 3), 1, "error")]
    assert "every gradient is zero" in found[0].summary
    text = doctor_summary(dt.checks())
    assert text.startswith("1 finding(s) (1 found something,")


def test_the_two_output_twin_learns_and_comes_out_clean(live4):
    dt = live4
    dt.execute(CLASSIFIER_JOB.format(outputs=2))
    dt.step(12)
    assert dt.doctor() == []
    assert by_check(dt)["learning"].outcome == "passed"


BRANCH_JOB = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if {branch}:
            h = h + self.extra(h)
        return self.head(h)

torch.manual_seed(0)
model = DDP(Net(), find_unused_parameters=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(40)]
dtlab.attach(model, opt, data, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
"""


def test_a_branch_taken_on_one_rank_only_is_named_although_ddp_filled_the_gradients(live4):
    dt = live4
    dt.execute(BRANCH_JOB.format(branch="rank == 0"))  # the bug: only rank 0 runs `extra`
    dt.step(6)
    # DDP averaged rank 0's gradient in: after the step every rank has one
    assert all(rec.missing_grads == () for recs in dt.trace.records.values() for rec in recs)
    found = [f for f in dt.doctor() if f.kind == "gradient_sync"]
    assert [(f.ranks, f.step, f.evidence["param"]) for f in found] == [
        ((1, 2, 3), 1, "extra.weight"),
        ((1, 2, 3), 1, "extra.bias"),
    ]
    assert "never reached by the backward of ranks 1-3" in found[0].summary


def test_the_same_branch_on_every_rank_comes_out_clean(live4):
    dt = live4
    dt.execute(BRANCH_JOB.format(branch="True"))
    dt.step(6)
    assert [f for f in dt.doctor() if f.kind == "gradient_sync"] == []
    # the setting is judged against what backward reached, in --explain (not a finding:
    # steps not seen may need it)
    assert dt.trace.jobs[0].find_unused_parameters is True
    why = {r.check: r for r in dt.checks()}["gradient_sync"].passed_because
    assert "find_unused_parameters=True, yet every rank's own backward reached every" in why

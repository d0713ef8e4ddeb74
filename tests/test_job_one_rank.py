"""The rank side of stepping in this one process (no cluster, no process group):
fingerprints, gradient statistics, and Job.step on a small model."""

import math

import pytest
import torch

from dtlab.agent import job as jobs
from dtlab.agent import recorder
from dtlab.agent.attach import attach
from dtlab.agent.state import RANK
from dtlab.agent.stepping import agree


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def test_fingerprints_tell_equal_bits_from_any_change():
    a = torch.randn(64, 32)
    b = a.clone()
    assert recorder.fingerprint(a) == recorder.fingerprint(b)
    b[3, 7] = torch.nextafter(b[3, 7], torch.tensor(math.inf))  # one ulp
    assert recorder.fingerprint(a) != recorder.fingerprint(b)
    assert recorder.fingerprint(torch.tensor([0.0])) != recorder.fingerprint(torch.tensor([-0.0]))
    assert recorder.fingerprints([a, None, b]) == [
        recorder.fingerprint(a),
        0,
        recorder.fingerprint(b),
    ]
    # what an xor of the elements would miss: constants, swaps, transposes
    ones, twos = torch.ones(4, 4), torch.full((4, 4), 2.0)
    assert recorder.fingerprint(ones) != recorder.fingerprint(twos)
    square = torch.randn(8, 8)
    assert recorder.fingerprint(square) != recorder.fingerprint(square.t().contiguous())
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = a.to(dtype)
        y = x.clone()
        y[0, 0] = -y[0, 0]
        assert recorder.fingerprint(x) != recorder.fingerprint(y)
        assert recorder.fingerprint(x) == recorder.fingerprint(x.clone())


def test_grad_stats_count_missing_and_non_finite_gradients():
    good = torch.full((4,), 2.0)
    bad = torch.tensor([1.0, math.inf, math.nan])
    norms, nonfinite, missing = recorder.grad_stats([good, None, bad])
    assert norms[0] == pytest.approx(4.0) and math.isnan(norms[1]) and not math.isfinite(norms[2])
    assert nonfinite == [0, 0, 2] and missing == [1]


def batches(num_batches=4, size=8):
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "x": torch.randn(size, 6, generator=gen),
            "y": torch.randn(size, 1, generator=gen),
            "index": torch.arange(i * size, (i + 1) * size),
        }
        for i in range(num_batches)
    ]


def mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def small_job(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, attach(model, opt, batches(), mse, **options)


def test_a_bare_model_steps_and_records_everything():
    epochs = []
    model, opt, info = small_job(on_epoch=epochs.append, capacity=5)
    assert info.wrapper is None and [p.name for p in info.params][:2] == ["0.weight", "0.bias"]
    job = jobs.current()
    records = [job.step() for _ in range(6)]
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[0].indices == tuple(range(8)) and records[4].indices == tuple(range(8))
    assert epochs == [1]  # data ran out after 4 batches: on_epoch, then it starts again
    assert all(r.loss > 0 for r in records) and records[-1].lr == 0.1
    rec = records[-1]
    assert len(rec.grad_norms) == len(rec.grad_fingerprints) == 4 and rec.missing_grads == ()
    assert rec.param_fingerprints[0] == recorder.fingerprint(model[0].weight)
    assert rec.memory.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert rec.memory.grad_bytes == rec.memory.param_bytes and rec.memory.rss > 0
    assert min(rec.times.forward, rec.times.backward, rec.times.optimizer) > 0
    assert len(job.records) == 5  # bounded buffer
    assert job.kept_steps() == (2, 6) and job.record_at(4) is records[3]
    assert job.record_at(1) is None  # dropped from the bounded buffer
    assert rec.grad_norm == pytest.approx(math.sqrt(sum(n * n for n in rec.grad_norms)))
    assert rec.num_nonfinite == 0 and rec.grad_fingerprint != 0 != rec.param_fingerprint
    summary = rec.summary()
    assert not summary.detailed and summary.grad_fingerprint == rec.grad_fingerprint
    quiet = job.step(record=False)
    assert quiet.grad_norms == () and quiet.param_fingerprints == () and quiet.loss > 0


def test_a_grad_scaler_step_that_overflows_is_recorded_as_skipped():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, opt, _ = small_job(scaler=scaler)
    job = jobs.current()
    first = job.step()
    assert first.scale == 2.0**10 and not first.skipped
    job.loss_fn = lambda m, b: mse(m, b) * math.inf
    before = [p.detach().clone() for p in model.parameters()]
    bad = job.step()
    assert bad.skipped and bad.scale == 2.0**10 and sum(bad.nonfinite) > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert job.step().scale < 2.0**10  # the scaler backed off


def test_attach_refuses_what_it_cannot_step_and_tensor_names_are_checked():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        attach("model", opt, [], mse)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        attach(model, None, [], mse)
    with pytest.raises(ValueError, match="capacity"):
        attach(model, opt, [], mse, capacity=0)
    with pytest.raises(RuntimeError, match="dtlab.attach"):
        jobs.current()
    small_job()
    job = jobs.current()
    assert job.tensor("0.weight", "param").shape == (8, 6) and job.tensor("0.weight") is None
    with pytest.raises(KeyError, match="did you mean one of"):
        job.tensor("weight")
    with pytest.raises(ValueError, match="'grad' or 'param'"):
        job.tensor("0.weight", "both")


def test_agreement_without_a_process_group_is_this_rank_alone():
    said = agree(True, False, 123, failed=True)
    assert (said.pause, said.hit, said.failed, said.differ) == (True, False, True, False)


def test_a_model_without_parameters_or_data_without_batches_is_named():
    with pytest.raises(ValueError, match="has no parameters"):
        attach(torch.nn.ReLU(), torch.optim.SGD([torch.zeros(1)], lr=0.1), [], mse)
    model = torch.nn.Linear(6, 1)
    attach(model, torch.optim.SGD(model.parameters(), lr=0.1), [], mse)
    with pytest.raises(RuntimeError, match="the data yields no batch"):
        jobs.current().step()


def test_fingerprints_of_zeros_sparse_and_strided_tensors():
    assert recorder.fingerprint(torch.zeros(3)) not in (0, recorder.fingerprint(torch.zeros(4)))
    dense = torch.zeros(5, 2)
    dense[3] = torch.tensor([1.0, 2.0])
    sparse = dense.to_sparse()
    assert recorder.fingerprint(sparse) == recorder.fingerprint(dense)
    norms, nonfinite, missing = recorder.grad_stats([sparse, None])
    assert norms[0] == pytest.approx(5**0.5) and nonfinite == [0, 0] and missing == [1]
    wide = torch.randn(4, 6)
    assert recorder.fingerprint(wide.t()) == recorder.fingerprint(wide.t().contiguous())


def test_the_accelerator_fingerprint_tells_changes_apart_and_reads_back_once():
    """device_prints is what a GPU rank uses (a weighted sum of the bits, one read-back);
    its arithmetic is the same on the CPU, where it can be checked here."""
    a = torch.randn(33, 17)
    b = a.clone()
    b[5, 2] = torch.nextafter(b[5, 2], torch.tensor(math.inf))
    square = torch.randn(8, 8)
    tensors = [a, a.clone(), b, square, square.t(), torch.ones(3), torch.full((3,), 2.0)]
    prints = recorder.device_prints(tensors)
    assert prints == [recorder.device_prints([t])[0] for t in tensors]  # batched = one by one
    assert prints[0] == prints[1] and prints[0] != prints[2]
    assert prints[3] != prints[4] and prints[5] != prints[6] and 0 not in prints
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = a.to(dtype)
        assert recorder.device_prints([x])[0] != recorder.device_prints([-x])[0]

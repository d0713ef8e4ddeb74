"""``dtlab.attach`` meets real loops (one process, no cluster): a whole step function,
``before_step`` (clipping), ``lr=fn(step)``, and hooks of the user's on the optimizer."""

import math

import pytest
import torch

from dtlab.agent import job as jobs
from dtlab.agent.attach import attach
from dtlab.agent.state import RANK
from tests.test_job_one_rank import batches, mse, small_job


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def reference(steps: int, clip: float | None = None, lr=None):
    """The same job as a plain loop: losses, gradient norms after clipping, LRs, weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, out = batches(), {"loss": [], "norm": [], "lr": []}
    for step in range(steps):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr(step)
        opt.zero_grad(set_to_none=True)
        loss = mse(model, data[step % len(data)])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norms = [p.grad.norm().item() for p in model.parameters()]
        out["norm"].append(math.sqrt(sum(n * n for n in norms)))
        out["lr"].append(opt.param_groups[0]["lr"])
        opt.step()
        out["loss"].append(loss.item())
    return out, model


def test_a_whole_step_function_is_watched_and_matches_the_plain_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def step(batch):  # what a real loop does between two batches
        opt.zero_grad(set_to_none=True)
        loss = mse(model, batch)
        loss.backward(retain_graph=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        schedule.step()
        return loss

    attach(model, opt, batches(), step=step)
    records = [jobs.current().step() for _ in range(5)]
    expected, ref_model = reference(5, clip=0.05, lr=lambda s: 0.1 * 0.5 ** (s // 2))
    assert [r.loss for r in records] == expected["loss"]
    assert [r.lr for r in records] == expected["lr"]  # the LR the step used, its scheduler's
    assert [r.grad_norm for r in records] == pytest.approx(expected["norm"], rel=1e-6)
    assert all(r.grad_norm <= 0.05 * (1 + 1e-5) for r in records)  # after its own clipping
    assert all(r.micro_batches == 1 and not r.skipped for r in records)
    assert records[0].indices == tuple(range(8))
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True)
    )


def test_a_step_function_whose_step_a_scaler_skips_is_recorded_as_skipped():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    poison = [False]

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = mse(model, batch) * (math.inf if poison[0] else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    attach(model, opt, batches(), step=step)
    job = jobs.current()
    good = job.step()
    poison[0] = True
    bad = job.step()
    assert not good.skipped and bad.skipped and sum(bad.nonfinite) > 0
    assert good.scale == 2.0**8 and math.isfinite(good.loss)  # unscaled: what it computed
    assert good.loss == pytest.approx(mse(model, batches()[0]).item(), rel=0.5)


def test_before_step_and_lr_shape_the_loss_fn_step():
    clip = lambda model, opt: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # noqa: E731
    lr = lambda step: 0.2 / (1 + step)  # noqa: E731
    small_job(before_step=clip, lr=lr)
    records = [jobs.current().step() for _ in range(4)]
    expected, _ = reference(4, clip=0.05, lr=lr)
    assert [r.lr for r in records] == expected["lr"] == [0.2, 0.1, 0.2 / 3, 0.05]
    assert [r.loss for r in records] == expected["loss"]
    assert [r.grad_norm for r in records] == pytest.approx(expected["norm"], rel=1e-6)


def test_gradients_are_recorded_after_the_users_own_optimizer_hooks():
    model, opt, _ = small_job()
    calls = []

    def halve(optimizer, args, kwargs):  # a manual "all-reduce" done in a pre-hook
        for p in model.parameters():
            p.grad.div_(2)
        calls.append("pre")
        return None

    opt.register_step_pre_hook(halve)
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    rec = jobs.current().step()
    norms = [p.grad.norm().item() for p in model.parameters()]
    assert calls == ["pre", "post"]  # dtlab broke none of them
    assert rec.grad_norm == pytest.approx(math.sqrt(sum(n * n for n in norms)))  # after it


def test_attach_says_which_form_it_needs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="either loss_fn"):
        attach(model, opt, [])
    with pytest.raises(TypeError, match="either loss_fn"):
        attach(model, opt, [], mse, step=lambda b: None)
    with pytest.raises(TypeError, match="leave out before_step"):
        attach(model, opt, [], step=lambda b: None, before_step=lambda m, o: None)
    with pytest.raises(TypeError, match="lr= must be callable"):
        attach(model, opt, [], mse, lr=0.1)


def test_a_fault_for_dtlabs_own_loop_says_so_on_a_job_that_runs_its_own():
    from dtlab import inject

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attach(model, opt, batches(), step=lambda batch: None)
    for plant in (lambda: inject.slow(0.1), lambda: inject.hang_at(3), inject.skip_set_epoch):
        with pytest.raises(RuntimeError, match="dtlab's own training loop .* StepFnJob"):
            plant()

"""Pipeline-parallel demo jobs on live ranks: the same maths as one process, and boundaries
moved on the running job (weights and optimizer state travel; nothing restarts)."""

from __future__ import annotations

import pytest
import torch

from dtlab import demo
from dtlab.agent.demo_model import (
    DemoConfig,
    DemoLM,
    next_token_loss,
    pipeline_data,
    split_tokens,
    warmup_schedule,
)
from dtlab.agent.threads import same_threads
from dtlab.control.partitions import RepartitionFailed
from dtlab.records import PlanError
from tests.conftest import rank_threads

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
MICRO = 4


def one_process(session, steps: int, *, microbatches: int = MICRO, **config):
    """The demo trained in this process at the ranks' thread count (a count of its own
    rounds differently, dtlab/agent/threads.py): per step the micro-batches' gradients
    summed, then divided by their number (what the pipeline schedule does); losses and
    weights."""
    with same_threads(rank_threads(session)):
        return _one_process(steps, microbatches, DemoConfig(**config))


def _one_process(steps: int, microbatches: int, c: DemoConfig):
    torch.manual_seed(c.seed)
    model = DemoLM(c)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = warmup_schedule(optimizer)
    batches, losses = iter(pipeline_data(c)), []
    for _ in range(steps):
        inputs, target = split_tokens(next(batches))
        optimizer.zero_grad(set_to_none=True)
        parts = []
        for x, y in zip(
            inputs.tensor_split(microbatches), target.tensor_split(microbatches), strict=True
        ):
            loss = next_token_loss(model(x), y)
            loss.backward()
            parts.append(loss.item())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(microbatches)
        optimizer.step()
        scheduler.step()
        losses.append(sum(parts) / len(parts))
    return losses, model.state_dict()


def _stage_state() -> dict:
    from dtlab.agent.pipeline_job import current

    return {k: v.detach().clone() for k, v in current().module.state_dict().items()}


def losses(session, first: int, last: int) -> list[float]:
    trace = session.trace
    return [trace.at(step)[0].loss for step in range(first, last + 1)]


def weights(session) -> dict:
    merged = {}
    for state in session.run(_stage_state).values():
        merged.update(state)
    return merged


@pytest.mark.parametrize("size", [2, 4])
def test_the_pipeline_trains_as_one_process_does(size, request):
    dt = request.getfixturevalue(f"live{size}")
    demo.attach_pipeline(dt, plan="parameters", microbatches=MICRO)
    assert dt.partition().num_stages == size
    dt.step(4)
    expected, state = one_process(dt, 4)
    assert losses(dt, 1, 4) == expected  # bitwise: the same operations in the same order
    got = weights(dt)
    assert sorted(got) == sorted(state)
    assert all(torch.equal(got[name], state[name]) for name in state)
    whole, _ = one_process(dt, 4, microbatches=1)  # one batch, no micro-batches: rounding only
    assert losses(dt, 1, 4) == pytest.approx(whole, rel=1e-5)


def test_a_live_move_keeps_training_as_if_nothing_moved(live4):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=MICRO, schedule="1f1b")
    dt.step(3)
    dt.profile_blocks()  # measuring the blocks must leave the job as it was
    before = dt.partition()
    moved = dt.repartition(
        [["embed"], ["blocks.0", "blocks.1"], ["blocks.2"], ["blocks.3", "norm", "head"]]
    )
    after = dt.partition()
    assert after != before and after.stage_blocks(3) == ("blocks.3", "norm", "head")
    assert set(moved["moved"]) == {"blocks.0", "blocks.2", "blocks.3", "norm"}
    state = one_process(dt, 0)[1]
    travelled = ("blocks.0.", "blocks.2.", "blocks.3.", "norm.")
    numel = sum(v.numel() for k, v in state.items() if k.startswith(travelled))
    assert moved["bytes"] > 3 * 4 * numel  # float32 weights and both Adam moments travelled
    dt.step(3)
    expected, state = one_process(dt, 6)
    assert losses(dt, 4, 6) == expected[3:]
    got = weights(dt)
    assert all(torch.equal(got[name], state[name]) for name in state)
    reports = dt.stage_reports()
    assert reports[3].blocks == ("blocks.3", "norm", "head") and reports[3].step == 6
    assert dt.balance().stages[3].blocks == ("blocks.3", "norm", "head")


@pytest.mark.parametrize(
    "plan, problem",
    [
        ([0, 2, 2, 5, 7], "empty"),
        ([3, 2, 5], "increas"),
        ([2, 4, 9], "range"),
        ({r"blocks\.\d": 1, "nothing": 2}, "nothing"),
        ([0, 2, 4, 5, 6, 7], "4 ranks"),
        ("fastest", "method"),
    ],
)
def test_a_bad_plan_is_refused_and_nothing_moves(live4, plan, problem):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=2)
    dt.step(1)
    before = weights(dt)
    with pytest.raises(PlanError, match=problem):
        dt.repartition(plan)
    assert dt.partition().bounds == (0, 2, 4, 6, 7)
    after = weights(dt)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_failure_mid_move_leaves_every_rank_as_it_was(live4):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=MICRO)
    dt.step(2)
    dt.run(lambda: __import__("dtlab").inject.fail_repartition(), ranks=[2])
    with pytest.raises(RepartitionFailed, match=r"(?s)called off.*rank 2.*injected failure"):
        dt.repartition("parameters")
    assert dt.partition().bounds == (0, 2, 4, 6, 7)
    dt.step(2)  # the job goes on from where it was, bit for bit
    assert losses(dt, 3, 4) == one_process(dt, 4, microbatches=MICRO)[0][2:]


def _unpicklable_block() -> None:
    from dtlab.agent.pipeline_job import current

    current().module.block("blocks.1").note = lambda: None  # a closure cannot be sent


def test_a_block_that_cannot_move_is_refused_before_anything_moves(live4):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=MICRO)
    dt.step(2)
    dt.run(_unpicklable_block, ranks=[1])
    with pytest.raises(RepartitionFailed, match=r"(?s)called off.*blocks\.1.*cannot move"):
        dt.repartition(
            [["embed"], ["blocks.0"], ["blocks.1", "blocks.2", "blocks.3"], ["norm", "head"]]
        )  # blocks.1 would leave rank 1
    assert dt.partition().bounds == (0, 2, 4, 6, 7)
    dt.step(2)
    assert losses(dt, 3, 4) == one_process(dt, 4, microbatches=MICRO)[0][2:]


def test_a_rank_dying_mid_move_is_reported_with_the_way_back(live4, tmp_path):
    dt = live4
    dt.checkpoint_root = tmp_path / "checkpoints"
    demo.attach_pipeline(dt, plan="uniform", microbatches=2)
    dt.step(2)
    saved = dt.checkpoint()
    dt.run(lambda: __import__("dtlab").inject.die_in_repartition(), ranks=[1])
    with pytest.raises(RepartitionFailed) as failed:
        dt.repartition("parameters", timeout=10)
    text = str(failed.value)
    assert "rank(s) [1] died during the re-partition" in text
    assert f"step {saved.step}" in text and "%dt_restart --from-checkpoint" in text
    dt.restart(from_checkpoint="latest")  # the way back it offers works
    assert dt.partition().bounds == (0, 2, 4, 6, 7)
    dt.step(1)
    assert losses(dt, 3, 3) == one_process(dt, 3, microbatches=2)[0][2:]

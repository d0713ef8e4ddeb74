"""Stepping the demo job on 4 live ranks, and the analysis naming what went wrong where."""

import os
import signal
import threading

import pytest

from dtlab import demo
from dtlab.control.errors import RankError
from dtlab.records.trace import Trace

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

PERTURB = """
import torch
from dtlab.agent.job import current
with torch.no_grad():
    dict(current().module.named_parameters())[{name!r}].add_(1e-3)
"""

WRAP_LOSS = """
from dtlab.agent.job import current
_job = current()
_inner = _job.loss_fn
{setup}
def _wrapped(model, batch):
{body}
    return _inner(model, batch)
_job.loss_fn = _wrapped
"""


def wrap_loss(dt, ranks, body: str, setup: str = "") -> None:
    """Change what the forward does on some ranks only (the job's own code is untouched)."""
    dt.execute(WRAP_LOSS.format(setup=setup, body=body), ranks=ranks)


def test_ddp_demo_steps_with_equal_fingerprints_on_every_rank(live4):
    dt = live4
    infos = demo.attach(dt)
    assert {i.wrapper for i in infos.values()} == {"DistributedDataParallel"}
    result = dt.step(5)
    assert (result.first_step, result.last_step, result.stopped) == (0, 5, "steps")
    trace = dt.trace
    assert trace.last_step == 5 and len(trace) == 20
    for step in range(1, 6):
        at = trace.at(step)  # whole-step summaries: what travels every step
        assert sorted(at) == [0, 1, 2, 3] and not any(r.detailed for r in at.values())
        assert len({r.grad_fingerprint for r in at.values()}) == 1  # after the all-reduce
        assert len({r.param_fingerprint for r in at.values()}) == 1
        assert len({r.loss for r in at.values()}) > 1  # each rank saw its own data
        details = dt.step_details(step)  # per parameter, from the ranks' buffers
        assert len({r.grad_fingerprints for r in details.values()}) == 1
        assert len({r.param_fingerprints for r in details.values()}) == 1
        assert all(len(r.grad_norms) == len(trace.params) for r in details.values())
    indices = [set(trace.at(1)[r].indices) for r in dt.ranks]
    assert all(not (a & b) for i, a in enumerate(indices) for b in indices[i + 1 :])
    assert dt.divergence("grad") is None and dt.divergence("param") is None
    # the run folder holds the same records, readable by another notebook
    loaded = Trace.load(trace.folder)
    assert loaded.records == trace.records and loaded.param_names == trace.param_names


def test_a_parameter_changed_on_rank_2_is_named_with_its_step(live4):
    dt = live4
    demo.attach(dt)
    dt.step(3)
    name = dt.trace.param_names[5]
    dt.execute(PERTURB.format(name=name), ranks=[2])
    dt.step(2)
    found = dt.divergence("param")
    assert (found.step, found.param, found.outliers) == (4, name, (2,))
    assert found.majority == (0, 1, 3)
    assert dt.divergence("grad") is None  # DDP averages gradients; the weights drifted
    kinds = {(f.kind, f.ranks, f.step) for f in dt.findings()}
    assert ("divergence", (2,), 4) in kinds
    detail = dt.divergence_detail("param")
    assert list(detail) == [2] and detail[2].max_abs > 1e-4


def test_a_leak_on_rank_1_is_found_for_rank_1_only(live4):
    dt = live4
    demo.attach(dt)
    # memory freed by earlier tests would hide the first steps of the leak from RSS: give
    # it back to the OS first, as a fresh process would be
    dt.execute("import ctypes; ctypes.CDLL('libc.so.6').malloc_trim(0)")
    wrap_loss(dt, [1], "    _kept.append(torch.ones(2**20))  # 4 MiB a step", "_kept = []")
    dt.step(20)
    leaks = [f for f in dt.findings() if f.kind == "leak"]
    assert [f.ranks for f in leaks] == [(1,)]


def test_a_slow_rank_3_is_found_as_the_straggler(live4):
    dt = live4
    demo.attach(dt)
    wrap_loss(dt, [3], "    time.sleep(0.04)", "import time")
    dt.step(10)
    verdict = steady_straggler_verdict(dt)
    stragglers = [f for f in verdict.findings if f.kind == "straggler"]
    assert [f.ranks for f in stragglers] == [(3,)], verdict.passed_because


def steady_straggler_verdict(dt, more: int = 10, rounds: int = 5):
    """The stragglers check, after more steps while it says the timings are too noisy to
    judge (a busy machine): wait on its verdict, not on a fixed number of steps."""
    for _ in range(rounds):
        result = {r.check: r for r in dt.checks()}["stragglers"]
        if result.outcome != "not checked":
            return result
        dt.step(more)
    return result


def test_run_until_nonfinite_pauses_every_rank_at_that_step(live4):
    dt = live4
    demo.attach(dt)
    wrap_loss(
        dt,
        [3],
        "    if current().step_count + 1 == 7:\n        return _inner(model, batch) * float('nan')",
    )
    result = dt.run_until("nonfinite", max_steps=50)
    assert (result.last_step, result.stopped) == (7, "until")
    assert 3 in result.hit_ranks
    assert {recs[-1].step for recs in dt.trace.records.values()} == {7}
    assert dt.step(1).last_step == 8  # the process group is fine afterwards


def test_bare_models_diverge_at_once_and_run_until_says_so(live4):
    dt = live4
    demo.attach(dt, ddp=False)  # no gradient all-reduce: each rank trains on its own
    result = dt.run_until("diverged", max_steps=20)
    assert (result.last_step, result.stopped) == (1, "until")
    assert dt.divergence("grad").step == 1


@pytest.mark.parametrize("ddp", [False, True])
def test_ctrl_c_pauses_all_ranks_after_the_same_step(live4, ddp):
    dt = live4
    demo.attach(dt, ddp=ddp)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as e:  # once every rank paused
            dt.step(2000)
    finally:
        timer.cancel()
    result = e.value.result
    assert result.stopped == "pause" and 1 <= result.last_step < 2000
    assert {recs[-1].step for recs in dt.trace.records.values()} == {result.last_step}
    assert dt.step(1).last_step == result.last_step + 1


def test_an_error_on_one_rank_is_named_and_the_others_go_on(live4):
    dt = live4
    demo.attach(dt, ddp=False)
    dt.step(2)
    wrap_loss(dt, [2], "    raise RuntimeError('bad batch on purpose')")
    with pytest.raises(RankError) as info:
        dt.step(1)
    assert list(info.value.failures) == [2]
    assert "bad batch on purpose" in str(info.value)
    assert set(info.value.finished) == {0, 1, 3}


def test_tensors_come_from_the_latest_step_only(live4):
    dt = live4
    demo.attach(dt)
    dt.step(2)
    name = dt.trace.param_names[0]
    grads = dt.grads(name, ranks=[0, 3])
    assert sorted(grads) == [0, 3] and (grads[0] == grads[3]).all()
    with pytest.raises(ValueError, match="latest step"):
        dt.grads(name, step=1)
    with pytest.raises(RankError, match="no parameter"):
        dt.grads("no.such.weight", ranks=[0])


def test_stepping_without_a_job_says_how_to_attach_one(live4):
    dt = live4
    dt.execute("from dtlab.agent.state import RANK as _r; _r.job = None")
    with pytest.raises(RankError, match="dtlab.attach") as info:
        dt.step(1)
    assert sorted(info.value.failures) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="at least 1"):
        dt.step(0)


def test_an_error_mid_run_stops_the_other_ranks_at_the_step_boundary(live4):
    dt = live4
    demo.attach(dt, ddp=False)
    once = "    if current().step_count + 1 == 4 and not _raised:\n        _raised.append(1)\n"
    wrap_loss(dt, [2], once + "        raise ValueError('step 4 on purpose')", "_raised = []")
    with pytest.raises(RankError) as info:
        dt.step(20)
    assert list(info.value.failures) == [2] and "step 4 on purpose" in str(info.value)
    assert set(info.value.finished) == {0, 1, 3} and info.value.stuck == ()
    steps = {rank: recs[-1].step for rank, recs in dt.trace.records.items()}
    # the others stopped at their next agreement, not ran on to step 20: agreements come
    # twice as many steps apart each time (after steps 1, 3, 7, ...) up to ~1 s apart
    assert steps[2] == 3 and max(steps.values()) <= 2 * 4
    assert dt.step(3).stopped == "steps"  # it raised once: the ranks go on together


def test_a_timeout_pauses_every_rank_instead_of_breaking_the_group(live4):
    dt = live4
    demo.attach(dt)
    result = dt.step(100_000, timeout=1.0)
    assert result.stopped == "timeout" and result.last_step >= 1
    assert {recs[-1].step for recs in dt.trace.records.values()} == {result.last_step}
    assert dt.step(1).last_step == result.last_step + 1


def test_conditions_that_cannot_be_checked_are_refused(live4):
    dt = live4
    demo.attach(dt)
    dt.step(2)
    with pytest.raises(ValueError, match="step>=2 holds already"):
        dt.run_until("step>=2")
    with pytest.raises(RankError, match="turn recording on"):
        dt.run_until("diverged", record=False)
    assert dt.step(1).last_step == 3

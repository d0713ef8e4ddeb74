"""The doctor never gives a false all-clear: each check passes, finds something, or says it
could not look (and what would let it); and a job that learns nothing is named. Records
built in one process (tests/fakes.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtlab.analysis.checks_data import check_data_order
from dtlab.analysis.checks_learning import MIN_STEPS, check_learning
from dtlab.analysis.checks_state import check_buffers
from dtlab.analysis.checks_sync import check_gradient_sync
from dtlab.analysis.doctor import run_checks
from dtlab.records import Evidence, InitialState
from dtlab.views.reports import doctor_summary
from tests.fakes import PARAMS, job_info, step_record

NAMES = tuple(p.name for p in PARAMS)


def job(num_ranks=4, num_steps=12, **changes):
    return {
        r: [step_record(s, r, **changes) for s in range(1, num_steps + 1)] for r in range(num_ranks)
    }


def evidence(records):
    start = InitialState(param_fingerprints=tuple(range(len(PARAMS))))
    return Evidence(
        records=records,
        names=NAMES,
        jobs={r: job_info(r) for r in records},
        initial={r: start for r in records},
    )


# --- three outcomes ------------------------------------------------------------------------


def test_data_order_without_sample_identity_is_not_checked_never_passed():
    records = job(indices=())  # (x, y) tuples: no sample index, no input fingerprint
    result = check_data_order(evidence(records))
    assert result.outcome == "not checked"
    assert "sample identity unknown" in result.passed_because
    assert "indices=" in result.needs and "DataLoader" in result.needs


def test_data_order_with_input_fingerprints_but_no_indices_looks():
    records = {
        r: [step_record(s, r, indices=(), input_fingerprints=(s * 10 + r,)) for s in range(1, 9)]
        for r in range(4)
    }
    assert check_data_order(evidence(records)).outcome == "passed"


def test_same_inputs_on_every_rank_are_found_without_indices():
    records = {
        r: [step_record(s, r, indices=(), input_fingerprints=(s * 10,)) for s in range(1, 9)]
        for r in range(4)
    }
    result = check_data_order(evidence(records))
    assert result.outcome == "found" and result.findings[0].ranks == (0, 1, 2, 3)


def test_gradient_sync_with_recording_off_is_not_checked():
    records = job(grad_norms=(), grad_fingerprints=(), param_fingerprints=(), nonfinite=())
    result = check_gradient_sync(evidence(records))
    assert result.outcome == "not checked" and "recording" in result.needs


def test_one_rank_has_nothing_to_compare():
    results = {r.check: r for r in run_checks(evidence(job(num_ranks=1)))}
    for name in ("gradient_sync", "learning_rate", "data_order", "initial_state"):
        assert results[name].outcome == "not checked", name
        assert (
            "one rank" in results[name].passed_because
            or "two ranks" in results[name].passed_because
        )


def test_the_summary_says_every_check_passed_only_when_every_check_looked():
    healthy = run_checks(evidence(job(num_steps=12)))
    assert {r.outcome for r in healthy} == {"passed"}, [
        (r.check, r.passed_because) for r in healthy if r.outcome != "passed"
    ]
    assert doctor_summary(healthy).startswith("no problem found: every check passed")
    # a hang or a death named above it (dtlab doctor on a run folder): not "no problem"
    beside = doctor_summary(healthy, named=True)
    assert beside.startswith("no other problem in the step records: every check passed")

    blind = run_checks(evidence(job(num_steps=12, indices=())))
    text = doctor_summary(blind)
    assert "every check passed" not in text
    assert text.startswith("no problem found in what could be checked:")
    assert "1 not checked" in text
    assert "not checked: data_order: sample identity unknown" in text
    assert "(to check: pass indices=" in text


def test_the_summary_counts_found_passed_and_not_checked():
    records = job(num_steps=12, indices=())
    # a 10x LR moves the parameters 10x as far (Adam): the same update per unit of LR
    records[2] = [
        replace(rec, lr=rec.lr * 10, update_rms=rec.update_rms * 10) for rec in records[2]
    ]
    text = doctor_summary(run_checks(evidence(records)))
    first = text.splitlines()[0]
    assert first == "1 finding(s) (1 found something, 11 passed, 1 not checked), most severe first:"


# --- a job that learns nothing -------------------------------------------------------------


def zero_grads(num_steps=8, loss=0.0):
    """The DDP tutorial's one-output classifier under cross-entropy: loss 0, no gradient."""
    zeros = (0.0,) * len(PARAMS)
    return {
        r: [
            step_record(
                s, r, loss=loss, grad_norms=zeros, param_fingerprints=tuple(range(len(PARAMS)))
            )
            for s in range(1, num_steps + 1)
        ]
        for r in range(4)
    }


def test_all_zero_gradients_on_every_rank_are_named():
    result = check_learning(evidence(zero_grads()))
    (finding,) = result.findings
    assert finding.kind == "not_learning" and finding.severity == "error"
    assert finding.ranks == (0, 1, 2, 3) and finding.step == 1
    assert "every gradient is zero" in finding.summary and "the loss is 0" in finding.summary
    assert "single-logit" in finding.fix


def test_an_lr_of_zero_throughout_is_named():
    result = check_learning(evidence(job(num_steps=8, lr=0.0)))
    assert [f.summary.split(" (")[0] for f in result.findings] == ["the LR is 0 at every step"]


def test_parameters_that_never_change_are_named():
    frozen = tuple(range(len(PARAMS)))
    result = check_learning(evidence(job(num_steps=8, param_fingerprints=frozen)))
    (finding,) = result.findings
    assert "did not change" in finding.summary


def test_a_constant_loss_with_moving_parameters_is_a_warning():
    result = check_learning(evidence(job(num_steps=8, loss=0.6931)))
    (finding,) = result.findings
    assert finding.severity == "warning" and "0.6931" in finding.summary


@pytest.mark.parametrize(
    "healthy",
    [
        "warm-up from an LR of 0",
        "one step with zero gradients",
        "one rank learning",
        "skipped steps",
    ],
)
def test_a_job_that_learns_is_not_flagged(healthy):
    records = job(num_steps=8)
    if healthy == "warm-up from an LR of 0":
        records = {
            r: [replace(rec, lr=0.0) if rec.step == 1 else rec for rec in recs]
            for r, recs in records.items()
        }
    elif healthy == "one step with zero gradients":
        records = zero_grads()
        records[1][4] = step_record(5, 1)
    elif healthy == "one rank learning":
        records = zero_grads()
        records[3] = [step_record(s, 3) for s in range(1, 9)]
    else:  # a GradScaler's skipped steps change nothing, and do not count
        records = {
            r: [replace(rec, skipped=rec.step % 2 == 0) for rec in recs]
            for r, recs in records.items()
        }
    assert check_learning(evidence(records)).findings == ()


def test_too_few_steps_to_judge_learning():
    result = check_learning(evidence(zero_grads(num_steps=MIN_STEPS - 1)))
    assert result.outcome == "not checked" and f"{MIN_STEPS} steps" in result.needs


def test_an_environment_difference_is_said_to_date_from_launch():
    from dtlab.records import CheckResult, Finding
    from dtlab.views.reports import findings_table

    finding = Finding("environment", (1,), "rank 1 out of step with the rest: NCCL_ALGO")
    result = CheckResult("environment", "Environment", (finding,), "the launch")
    assert "1. [warning] rank 1 out of step with the rest: NCCL_ALGO (from launch)" in (
        doctor_summary([result])
    )
    assert findings_table([finding]).rows[0][3] == "launch"


def noisy_job(slow_rank=None, seed=0, num_steps=20, slower=3.0, slow_share=1.0):
    """Compute times that jump around step to step, as on oversubscribed cores; with
    ``slow_rank`` slower by ``slower`` in a share of the steps."""
    import numpy as np

    from dtlab.records import StepTimes

    rng = np.random.default_rng(seed)
    records = {}
    for r in range(8):
        recs = []
        for s in range(1, num_steps + 1):
            slow = r == slow_rank and rng.random() < slow_share
            forward = 0.01 * float(rng.lognormal(0.0, 0.9)) * (slower if slow else 1.0)
            times = StepTimes(data=0.001, forward=forward, backward=0.02, optimizer=0.005)
            recs.append(step_record(s, r, times=times))
        records[r] = recs
    return records


@pytest.mark.parametrize("seed", range(20))
def test_noise_alone_makes_no_straggler(seed):
    from dtlab.analysis.checks_resources import check_stragglers

    assert check_stragglers(evidence(noisy_job(seed=seed))).findings == ()


def test_a_rank_slow_in_some_steps_on_noisy_cores_is_too_noisy_to_judge():
    """Every rank's compute swings 4x from step to step; rank 5 is 3x slower in three
    steps of five: slower by the median, not steadily. Straggler or noise? Not said."""
    from dtlab.analysis.checks_resources import check_stragglers
    from dtlab.records import StepTimes

    def times(step, rank):
        forward = 0.005 if step % 2 else 0.02
        if rank == 5 and step % 5 in (0, 1, 2):
            forward *= 3
        return StepTimes(data=0.001, forward=forward, backward=0.02, optimizer=0.005)

    records = {r: [step_record(s, r, times=times(s, r)) for s in range(1, 21)] for r in range(8)}
    result = check_stragglers(evidence(records))
    assert result.findings == ()
    assert result.outcome == "not checked"
    assert "timings too noisy to judge: rank 5 slower by the median" in result.passed_because


def test_a_rank_ten_times_slower_is_still_found_through_the_noise():
    from dtlab.analysis.checks_resources import check_stragglers

    result = check_stragglers(evidence(noisy_job(slow_rank=5, slower=10.0)))
    assert [f.ranks for f in result.findings] == [(5,)]


# --- buffers -------------------------------------------------------------------------------


def buffer_job(prints_by_rank):
    """Two steps per rank whose buffers have these per-buffer fingerprints."""
    records = {
        r: [
            step_record(s, r, buffer_fingerprints=prints, buffer_fingerprint=hash(prints) or 1)
            for s in (1, 2)
        ]
        for r, prints in prints_by_rank.items()
    }
    jobs = {r: job_info(r, buffers=("bn.running_mean", "bn.running_var")) for r in records}
    return replace(evidence(records), details=records, jobs=jobs)


def test_a_buffer_that_drifts_is_named():
    result = check_buffers(buffer_job({0: (7, 8), 1: (7, 8), 2: (7, 9)}))
    (finding,) = result.findings
    assert finding.ranks == (2,) and finding.evidence["first"] == "bn.running_var"


def test_ranks_holding_different_numbers_of_buffers_are_not_a_drift():
    # the first rank's buffers are a prefix of the others': no buffer differs to be named
    # (this raised TypeError: _first_difference found none)
    result = check_buffers(buffer_job({0: (7,), 1: (7, 8)}))
    assert result.findings == () and "different numbers of buffers" in result.passed_because


def test_divergence_in_the_summaries_is_named_when_the_details_are_gone():
    """A long run: the per-parameter record of the step where rank 2 parted is no longer on
    the ranks (their buffers keep the last steps only). The doctor names the rank and step
    from the whole-step fingerprints instead of saying every step agrees."""
    records = job()
    records[2] = [
        rec if rec.step < 7 else replace(rec, param_fingerprint=rec.param_fingerprint ^ 1)
        for rec in records[2]
    ]
    summaries = {r: [rec.summary() for rec in recs] for r, recs in records.items()}
    result = check_gradient_sync(evidence(summaries))  # no details: evicted
    [found] = result.findings
    assert found.kind == "divergence" and found.ranks == (2,) and found.step == 7
    assert found.summary.startswith(
        "parameters diverge from step 7 (whole-step fingerprints): rank 2 differs from the copy "
        "ranks 0-1,3 hold"
    ), found.summary
    assert "which parameter is not known" in found.summary
    assert "step 7" in found.fix and "--until diverged" in found.fix
    # a split with no majority lists every group and takes none as right
    for r in (0, 1):
        records[r] = [replace(rec, grad_fingerprint=rec.grad_fingerprint ^ 2) for rec in records[r]]
    split = {r: [rec.summary() for rec in recs] for r, recs in records.items()}
    grads = [f for f in check_gradient_sync(evidence(split)).findings if "gradients" in f.summary]
    assert grads and "the ranks split ranks 0-1 | ranks 2-3" in grads[0].summary

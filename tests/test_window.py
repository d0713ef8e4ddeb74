"""A Trace's bounded window: the last ``window`` steps of every rank in memory, the older
ones in its run folder (read back on demand) and in one summary row per step."""

import math
from dataclasses import replace

import numpy as np
import pytest

from dtlab.analysis.doctor import run_checks
from dtlab.control.run_folder_writer import FolderWriter
from dtlab.records import Evidence
from dtlab.records.packed import pack, read_frame
from dtlab.records.summaries import summarize
from dtlab.records.trace import WINDOW_ENV, Trace
from dtlab.views.reports import doctor_summary
from tests.fakes import job_info, step_record

RANKS = 4


def record(step: int, rank: int):
    """A healthy step, but rank 2's parameters part from the others at step 37, rank 1's
    loss is nan at step 50, rank 3 is the slowest from step 60 and its memory grows."""
    changes: dict = {}
    if rank == 2 and step >= 37:
        changes["param_fingerprint"] = 999_000 + step
    if rank == 1 and step == 50:
        changes["loss"] = math.nan
    rec = step_record(step, rank, **changes)
    if rank == 3 and step >= 60:
        times = replace(rec.times, forward=0.05)
        rec = replace(rec, times=times, memory=replace(rec.memory, rss=500_000_000 + step))
    return rec


def run(trace: Trace, steps: int, chunk: int = 5) -> dict:
    """Feed ``steps`` steps as each rank would send them (a frame per rank per run), a
    flush at the end of each run; returns every record made, by (rank, step)."""
    made = {}
    for start in range(1, steps + 1, chunk):
        for rank in range(RANKS):
            recs = [record(s, rank) for s in range(start, min(start + chunk, steps + 1))]
            made.update({(rank, r.step): r.summary() for r in recs})
            trace.add_packed(rank, pack(rank, [r.summary() for r in recs]).to_bytes())
        trace.flush()
    return made


@pytest.fixture
def trace(tmp_path):
    return Trace(
        {r: job_info(r) for r in range(RANKS)}, sink=FolderWriter(tmp_path / "run"), window=20
    )


def test_memory_holds_the_window_and_the_run_folder_the_rest(trace):
    made = run(trace, 200)
    assert trace.last_step == 200
    # it slides a quarter window at a time: between window and 1.25 x window steps stay
    held = {len(recs) for recs in trace.records.values()}
    assert held <= set(range(20, 26)), held
    assert trace.first_step == 200 - len(trace.records[0]) + 1
    assert trace.records[0][0].step == trace.first_step
    rows = trace.columns.rows()
    assert len(rows) == RANKS * len(trace.records[0]) and rows["step"].min() == trace.first_step
    # a step the window left, read back from the folder, is the record that was sent
    old = trace.at(7)
    assert set(old) == set(range(RANKS)) and all(old[r] == made[(r, 7)] for r in old)
    frame = trace.to_dataframe(range(30, 41))
    assert len(frame) == RANKS * 11 and sorted(set(frame["step"])) == list(range(30, 41))
    got = frame.set_index(["rank", "step"])["param_fingerprint"]
    assert all(
        got[(r, s)] == made[(r, s)].param_fingerprint for r in range(RANKS) for s in (30, 40)
    )
    # sample indices survive the columns' compaction
    last = trace.columns.rows()[-1]
    indices = trace.columns.indices()[last["indices_at"] : last["indices_at"] + last["num_indices"]]
    assert tuple(indices) == made[(int(last["rank"]), int(last["step"]))].indices


def test_the_summaries_cover_the_whole_run_and_keep_what_went_wrong(trace):
    run(trace, 200)
    summaries = trace.summaries()
    assert list(summaries["step"]) == list(range(1, 201))
    assert (summaries["ranks"] == RANKS).all()
    param = summaries["param_agree"]
    assert (param[:36] == 1).all() and (param[36:] == 0).all()
    assert set(summaries["param_odd_rank"][36:]) == {2}
    assert (summaries["grad_agree"] == 1).all() and (summaries["buffer_agree"] == -1).all()
    assert list(np.flatnonzero(summaries["nonfinite_loss_ranks"]) + 1) == [50]
    assert set(summaries["step_s_max_rank"][59:]) == {3}
    assert set(summaries["rss_max_rank"][59:]) == {3}
    # the same numbers whether the steps left the window or not
    whole = Trace({r: job_info(r) for r in range(RANKS)}, window=0)
    run(whole, 200)
    assert whole.whole and len(whole.records[0]) == 200
    same = whole.summaries()
    for name in summaries.dtype.names:
        assert np.array_equal(summaries[name], same[name], equal_nan=True), name


def test_save_and_load_carry_the_whole_run_in_bounded_memory(trace, tmp_path):
    made = run(trace, 120)
    copy = trace.save(tmp_path / "copy")
    back = Trace.load(copy, window=20)
    assert back.last_step == 120 and back.first_step > 1
    assert len(back.records[0]) < 30  # loaded part by part, the window sliding
    frame = back.to_dataframe(range(1, 121))
    assert len(frame) == RANKS * 120
    assert list(back.summaries()["step"]) == list(range(1, 121))
    assert back.at(1)[3] == made[(3, 1)]


def test_a_trace_without_a_folder_keeps_every_step():
    trace = Trace({r: job_info(r) for r in range(RANKS)}, window=20)
    run(trace, 100)
    assert trace.whole and len(trace.records[0]) == 100 and trace.first_step == 1


def test_a_bad_window_setting_is_named(monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, "lots")
    with pytest.raises(ValueError, match=r"\$DTLAB_WINDOW='lots': give a number of steps"):
        Trace({0: job_info(0)})
    monkeypatch.setenv(WINDOW_ENV, "50")
    assert Trace({0: job_info(0)}).window == 50


def test_summarize_names_the_rank_apart_and_steps_nobody_recorded():
    rows = Trace({r: job_info(r) for r in range(3)}, window=0)
    for rank in range(3):
        fp = 5 if rank != 1 else 6
        rec = step_record(1, rank, grad_fingerprint=fp, grad_norm=float(rank), loss=1.0 + rank)
        rows.add(rank, [rec])
    [one] = summarize(rows.columns.rows())
    assert (one["grad_agree"], one["grad_odd_rank"]) == (0, 1)
    assert (one["grad_norm_max"], one["grad_norm_max_rank"]) == (2.0, 2)
    assert (one["loss_min"], one["loss_max"]) == (1.0, 3.0)


def evidence_of(trace: Trace) -> Evidence:
    return Evidence(
        records=trace.records,
        columns=trace.columns,
        names=trace.param_names,
        jobs=trace.jobs,
        history=trace.history.rows(),
    )


def test_the_doctor_names_a_problem_that_began_before_the_window(trace):
    run(trace, 200)
    assert trace.first_step > 60  # step 37's and step 50's records are only on disk
    results = run_checks(evidence_of(trace))
    [earlier] = [r for r in results if r.check == "earlier_steps"]
    kinds = {(f.kind, f.step, f.ranks) for f in earlier.findings}
    assert kinds == {("divergence", 37, (2,)), ("nonfinite", 50, ())}, earlier.findings
    assert "steps 1-" in earlier.looked_at
    said = doctor_summary(results)
    assert "parameters first differed across ranks at step 37 (rank 2" in said, said
    assert (
        f"earlier steps: read from one summary row per step for steps 1-{trace.first_step - 1}"
        in said
    )


def test_a_healthy_long_run_passes_the_earlier_steps_and_a_short_one_leaves_it_out(tmp_path):
    healthy = Trace(
        {r: job_info(r) for r in range(RANKS)}, sink=FolderWriter(tmp_path / "h"), window=20
    )
    for start in range(1, 101, 5):
        for rank in range(RANKS):
            recs = [step_record(s, rank).summary() for s in range(start, start + 5)]
            healthy.add_packed(rank, pack(rank, recs).to_bytes())
        healthy.flush()
    [earlier] = [r for r in run_checks(evidence_of(healthy)) if r.check == "earlier_steps"]
    assert earlier.outcome == "passed" and "every loss was finite" in earlier.passed_because
    short = Trace(
        {r: job_info(r) for r in range(RANKS)}, sink=FolderWriter(tmp_path / "s"), window=20
    )
    run(short, 20)
    assert short.whole
    assert "earlier_steps" not in {r.check for r in run_checks(evidence_of(short))}


def test_columns_slid_many_times_keep_each_rows_indices_in_bounded_arrays():
    """Runs interleave their ranks' steps (rank 0's five, then rank 1's...), so a slide cuts
    through a run's sample indices; many slides later every row held still reads its own
    indices, and the arrays stay a few windows big, whatever the run's length."""
    from dtlab.records.columns import StepColumns

    columns = StepColumns()
    window, chunk, ranks = 300, 7, 3

    def indices(rank: int, step: int) -> list[int]:
        return [step * 100 + rank * 10 + k for k in range(step % 4)]  # 0-3, some none

    for start in range(1, 5000, chunk):
        for rank in range(ranks):
            recs = [
                step_record(s, rank, indices=tuple(indices(rank, s)))
                for s in range(start, start + chunk)
            ]
            columns.append_frame(read_frame(pack(rank, recs).to_bytes(), rank))
        last = start + chunk - 1
        if last > window:
            gone = columns.drop_through(last - window)
            assert gone["step"].max() == last - window and len(gone) == ranks * len(
                np.unique(gone["step"])
            )
        rows, held = columns.rows(), columns.indices()
        assert rows["step"].min() == max(1, last - window + 1)
        assert len(rows) == ranks * min(last, window)
        if start % 5 and start < 4990:
            continue
        got = [
            held[a : a + n].tolist()
            for a, n in zip(rows["indices_at"], rows["num_indices"], strict=True)
        ]
        want = [indices(int(r), int(s)) for r, s in zip(rows["rank"], rows["step"], strict=True)]
        assert got == want
    assert len(columns._rows) <= 4 * ranks * window  # (the arrays, not what they hold)
    assert len(columns._indices) <= 4 * 3 * ranks * window

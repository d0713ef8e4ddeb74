from dtlab.analysis.consistency import find_inconsistencies
from dtlab.control.errors import RankError, RankTimeoutError
from dtlab.records import RemoteFailure
from dtlab.views.tables import rank_table, status_table
from tests.fakes import rank_info as _info


def test_rank_error_groups_identical_errors_and_tracebacks():
    tb = "Traceback...\nZeroDivisionError: division by zero"
    failures = {r: RemoteFailure("ZeroDivisionError", "division by zero", tb) for r in (1, 3)}
    failures[5] = RemoteFailure("KeyError", "'x'", "Traceback...\nKeyError: 'x'")
    e = RankError("cell", failures, finished=[0, 2, 4, 6, 7])
    text = str(e)
    assert text.splitlines()[0] == "cell failed on ranks 1,3,5"
    assert "ranks 1,3 raised ZeroDivisionError: division by zero" in text
    assert "rank 5 raised KeyError: 'x'" in text
    assert text.count("--- traceback on ranks 1,3 ---") == 1
    assert "ranks 0,2,4,6-7 finished without error" in text
    assert e._render_traceback_()[0].startswith("RankError: cell failed")


def test_dead_engine_reads_as_died_and_stragglers_are_named():
    e = RankError(
        "step",
        {
            7: RemoteFailure("EngineError", "Engine 7 died"),
            0: RemoteFailure("KeyboardInterrupt", ""),
        },
        stopped=[0],
        stuck=[1],
    )
    assert e.dead_ranks == (7,) and set(e.failures) == {7}  # our SIGINT is not rank 0's fault
    text = str(e)
    assert text.splitlines()[0] == "step failed on rank 7"
    assert "rank 7 died: the engine process exited" in text
    assert "rank 0 stopped on SIGINT" in text
    assert "rank 1 still busy after SIGINT: probably blocked in a collective" in text
    assert "restart the cluster" in text


def test_a_rank_that_raised_is_not_also_listed_as_stopped_and_colours_are_stripped():
    red = "\x1b[0;31mZeroDivisionError\x1b[0m"
    e = RankError(
        "cell",
        {
            0: RemoteFailure("ZeroDivisionError", "division by zero", f"{red}: division"),
            3: RemoteFailure("ZeroDivisionError", "division by zero", "ZeroDivisionError: d"),
        },
        stopped=[1, 2, 3],
    )
    text = str(e)
    assert "ranks 0,3 raised ZeroDivisionError: division by zero" in text
    assert "ranks 1-2 stopped on SIGINT" in text and "ranks 1-3" not in text
    assert "\x1b" not in text and "ZeroDivisionError: division" in text


def test_timeout_error_separates_stopped_from_stuck():
    e = RankTimeoutError(
        "cell",
        "timed out after 2 s",
        {1: RemoteFailure("KeyboardInterrupt", "")},
        stopped=[1],
        stuck=[0, 2, 3],
    )
    text = str(e)
    assert text.startswith("cell: ranks 0-3 did not finish (timed out after 2 s)")
    assert "rank 1 stopped on SIGINT" in text
    assert "ranks 0,2-3 still busy after SIGINT" in text
    assert "KeyboardInterrupt" not in text


def test_rank_table_text_and_html_flag_inconsistencies():
    infos = {0: _info(0), 1: _info(1, torch_version="2.12.0")}
    table = rank_table(infos, find_inconsistencies(infos))
    text = str(table)
    assert text.splitlines()[0].split() == [
        "rank",
        "host",
        "pid",
        "device",
        "backend",
        "threads",
        "torch",
        "CUDA",
        "NCCL",
    ]
    assert "WARNING: torch_version differs: rank 0 = '2.13.0+cpu'; rank 1 = '2.12.0'" in text
    html = table._repr_html_()
    assert html.count("<tr>") == 3 and "&#9888;" in html and "2.12.0" in html


def test_rank_table_says_when_all_agree():
    infos = {0: _info(0), 1: _info(1)}
    assert "all ranks agree" in str(rank_table(infos, []))


def test_status_table_lists_dead_rank_without_info():
    table = status_table({0: "idle", 1: "dead"}, {0: _info(0)})
    assert [row[:2] for row in table.rows] == [("0", "idle"), ("1", "dead")]
    assert table.rows[1][2] == "-"


def test_the_run_summary_says_one_loss_when_ranks_agree_and_the_last_stage_for_a_pipeline():
    from dataclasses import replace as changed

    from dtlab.records import ParamInfo, RunResult
    from dtlab.records.trace import Trace
    from dtlab.views.reports import run_summary
    from tests.fakes import healthy_trace, job_info, step_record

    result = RunResult(first_step=0, last_step=10, stopped="steps", seconds=1.0)
    agreed = run_summary(result, healthy_trace())
    assert agreed.endswith("; loss 0.2 on every rank") and "(rank 0) .." not in agreed
    differ = Trace({r: job_info(r) for r in (0, 1)})
    for rank in (0, 1):
        recs = [step_record(s, rank) for s in range(1, 11)]
        differ.add(rank, recs[:-1] + [changed(recs[-1], loss=0.5 if rank else recs[-1].loss)])
    assert run_summary(result, differ).endswith("; loss 0.2 (rank 0) .. 0.5 (rank 1)")
    stages = Trace(
        {r: job_info(r, params=(ParamInfo(f"blocks.{r}.w", (2,), "float32", 2),)) for r in (0, 1)}
    )
    for rank in (0, 1):
        stages.add(rank, [step_record(s, rank, num_params=1) for s in range(1, 11)])
    assert run_summary(result, stages).endswith("; loss 0.2 (last stage, rank 1)")


def test_a_long_attach_line_breaks_between_words_not_inside_a_number():
    from dtlab.records import ParamInfo
    from dtlab.views.partition_tables import LINE_WIDTH, pipeline_summary
    from tests.fakes import job_info

    infos = {
        r: job_info(r, params=(ParamInfo(f"blocks.{r}.w", (53376,), "float32", 53376),))
        for r in range(8)
    }
    lines = pipeline_summary(infos).splitlines()
    assert len(lines) > 1 and all(len(line) <= LINE_WIDTH for line in lines)
    assert " ".join(lines).count("53,376") == 8  # every count whole

"""What the doctor prints, as a person reads it: checks that could not look for one reason
(a pipeline's checks of replicas) are named together and the reason said once, in the
summary, the --explain table (text and HTML); plain text is wrapped between words at
TEXT_WIDTH instead of being broken inside words by the output area. No ranks: results
made by the doctor from fabricated records (tests/fakes.py)."""

from __future__ import annotations

import html
import re

from dtlab.analysis.doctor import PIPELINE_WHY, run_checks
from dtlab.records import CheckResult, Evidence, InitialState
from dtlab.views.reports import checks_table, doctor_summary, unchecked_groups
from dtlab.views.tables import TEXT_WIDTH, Table, wrapped
from tests.fakes import PARAMS, job_info, step_record

REPLICA_CHECKS = ("initial_state", "gradient_sync", "buffers", "data_order", "stragglers")


def pipeline_results() -> list[CheckResult]:
    """The doctor's results for two pipeline stages, one per rank, 12 steps."""
    stages = {0: PARAMS[:2], 1: PARAMS[2:]}
    records = {
        r: [step_record(s, r, num_params=len(stages[r])) for s in range(1, 13)] for r in stages
    }
    evidence = Evidence(
        records=records,
        names=tuple(p.name for p in PARAMS),
        jobs={r: job_info(r, params=stages[r]) for r in stages},
        initial={r: InitialState(param_fingerprints=tuple(range(len(stages[r])))) for r in stages},
    )
    return run_checks(evidence)


def unwrapped(text: str) -> str:
    """Printed text with the lines ``wrapped`` split (at INDENT) joined again, so that a
    sentence is found whole (tests of what the magics print)."""
    return re.sub(r"\n {4}(?=\S)", " ", text)


def words(text: str) -> list[str]:
    return text.split()


def test_a_pipelines_checks_of_replicas_share_one_line_and_the_reason_is_said_once():
    results = pipeline_results()
    unchecked = [r.check for r in results if r.outcome == "not checked"]
    assert set(REPLICA_CHECKS) <= set(unchecked)  # the checks of replicas could not look
    text = doctor_summary(results)
    assert text.count(PIPELINE_WHY) == 1
    assert text.count("a pipeline with one stage per rank") == 1
    (line,) = [line for line in text.splitlines() if PIPELINE_WHY in line]
    names = line.removeprefix("not checked: ").partition(": ")[0].split(", ")
    assert set(REPLICA_CHECKS) <= set(names)
    assert names == [r.check for r in results if r.check in names]  # in report order
    assert text.splitlines()[0].endswith(f"{len(unchecked)} not checked")


def test_the_summary_is_wrapped_between_words_within_the_width():
    text = doctor_summary(pipeline_results())
    assert max(map(len, text.splitlines())) > TEXT_WIDTH  # long before wrapping
    shown = wrapped(text)
    assert max(map(len, shown.splitlines())) <= TEXT_WIDTH
    assert words(shown) == words(text)  # no word split, none lost, same order
    continued = [line for line in shown.splitlines() if line.startswith(" ")]
    assert continued and all(line.startswith("    ") for line in continued)
    # a word longer than the width stays whole (on a line of its own), never cut
    long = "x" * (TEXT_WIDTH + 5)
    assert wrapped(f"see {long} there").splitlines() == ["see", f"    {long}", "    there"]


def test_with_explain_the_summary_names_them_and_the_table_says_why_once():
    results = pipeline_results()
    brief = doctor_summary(results, reasons=False)
    assert PIPELINE_WHY not in brief
    assert "(the table below says why)" in brief
    assert all(name in brief for name in REPLICA_CHECKS)
    table = checks_table(results)
    rows = [row for row in table.rows if row[1] == "not checked"]
    assert len(rows) == 1 and rows[0][3] == PIPELINE_WHY  # said once, without the prefix
    assert set(REPLICA_CHECKS) <= set(rows[0][0].split(", "))
    checks_listed = [name for row in table.rows for name in row[0].split(", ")]
    assert sorted(checks_listed) == sorted(r.check for r in results)  # each check once
    page = table.to_html()
    assert page.count(html.escape(PIPELINE_WHY)) == 1
    text = table.text(TEXT_WIDTH)
    lines = text.splitlines()
    assert max(map(len, lines)) <= TEXT_WIDTH
    why = lines[1].index("why")  # the column's cells, read down it
    assert " ".join(words(" ".join(line[why:] for line in lines[2:]))).count(PIPELINE_WHY) == 1
    cells = {w for row in (table.headers, *table.rows) for cell in row for w in words(cell)}
    assert set(words(text)) - cells == {"checks"}  # the title; no word cut into pieces
    assert str(table).splitlines()[1].split() == ["check", "verdict", "looked", "at", "why"]


def test_checks_that_could_not_look_for_different_reasons_stay_apart():
    def unchecked(name, why, needs=""):
        return CheckResult(name, name, (), "", f"not checked: {why}", checked=False, needs=needs)

    results = [
        unchecked("memory", "needs 11 steps", "run at least 11 steps"),
        CheckResult("numerics", "numerics", (), "losses", "every loss was finite"),
        unchecked("stragglers", "needs 7 steps", "run at least 7 steps"),
        unchecked("learning", "needs 11 steps", "run at least 11 steps"),
        unchecked("leaks", "needs 11 steps"),  # the same reason, nothing to do: apart
    ]
    groups = unchecked_groups(results)
    assert [g.checks for g in groups] == [("memory", "learning"), ("stragglers",), ("leaks",)]
    text = doctor_summary(results)
    assert "not checked: memory, learning: needs 11 steps (to check: run at least 11 steps)" in (
        text
    )
    assert "not checked: stragglers: needs 7 steps (to check: run at least 7 steps)" in text
    assert "not checked: leaks: needs 11 steps" in text
    table = checks_table(results)
    assert [row[0] for row in table.rows] == ["memory, learning", "numerics", "stragglers", "leaks"]


def test_a_table_fits_its_width_and_keeps_its_columns():
    table = Table(
        "t",
        ("name", "what"),
        (("a", "one two three four five six seven eight nine ten " * 3),),
        notes=("a note " * 20,),
    )
    text = table.text(40)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 40
    assert lines[1].startswith("name  what")
    assert lines[2].startswith("a     one two")
    assert all(line.startswith("      ") for line in lines[3:7])  # the cell's later lines
    assert lines[7].startswith("a note") and lines[8].startswith("    note")
    assert words(text) == words(str(table))
    assert str(table) == table.text()  # unwrapped: one line per row, as before


def test_unwrapped_gives_back_the_lines_wrapped_split():
    text = doctor_summary(pipeline_results())
    assert unwrapped(wrapped(text)) == text

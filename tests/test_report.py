"""``dt.report``: one self-contained HTML file, plotly.js inlined once; made from a live
session it names ranks, findings and checkpoints and carries no secret of a rank's
environment."""

import re
import urllib.request

import plotly.graph_objects as go
import pytest

from dtlab import demo
from dtlab.views.html_report import report_html
from dtlab.views.tables import Table


def test_the_page_inlines_plotly_once_and_escapes_what_it_shows():
    figures = [go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name="a")) for _ in range(2)]
    table = Table("ranks", ("rank", "host"), (("0", "<vm>"),))
    page = report_html("t", ["a line"], [table], figures)
    assert page.startswith("<!DOCTYPE html>") and page.count("Plotly.newPlot") == 2
    assert page.count("plotly.js v") == 1  # the library once, not per figure
    assert "&lt;vm&gt;" in page and "<vm>" not in page


def test_each_section_is_headed_once_and_an_empty_table_is_not_drawn():
    full = Table("ranks", ("rank", "note"), (("0", "a long sentence " * 10),))
    empty = Table("checkpoints", ("step", "folder"), (), ("no checkpoint yet",))
    page = report_html("t", [], [full, empty], [])
    assert page.count(">ranks<") == 1 and page.count(">checkpoints<") == 1  # no caption too
    assert page.count("<table>") == 1 and "no checkpoint yet" in page
    cells = re.findall(r"<td style='([^']*)'>", page)
    assert cells and all("text-align:left" in c and "white-space:normal" in c for c in cells)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_session_report_names_ranks_findings_checkpoints_and_keeps_secrets_out(live4, tmp_path):
    dt = live4
    dt.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(dt)
    dt.execute("import os; os.environ['HF_TOKEN'] = 'hf_secret_value_1234'", ranks=[1])
    dt.step(3)
    saved = dt.checkpoint()
    path = dt.report(tmp_path / "report.html")
    page = re.sub(r"<(td|th) [^>]*>", r"<\1>", path.read_text())  # cells' own style
    assert "Loss per rank" in page and page.count("plotly.js v") == 1
    assert page.count("<tr><td>") >= 4 + 1  # 4 ranks and the checkpoint
    assert "no problem found in the records so far" in page
    # every check with its outcome: 3 steps are too few to judge stragglers or learning
    assert "<td>stragglers</td><td>not checked</td>" in page
    assert "<td>numerics</td><td>passed</td>" in page and "(to check: run at least" in page
    assert saved.path.name in page
    assert "hf_secret_value_1234" not in page and "HF_TOKEN" not in page
    url = dt.serve_metrics(port=0)
    try:
        scraped = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        dt.stop_metrics()
    assert 'dtlab_step{rank="1"} 3.0' in scraped and "hf_secret" not in scraped
    dt.trace.flush()
    stored = [f for f in dt.trace.folder.rglob("*") if f.is_file()]
    assert stored and not any("hf_secret" in f.read_text(errors="replace") for f in stored)
    evidence = dt.evidence()  # read from the ranks now, environment included
    assert "hf_secret" not in repr(evidence.ranks) and "hf_secret" not in repr(dt.checks())
    dt.execute("import os; os.environ.pop('HF_TOKEN', None)", ranks=[1])
    board = dt.export_tensorboard()
    assert board == dt.trace.folder / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    assert all(any(p.iterdir()) for p in board.iterdir())  # an event file in each


def recorded(folder, steps, **meta):
    """A closed trace in a run folder, of a healthy 2-rank job over ``steps``."""
    from dtlab.control.run_folder_writer import FolderWriter
    from dtlab.records.trace import Trace
    from tests.fakes import job_info, step_record

    trace = Trace({r: job_info(r) for r in (0, 1)}, sink=FolderWriter(folder), meta=meta)
    for rank in (0, 1):
        trace.add(rank, [step_record(s, rank) for s in steps])
    trace.close()
    return trace


def test_the_reports_loss_figure_has_every_step_on_whole_step_ticks(tmp_path):
    """31 steps; then the job rewound to the checkpoint of step 26 and stepped 5 more:
    the live trace holds steps 27-31 only, and the report said "31 steps recorded" over
    a figure of 5 steps ticked 27, 27.5, 28..."""
    from dtlab.views.html_report import (
        SessionSummary,
        earlier_timelines,
        report_figures,
        write_report,
    )

    first = recorded(tmp_path / "first", range(1, 32))
    loss = report_figures(first)[0]
    assert loss.layout.title.text == "Loss per rank"
    assert [list(t.x) for t in loss.data] == [list(range(1, 32))] * 2
    assert loss.layout.xaxis.dtick is None  # 31 steps: plotly ticks 5, 10, ... (whole)
    now = recorded(tmp_path / "now", range(27, 32), step=26, before=str(first.folder))
    summary = SessionSummary(2, "gloo", {}, [], now, [], [], [])
    page = write_report(summary, tmp_path / "report.html").read_text()
    assert "steps 27-31 recorded since the job was rewound to step 26" in page
    assert f"before that, up to step 31: {first.folder}" in page
    assert page.count("Plotly.newPlot") == 3
    earlier, unread = earlier_timelines(now)
    assert [t.folder for t in earlier] == [first.folder] and unread == []
    loss = report_figures(now, earlier)[0]
    drawn = {t.name: list(t.x) for t in loss.data}
    assert drawn == {
        "rank 0 (steps 1-31, before)": list(range(1, 32)),
        "rank 1 (steps 1-31, before)": list(range(1, 32)),
        "rank 0": list(range(27, 32)),
        "rank 1": list(range(27, 32)),
    }
    assert loss.layout.title.text.endswith("and the job's earlier ones (dotted)")
    just_now = report_figures(now)[0]  # 5 steps: every one ticked, none at 27.5
    assert just_now.layout.xaxis.dtick == 1
    gone = recorded(tmp_path / "gone", range(27, 32), step=26, before=str(tmp_path / "nowhere"))
    page = write_report(SessionSummary(2, "gloo", {}, [], gone, [], [], []), tmp_path / "g.html")
    assert "could not be read" in page.read_text()

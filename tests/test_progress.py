"""What a long action shows while it runs: a bar only when its end is known. A run until a
condition shows the steps run, their rate and the condition, never "15/100000"."""

from __future__ import annotations

import io
from types import SimpleNamespace

from dtlab.control.stepper import _progress_of
from dtlab.records import Condition
from dtlab.views.progress import QUIET_S, TextProgress, WidgetProgress, describe


def test_a_known_end_is_a_count_of_it_and_an_open_end_is_a_rate():
    assert describe(5, 10, 1.25) == "5/10 (1.2 s)"
    assert describe(15, 0, 1.5) == "15 so far, 10.0/s (1.5 s)"
    assert describe(0, 0, 0.0) == "0 so far (0.0 s)"


def test_a_run_until_a_condition_has_no_made_up_total():
    run = SimpleNamespace(first_step=12)
    assert _progress_of(run, 5, None) == ("steps", 5)
    assert _progress_of(run, 100_000, Condition("nonfinite")) == ("steps until nonfinite", 0)
    # a step to reach is a known end: from where the run began
    phase, total = _progress_of(run, 100_000, Condition("step", 20))
    assert phase == "steps until step>=20" and total == 8


def test_text_progress_of_an_open_ended_run():
    out = io.StringIO()
    report = TextProgress(out)
    report.last_print -= QUIET_S  # a second has gone by: it prints
    report("steps until nonfinite", 15, 0)
    line = out.getvalue()
    assert line.startswith("steps until nonfinite 15 so far") and "/100000" not in line


def test_the_widget_hides_its_bar_when_no_end_is_known():
    report = WidgetProgress()
    report("steps until loss<0.5", 3, 0)
    bar, label = report.rows["steps until loss<0.5"]
    assert bar.layout.display == "none"
    assert label.value.startswith("steps until loss<0.5: 3 so far")
    report("steps", 2, 4)
    bar, label = report.rows["steps"]
    assert bar.layout.display is None and (bar.value, bar.max) == (2, 4)
    assert label.value.startswith("2/4")


def test_the_bars_become_text_when_their_cell_ends_and_say_where_it_was_cut_off(ip, capsys):
    from dtlab.views import progress

    ip.user_ns["WidgetProgress"] = WidgetProgress
    ip.run_cell("report = WidgetProgress(); report('engines registered', 8, 8)")
    done = ip.user_ns["report"]
    assert done.finished and done not in progress._LIVE
    assert done.text() == f"engines registered: {done.rows['engines registered'][1].value}"
    assert all(w.comm is None for row in done.box.children for w in (row, *row.children))
    cell = "cut = WidgetProgress(); cut('steps', 15, 100); raise KeyboardInterrupt"
    ip.run_cell(cell)
    cut = ip.user_ns["cut"]
    assert cut.finished
    lines = cut.text(KeyboardInterrupt()).splitlines()
    assert lines[0].startswith("steps: 15/100 (") and lines[1] == "cut off (KeyboardInterrupt)"
    out = capsys.readouterr().out
    assert "cut off (KeyboardInterrupt)" in out  # what replaced the bars in the output


def test_a_panel_becomes_text_when_the_session_shuts_down(ip, capsys):
    import ipywidgets as widgets

    from dtlab.views import panels

    class Probe(panels.Panel):
        title = "probe panel"

        def __init__(self):
            self.status = widgets.HTML("<b>steps 1-20</b> in 2.0 s")
            self.widget = widgets.VBox([widgets.HBox([widgets.Button()]), self.status])

    ip.user_ns["probe"] = probe = Probe()
    ip.run_cell("probe")  # shown as a cell's value
    assert probe in panels._LIVE
    assert panels.retire_panels() == 1 and panels._LIVE == []
    out = capsys.readouterr().out
    assert "probe panel closed: the session was shut down; it last said: steps 1-20 in 2.0 s" in out
    assert probe.widget.comm is None and probe.status.comm is None  # models gone
    assert panels.retire_panels() == 0

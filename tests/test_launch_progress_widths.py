"""A launch shows two progress bars, one under the other ("engines registered", then "ranks
initialised"): they start at the same x, whatever their phase's name. The real ipywidgets
objects WidgetProgress builds, read without a kernel or a browser."""

from __future__ import annotations

from dtlab.views.progress import DESCRIPTION_WIDTH, WidgetProgress

LAUNCH_PHASES = ("engines registered", "ranks initialised")  # control/cluster, lifecycle


def test_the_launch_bars_share_one_description_width():
    report = WidgetProgress()
    for phase in LAUNCH_PHASES:
        report(phase, 3, 8)
    bars = [report.rows[phase][0] for phase in LAUNCH_PHASES]
    assert [bar.description for bar in bars] == list(LAUNCH_PHASES)
    # "initial" (or the default) sizes each description to its own text: the bars would
    # then start at different x, one per name's length
    assert {bar.style.description_width for bar in bars} == {DESCRIPTION_WIDTH}
    assert DESCRIPTION_WIDTH.endswith("em") and DESCRIPTION_WIDTH != "initial"
    # each row is the bar then its label, so the bar is what starts every row
    rows = report.box.children
    assert [row.children[0] for row in rows] == bars
    # wide enough for the longest name, not cut off with an ellipsis: lowercase sans-serif
    # averages well under 0.6 em a character
    longest = max(len(phase) for phase in LAUNCH_PHASES)
    assert float(DESCRIPTION_WIDTH.removesuffix("em")) >= 0.6 * longest
    report.finish()

"""What a person sees of checkpoints: the magics, the checkpoint browser widget and the
replay figure, on 4 live ranks."""

import pytest
from IPython.core.error import UsageError
from plotly.callbacks import Points

from dtlab import demo
from dtlab.views.checkpoint_figures import replay_figure

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def dt(live4, tmp_path):
    live4.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(live4, num_samples=512)
    return live4


def test_checkpoint_magics_save_list_load_and_refuse_bad_usage(ip, dt, capsys):
    dt.step(2)
    ip.run_line_magic("dt_checkpoint", "--tag first")
    assert "checkpoint of step 2" in capsys.readouterr().out
    dt.step(2)
    ip.run_line_magic("dt_checkpoint", "--every 3")
    assert "saving every 3 steps" in capsys.readouterr().out
    dt.step(3)  # steps 5-7: step 6 is saved on the way
    ip.run_line_magic("dt_checkpoint", "--every 0")
    assert [c.step for c in dt.checkpoints()] == [2, 6]
    assert [c.tag for c in dt.checkpoints()] == ["first", "auto"]
    ip.run_line_magic("dt_checkpoint", "--list --verify")
    listed = capsys.readouterr().out
    assert "complete" in listed and "first" in listed
    ip.run_line_magic("dt_checkpoint", "--load 2")
    assert "job rewound to step 2" in capsys.readouterr().out
    assert dt.trace.last_step == 0 and dt.trace.meta["step"] == 2
    with pytest.raises(UsageError, match="--every takes"):
        ip.run_line_magic("dt_checkpoint", "--every -1")
    with pytest.raises(Exception, match="no checkpoint of step 99; complete ones: steps"):
        ip.run_line_magic("dt_checkpoint", "--load 99")
    with pytest.raises(Exception, match="since the job was rewound to step 2"):
        ip.run_line_magic("dt_replay", "1 2")
    dt.step(1)
    with pytest.raises(UsageError, match="replay needs"):
        ip.run_line_magic("dt_replay", "3 1")


def test_resume_check_and_replay_magics_report(ip, dt, capsys):
    dt.step(3)
    report = ip.run_line_magic("dt_resume_check", "--steps 3 --same-engines")
    assert report.identical
    assert "identical" in capsys.readouterr().out
    result = ip.run_line_magic("dt_replay", "4 6")
    out = capsys.readouterr().out
    assert result.identical and "replayed steps 4-6" in out and "identical" in out
    assert dt.trace.last_step == 6  # back where it was
    found = ip.run_line_magic("dt_bisect", "3 6 --against ranks")
    assert found.step is None and "agree" in capsys.readouterr().out


def test_checkpoint_browser_selects_replays_and_checks_resume(dt):
    dt.step(2)
    dt.checkpoint()
    dt.step(3)
    browser = dt.checkpoint_browser(resume_steps=2)
    markers = browser.figure.data[-1]
    assert markers.name == "checkpoints" and list(markers.x) == [2]
    assert browser.replay_button.disabled  # nothing selected yet
    browser._clicked(
        markers,
        Points(
            point_inds=[0],
            xs=[2],
            ys=[0],
            trace_name="checkpoints",
            trace_index=len(browser.figure.data) - 1,
        ),
        None,
    )
    assert browser.selected.step == 2 and not browser.replay_button.disabled
    browser.replay_button.click()
    assert browser.last_result.identical, browser.output.outputs
    assert "replayed steps 3-5" in browser.status.value
    assert browser.output.outputs  # the overlay figure is shown
    browser.resume_button.click()
    assert browser.last_result.identical, browser.status.value
    assert "identical" in browser.status.value
    assert len(browser.figure.data[-1].x) == 2  # the resume check's checkpoint appears


def test_replay_figure_marks_the_first_difference(dt):
    dt.step(3)
    dt.checkpoint()
    dt.execute("dtlab.inject.corrupt_once('blocks.1.ffn', step=5)", ranks=[1])
    dt.step(3)
    result = dt.replay(4, 6)
    first = result.comparison.first
    assert (first.step, first.ranks, first.field) == (5, (1,), "loss")
    fig = replay_figure(dt.trace, result.trace, first_difference=first.step)
    assert len(fig.data) == 2 * dt.world_size
    assert {t.line.dash for t in fig.data} == {None, "dash"}
    assert fig.layout.shapes[0].x0 == 5 and "step 5" in fig.layout.title.text
    same = replay_figure(dt.trace, dt.replay(4, 4).trace)
    assert "identical" in same.layout.title.text and not same.layout.shapes

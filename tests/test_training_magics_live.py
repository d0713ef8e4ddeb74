"""%dt_demo / %dt_step / %dt_run / %dt_findings, driven the way IPython runs them."""

import pytest
from IPython.core.error import UsageError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture
def demo_attached(ip, live4, capsys):
    ip.user_ns["dt"] = live4
    ip.run_line_magic("dt_demo", "")
    capsys.readouterr()
    return live4


def test_dt_demo_attaches_and_says_what(ip, live4, capsys):
    ip.run_line_magic("dt_demo", "--no-ddp --set num_layers=3 --lr 1e-3")
    out = capsys.readouterr().out
    assert out.startswith("attached on ranks 0-3: DemoLM, ")
    assert "AdamW, LambdaLR; per-parameter recording on" in out
    with pytest.raises(UsageError, match="KEY=VALUE"):
        ip.run_line_magic("dt_demo", "--set num_layers")
    with pytest.raises(UsageError, match="not a number"):
        ip.run_line_magic("dt_demo", "--set num_layers=two")
    with pytest.raises(UsageError, match="num_layers=2.5 must be a whole number"):
        ip.run_line_magic("dt_demo", "--set num_layers=2.5")
    with pytest.raises(UsageError, match="moe_layer=2 must be in range"):
        ip.run_line_magic("dt_demo", "--set num_layers=2")
    ip.run_line_magic("dt_demo", "--scaler --accumulate 2 --set num_samples=256")
    assert "GradScaler" in capsys.readouterr().out
    live4.step(1)
    last = live4.trace.at(1)
    assert all(r.micro_batches == 2 and r.scale == 2.0**10 for r in last.values())


def test_dt_step_and_dt_run_report_steps_and_stops(ip, demo_attached, capsys):
    assert ip.run_line_magic("dt_step", "3") is None  # the line says it; no Out[] repr
    # steps that take over a second (a busy machine) show progress first, then its text
    # ("steps 3/3 (1.2 s)"): the summary is the last line either way
    last_line = capsys.readouterr().out.splitlines()[-1]
    assert demo_attached.trace.last_step == 3
    assert last_line.startswith("steps 1-3 in ") and "ms/step" in last_line
    assert "loss " in last_line
    ip.run_line_magic("dt_step", "")
    assert capsys.readouterr().out.splitlines()[-1].startswith("step 4 in ")
    ip.run_line_magic("dt_run", "--until step>=7")
    out = capsys.readouterr().out
    assert demo_attached.trace.last_step == 7 and "stopped: step>=7 on ranks 0-3" in out
    ip.run_line_magic("dt_findings", "")
    assert "no problem found" in capsys.readouterr().out


def test_bad_step_arguments_are_usage_errors(ip, demo_attached):
    with pytest.raises(UsageError, match="at least 1"):
        ip.run_line_magic("dt_step", "0")
    with pytest.raises(UsageError, match="cannot read the condition 'loss=3'"):
        ip.run_line_magic("dt_run", "--until loss=3")
    with pytest.raises(UsageError, match="max-steps"):
        ip.run_line_magic("dt_run", "--until nonfinite --max-steps 0")


def test_dt_plot_draws_each_kind_and_refuses_unknown_ones(ip, demo_attached, capsys):
    ip.run_line_magic("dt_step", "3")
    kinds = ("loss", "memory", "times", "deviation", "spread")
    shown = [ip.run_line_magic("dt_plot", kind) for kind in kinds]
    titles = [fig.layout.title.text for fig in shown]
    assert len(titles) == 5 and "step 3" in titles[3]
    heat = shown[3].data[0]
    assert list(heat.y) == [f"rank {r}" for r in range(4)] and float(heat.z.max()) == 0.0
    with pytest.raises(UsageError, match="choose one of loss, memory"):
        ip.run_line_magic("dt_plot", "weights")
    with pytest.raises(UsageError, match="no step 99: steps 1-3 were recorded"):
        ip.run_line_magic("dt_plot", "deviation --step 99")

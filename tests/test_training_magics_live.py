"""%dt_demo / %dt_step / %dt_run / %dt_findings, driven the way IPython runs them."""

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from dtlab.records import RunResult

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "dtlab")
    return shell


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
    with pytest.raises(UsageError, match="not a whole number"):
        ip.run_line_magic("dt_demo", "--set num_layers=two")
    with pytest.raises(UsageError, match="moe_layer=2 must be in range"):
        ip.run_line_magic("dt_demo", "--set num_layers=2")


def test_dt_step_and_dt_run_report_steps_and_stops(ip, demo_attached, capsys):
    result = ip.run_line_magic("dt_step", "3")
    out = capsys.readouterr().out
    assert isinstance(result, RunResult) and result.last_step == 3
    assert out.startswith("steps 1-3 in ") and "ms/step" in out and "loss " in out
    ip.run_line_magic("dt_step", "")
    assert capsys.readouterr().out.startswith("step 4 in ")
    result = ip.run_line_magic("dt_run", "--until step>=7")
    out = capsys.readouterr().out
    assert result.last_step == 7 and "stopped: step>=7 on ranks 0-3" in out
    ip.run_line_magic("dt_findings", "")
    assert "no problem found" in capsys.readouterr().out


def test_bad_step_arguments_are_usage_errors(ip, demo_attached):
    with pytest.raises(UsageError, match="at least 1"):
        ip.run_line_magic("dt_step", "0")
    with pytest.raises(UsageError, match="cannot read the condition 'loss=3'"):
        ip.run_line_magic("dt_run", "--until loss=3")
    with pytest.raises(UsageError, match="max-steps"):
        ip.run_line_magic("dt_run", "--until nonfinite --max-steps 0")

"""The magics, driven the way IPython runs them (run_line_magic / run_cell_magic)."""

import pytest
from IPython.core.error import UsageError

from dtlab.control.cluster import running
from dtlab.control.errors import RankError, RankTimeoutError
from dtlab.control.session import Session

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture
def launched(ip, cluster_cleanup, capsys):
    ip.run_line_magic("dt_launch", "2")
    capsys.readouterr()
    return ip.user_ns["dt"]


def test_dt_launch_binds_dt_and_prints_the_rank_table(ip, cluster_cleanup, capsys):
    ip.run_line_magic("dt_launch", "2 --restart --timeout 60")
    out = capsys.readouterr().out
    dt = ip.user_ns["dt"]
    assert isinstance(dt, Session) and dt.world_size == 2
    assert "2 ranks ready (gloo, local launcher)" in out
    assert "rank  host" in out and "all ranks agree" in out
    assert f"  {dt.infos[1].pid}  " in out
    html = ip.display_formatter.format(dt)[0]["text/html"]
    assert "<table>" in html and str(dt.infos[0].pid) in html


def test_dt_launch_says_what_it_replaced_in_a_plain_line(ip, launched, capsys):
    ip.run_line_magic("dt_launch", "2 --restart")
    captured = capsys.readouterr()
    assert "note: stopped the live 2-rank session" in captured.out
    assert "UserWarning" not in captured.out + captured.err  # no library file path and line


def test_identical_output_grouped_and_different_output_per_rank(ip, launched, capsys):
    ip.run_cell_magic("dt", "", "print('hello')\nprint(f'I am {rank}')")
    out = capsys.readouterr().out
    assert out == "rank 0:\nhello\nI am 0\nrank 1:\nhello\nI am 1\n"
    ip.run_cell_magic("dt", "", "print('same')")
    assert capsys.readouterr().out == "ranks 0-1: same\n"
    ip.run_cell_magic("dt", "", "print(rank)")
    assert capsys.readouterr().out == "rank 0: 0\nrank 1: 1\n"
    ip.run_cell_magic("dt", "", "rank * 10")
    assert capsys.readouterr().out == "Out[rank 0]: 0\nOut[rank 1]: 10\n"


def test_line_form_and_rank_subsets(ip, launched, capsys):
    ip.run_line_magic("dt", "print('all', rank)")
    assert capsys.readouterr().out == "rank 0: all 0\nrank 1: all 1\n"
    ip.run_cell_magic("dt", "--ranks 1", "print('only', rank)")
    assert capsys.readouterr().out == "rank 1: only 1\n"
    with pytest.raises(UsageError, match="rank 5 in '5' does not exist: valid ranks are 0-1"):
        ip.run_cell_magic("dt", "--ranks 5", "print(rank)")


def test_errors_from_ranks_become_one_error_after_the_output(ip, launched, capsys):
    with pytest.raises(RankError) as e:
        ip.run_cell_magic("dt", "", "print('start')\nraise ValueError(f'bad on {rank}')")
    assert capsys.readouterr().out == "ranks 0-1: start\n"
    text = "\n".join(e.value._render_traceback_())
    assert "cell failed on ranks 0-1" in text
    assert (
        "rank 0 raised ValueError: bad on 0" in text
        and "rank 1 raised ValueError: bad on 1" in text
    )


def test_timeout_returns_control_naming_the_stuck_rank(ip, launched):
    with pytest.raises(RankTimeoutError) as e:
        ip.run_cell_magic("dt", "--timeout 1.5", "import time\nif rank == 0:\n    time.sleep(600)")
    assert "rank 0 did not finish (timed out after 1.5 s)" in str(e.value)
    assert "rank 0 stopped on SIGINT" in str(e.value)


def test_pull_and_push(ip, launched, capsys):
    ip.run_cell_magic("dt", "", "x = (rank + 1) ** 2")
    assert ip.run_line_magic("dt_pull", "x") == {0: 1, 1: 4}
    assert ip.run_line_magic("dt_pull", "x --ranks 1") == {1: 4}
    ip.user_ns["lr"] = 0.25
    ip.run_line_magic("dt_push", "lr")
    assert ip.run_line_magic("dt_pull", "lr") == {0: 0.25, 1: 0.25}
    with pytest.raises(UsageError, match="no notebook variable named nope"):
        ip.run_line_magic("dt_push", "nope")
    with pytest.raises(RankError, match="NameError"):
        ip.run_line_magic("dt_pull", "undefined_name")


def test_status_shows_each_rank_and_how_they_reach_the_notebook(ip, launched, capsys):
    launched.stepper.connect()  # (as the first step does)
    ip.run_line_magic("dt_status", "")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 ranks, gloo; stepping: every rank straight to the notebook"
    assert lines[2].split()[:2] == ["0", "idle"] and lines[3].split()[:2] == ["1", "idle"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "the following arguments are required: num_ranks"),
        ("two", "invalid int value: 'two'"),
        ("0", "must be a whole number >= 1, got 0"),
        ("2 --backend mpi", "unknown backend 'mpi'; choose one of auto, gloo, nccl"),
        ("2 --launcher k8s", "unknown launcher 'k8s'"),
        ("2 --env NOEQUALS", "bad --env item 'NOEQUALS': expected KEY=VALUE"),
        ("2 --threads 0", "--threads must be >= 1"),
        ("2 --port 99999", "--port must be 0"),
    ],
)
def test_bad_launch_arguments_are_usage_errors(ip, line, message):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("dt_launch", line)
    assert message in str(e.value)


def test_shutdown_stops_everything_then_magics_say_what_to_do(ip, launched, capsys):
    pids = launched.pids()
    ip.run_line_magic("dt_shutdown", "")
    assert capsys.readouterr().out.startswith("stopped 2 ranks in ")
    assert running(pids) == []
    with pytest.raises(UsageError, match=r"no live dtlab session: run %dt_launch N"):
        ip.run_cell_magic("dt", "", "print(rank)")
    ip.run_line_magic("dt_shutdown", "")
    assert "nothing to stop" in capsys.readouterr().out

"""Ranks that die or hang on 4 live ranks: reported with the rank, how it died and what
the others were doing; hangs and mismatched collectives named; restarts that continue
exactly; nothing left running (checked by pid)."""

import time

import pytest

from dtlab import demo
from dtlab.control.cluster import running
from dtlab.control.errors import RankError, RankTimeoutError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture
def dt(live4, tmp_path):
    live4.checkpoint_root = tmp_path / "checkpoints"
    live4.hang_timeout = None
    demo.attach(live4, dropout=0.1, num_samples=512)
    yield live4
    live4.auto_restart(0)


def losses(session, steps):
    return {s: {r: rec.loss for r, rec in session.trace.at(s).items()} for s in steps}


def test_a_rank_killed_mid_step_is_named_with_its_signal_within_seconds(dt):
    dt.step(2)
    old = dt.pids()
    dt.execute("dtlab.inject.kill_at(step=4)", ranks=[2])
    t0 = time.monotonic()
    with pytest.raises(RankError) as failed:
        dt.step(5)
    assert time.monotonic() - t0 < 10
    text = str(failed.value)
    assert "rank 2 died: killed by signal 9 (SIGKILL" in text, text
    assert failed.value.dead_ranks == (2,)
    assert "why:" in text and "rank 2 dead" in text, text  # what the others were doing
    assert dt.status()[2] == "dead"
    dt.restart(None)
    assert running(old) == []  # every old engine, nanny and fork server is gone
    assert set(dt.status().values()) == {"idle"}


def test_a_rank_that_skips_an_all_reduce_is_named_with_the_collective(dt):
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as hung:
        dt.execute("t = torch.ones(3)\nif rank != 3:\n    dist.all_reduce(t)", timeout=3)
    assert time.monotonic() - t0 < 3 + 10
    verdict = hung.value.hang.verdict
    assert verdict.waiting == (0, 1, 2) and verdict.missing == (3,)
    assert verdict.collective.op == "all_reduce" and verdict.collective.group == "default_pg"
    assert "rank 3 never entered it: rank 3 idle" in str(hung.value), str(hung.value)
    dt.restart(None)


def test_a_mismatched_all_reduce_shape_is_named(dt):
    with pytest.raises(RankTimeoutError) as hung:
        dt.execute("dist.all_reduce(torch.ones(5 if rank == 1 else 3))", timeout=3)
    verdict = hung.value.hang.verdict
    assert verdict.mismatch and verdict.missing == (1,), verdict.summary
    assert "rank 1 passed all_reduce [5]; ranks 0,2-3 passed all_reduce [3]" in verdict.summary
    dt.restart(None)


def test_a_hung_step_gets_a_report_naming_the_rank_and_its_line(dt):
    dt.step(2)
    dt.execute("dtlab.inject.hang_at(step=4, how='sleep')", ranks=[1])
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as hung:
        dt.step(5, timeout=4)
    assert time.monotonic() - t0 < 4 + 10
    verdict = hung.value.hang.verdict
    assert verdict.missing == (1,) and verdict.waiting == (0, 2, 3), verdict.summary
    assert "inject.py" in verdict.where[1] and "sleep" in verdict.where[1], verdict.where
    dt.restart("latest") if dt.checkpoints() else dt.restart(None)


def test_restart_from_the_latest_checkpoint_continues_like_the_run_that_never_died(dt):
    dt.step(3)
    dt.checkpoint()
    dt.step(5)
    expected = losses(dt, range(4, 9))
    dt.load_checkpoint("latest")
    old = dt.pids()
    dt.execute("dtlab.inject.kill_at(step=6)", ranks=[1])
    with pytest.raises(RankError, match="rank 1 died"):
        dt.step(5)
    event = dt.restart("latest")
    assert event["step"] == 3 and running(old) == []
    dt.step(5)
    assert losses(dt, range(4, 9)) == expected
    assert dt.trace.meta["restarts"][-1]["step"] == 3


def test_automatic_restarts_reach_the_step_asked_for(dt):
    dt.step(2)
    dt.checkpoint()
    dt.execute("dtlab.inject.kill_at(step=4)", ranks=[3])
    dt.auto_restart(2)
    before = len(dt.restarts)
    dt.step(4)  # dies at step 4, restarts from step 2, goes on to step 6
    assert dt.current_step() == 6
    assert len(dt.restarts) == before + 1 and "rank 3 died" in dt.restarts[-1]["reason"]
    assert dt.trace.meta["restarts"][-1]["step"] == 2


def test_dt_stacks_and_dt_restart_magics(ip, dt, capsys):
    from IPython.core.error import UsageError

    report = ip.run_line_magic("dt_stacks", "")
    assert report.verdict.collective is None
    assert set(report.verdict.where.values()) == {"idle (waiting for the notebook)"}
    assert "no rank is inside a collective" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--auto takes"):
        ip.run_line_magic("dt_restart", "--auto -1")
    ip.run_line_magic("dt_restart", "--auto 2")
    assert "restarting by itself up to 2 times" in capsys.readouterr().out
    ip.run_line_magic("dt_restart", "--auto 0")
    dt.step(1)
    dt.checkpoint()
    ip.run_line_magic("dt_restart", "--from-checkpoint latest")
    assert "restarted 4 ranks in " in capsys.readouterr().out
    assert dt.current_step() == 1


def test_without_a_timeout_a_deadlock_is_found_and_a_slow_step_is_not(dt):
    dt.hang_timeout = 2  # the stall limit (by default max(30 s, 20 median steps))
    dt.step(2)
    dt.execute("dtlab.inject.slow(3.0)", ranks=[2])  # every step 3 s: slow, not stuck
    result = dt.step(2)
    assert result.last_step == 4  # looked at (no step for > 2 s), found moving, went on
    dt.execute("dtlab.inject.hang_at(step=6, how='skip_sync')", ranks=[1])
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError, match="no step finished for") as hung:
        dt.step(10)
    assert time.monotonic() - t0 < 60
    assert hung.value.hang.verdict.missing == (1,), hung.value.hang.verdict.summary
    dt.restart(None)

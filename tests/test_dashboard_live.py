"""The dashboard driven through its buttons' handlers on 4 live ranks, as a kernel would:
each click starts a task on the running event loop."""

import asyncio

import pytest

import dtlab
from dtlab import demo
from dtlab.control.errors import DtlabError
from dtlab.views.figures import dashboard_trace_index
from tests.conftest import quiet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


WRAP_HANG = """
import time
from dtlab.agent.job import current
_job = current()
_inner = _job.loss_fn
_hung = []
def _wrapped(model, batch):
{body}
    return _inner(model, batch)
_job.loss_fn = _wrapped
"""


def loss_steps(dash, rank: int) -> list:
    return list(dash.figure.data[dashboard_trace_index("loss", rank, 4)].x)


def test_dashboard_steps_runs_pauses_and_redraws(live4):
    dt = live4
    demo.attach(dt)

    async def drive():
        dash = dt.dashboard()
        assert len(dash.figure.data) == 12  # 3 panels x 4 ranks, one figure
        dash.step_button.click()
        assert dash.running and not dash.pause_button.disabled and dash.step_button.disabled
        first = await dash.wait()
        assert first.last_step == 1 and not dash.running and dash.pause_button.disabled
        assert all(loss_steps(dash, r) == [1] for r in range(4))
        shown = dash.plot.outputs[0]["data"]["application/vnd.plotly.v1+json"]
        assert shown["data"][dashboard_trace_index("loss", 2, 4)]["x"] == [1]  # what is drawn

        dash.num_steps.value = 100_000
        dash.run_button.click()
        await asyncio.sleep(1.0)  # the loop is free while ranks step: progress comes in
        assert dash.running and dash.status.value.startswith("running")
        dash.pause_button.click()
        paused = await dash.wait()
        assert paused.stopped == "pause" and 1 < paused.last_step < 100_000
        assert {recs[-1].step for recs in dt.trace.records.values()} == {paused.last_step}
        assert all(loss_steps(dash, r)[-1] == paused.last_step for r in range(4))
        memory = dash.figure.data[dashboard_trace_index("memory", 2, 4)].y
        assert len(memory) == paused.last_step and min(memory) > 10  # MiB of RSS

        dash.until.value = "loss >> 3"
        dash.until_button.click()
        assert not dash.running and "cannot read the condition" in dash.status.value
        dash.until.value = f"step>={paused.last_step + 3}"
        dash.until_button.click()
        until = await dash.wait()
        assert (until.last_step, until.stopped) == (paused.last_step + 3, "until")
        assert "stopped: step>=" in dash.status.value

    asyncio.run(asyncio.wait_for(drive(), timeout=120))


def test_dashboard_shows_a_failed_run_and_stays_usable(live4):
    dt = live4
    demo.attach(dt, ddp=False)
    dt.execute("import dtlab.agent.job as _j; _j.current().loss_fn = None", ranks=[1])

    async def drive():
        dash = dt.dashboard()
        dash.step_button.click()
        await dash.wait()
        assert dash.status.value == "failed: RankError"
        assert not dash.running and not dash.step_button.disabled

    asyncio.run(asyncio.wait_for(drive(), timeout=60))


def test_calls_during_a_dashboard_run_are_refused_and_no_record_is_lost(live4):
    dt = live4
    demo.attach(dt)

    async def drive():
        dash = dt.dashboard()
        dash.num_steps.value = 100_000
        dash.run_button.click()
        await asyncio.sleep(0.8)
        with pytest.raises(DtlabError, match="are stepping .* pause it"):
            dt.execute("print(rank)")
        with pytest.raises(DtlabError, match="are stepping"):
            dt.grads(dt.trace.param_names[0])
        await asyncio.sleep(0.5)
        dash.pause_button.click()
        return await dash.wait()

    result = asyncio.run(asyncio.wait_for(drive(), timeout=60))
    assert result.stopped == "pause"
    for recs in dt.trace.records.values():  # every step arrived, in order, none missing
        assert [r.step for r in recs] == list(range(1, result.last_step + 1))
    assert dt.execute("print(rank)")[3].stdout == "3\n"


def test_a_pause_that_a_rank_cannot_reach_ends_in_sigint_not_a_hang(live4, monkeypatch):
    monkeypatch.setattr("dtlab.control.runs.PAUSE_WAIT_S", 2.0)
    dt = live4
    demo.attach(dt, ddp=False)
    hang = "    if current().step_count + 1 == 3 and not _hung:\n        _hung.append(1)\n"
    dt.execute(WRAP_HANG.format(body=hang + "        time.sleep(120)"), ranks=[1])

    async def drive():
        dash = dt.dashboard()
        dash.num_steps.value = 100_000
        dash.run_button.click()
        await asyncio.sleep(1.0)
        dash.pause_button.click()
        await dash.wait()
        return dash

    dash = asyncio.run(asyncio.wait_for(drive(), timeout=60))
    assert dash.status.value == "failed: RankTimeoutError" and not dash.running
    assert dt.step(2).stopped == "steps"  # SIGINT broke the sleep; the group is rebuilt
    # but an agreement the SIGINT cut off may never complete, and tearing the group down
    # would wait for it: the next %dt_launch replaces the engines instead of reusing them
    assert dt.collectives_may_hang()
    fresh = dtlab.launch(4, progress=quiet)
    assert fresh is not dt and not fresh.collectives_may_hang()


def test_the_dashboard_steps_pauses_and_ends_a_script_job(live4):
    from pathlib import Path

    dt = live4
    script = Path(__file__).resolve().parent / "scripts" / "lm_windows.py"
    dt.run_script(str(script), ["--max_iters=300"])

    async def drive():
        dash = dt.dashboard()
        dash.step_button.click()
        assert (await dash.wait()).last_step == 1
        dash.num_steps.value = 100_000
        dash.run_button.click()
        await asyncio.sleep(0.5)
        dash.pause_button.click()
        paused = await dash.wait()
        assert paused.stopped == "pause" and 1 < paused.last_step < 300
        assert {recs[-1].step for recs in dt.trace.records.values()} == {paused.last_step}
        dash.run_button.click()  # on to the script's own end
        ended = await dash.wait()
        assert (ended.stopped, ended.last_step) == ("ended", 300)
        assert all(loss_steps(dash, r)[-1] == 300 for r in range(4))

    asyncio.run(asyncio.wait_for(drive(), timeout=120))

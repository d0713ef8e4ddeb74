"""The partition editor driven from its handlers, and %dt_partition, on a live pipeline."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from dtlab import demo

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def _stage_blocks() -> tuple:
    from dtlab.agent.pipeline_job import current

    return tuple(current().module.order)


def test_the_editor_previews_applies_and_shows_the_new_balance(live4):
    dt = live4
    demo.attach_pipeline(dt, plan="uniform", microbatches=2)
    dt.step(2)
    editor = dt.partition_editor()
    editor.measure_steps, editor.rounds = 2, 2
    assert [s.value for s in editor.sliders] == [2, 4, 6]
    assert editor.apply_button.disabled  # the draft is the running plan

    editor.sliders[1].value = 2  # stage 2 would start where stage 1 does: no stage 1
    assert editor.apply_button.disabled and "not a valid plan" in editor.status.value
    assert "empty" in editor.status.value

    editor.profile_button.click()
    assert dt.block_costs and all(c.measured for c in dt.block_costs.values())
    editor.auto_button.click()  # the measured plan, proposed
    proposed = editor.draft()
    assert proposed == dt.plan("measured")
    titles = editor.figure.layout.title.text
    assert "Predicted" in titles or "predicted" in titles

    editor.sliders[0].value, editor.sliders[1].value, editor.sliders[2].value = 1, 3, 5
    assert "would move" in editor.status.value and not editor.apply_button.disabled
    editor.apply_button.click()
    assert "moved" in editor.status.value, editor.status.value
    # old, new, old, new (three moves), 2 steps each: 4 a side show no spread worth the
    # name, so no verdict on the step time
    assert "4 samples) → " in editor.status.value
    assert "(alternating, 2 rounds)" in editor.status.value
    assert len(editor.trial.move_seconds) == 2 and len(editor.trial.rounds) == 2
    assert "too few samples to judge" in editor.status.value, editor.status.value
    on_ranks = dt.run(_stage_blocks)
    assert on_ranks == {
        0: ("embed",),
        1: ("blocks.0", "blocks.1"),
        2: ("blocks.2", "blocks.3"),
        3: ("norm", "head"),
    }
    assert editor.after.measured and editor.after.stages[3].blocks == ("norm", "head")
    assert editor.plan.bounds == (0, 1, 3, 5, 7) and editor.apply_button.disabled


def test_dt_partition_magics(live4, ip, capsys):
    ip.run_line_magic("dt_demo", "--pipeline --plan 2,4,6 --microbatches 2")
    assert "pipeline attached on 4 ranks" in capsys.readouterr().out
    ip.run_line_magic("dt_step", "2")
    figure = ip.run_line_magic("dt_partition", "")
    shown = capsys.readouterr().out
    assert "stage 0: embed, blocks.0" in shown and "pipeline stages" in shown
    assert "step time over the last 2 steps: median" in shown  # beside the one step's
    assert len(figure.data) >= 2  # time and memory bars per stage
    timeline = ip.run_line_magic("dt_partition", "--schedule")
    assert {bar.name for bar in timeline.data} == {"forward", "backward"}
    ip.run_line_magic("dt_partition", "--profile --predict measured")
    assert "predicted:" in capsys.readouterr().out
    ip.run_line_magic("dt_partition", "--apply 1,3,5")
    assert "moved" in capsys.readouterr().out
    ip.run_line_magic("dt_partition", "--try 2,4,6 --rounds 2")
    tried = capsys.readouterr().out
    assert "round 2/2: moving, then 4 steps of the new plan..." in tried
    assert "(alternating, 2 rounds)" in tried and "moved 3 block(s)" in tried
    assert live4.partition().bounds == (0, 2, 4, 6, 7)  # the tried plan is kept
    ip.run_line_magic("dt_partition", "--apply 1,3,5")
    capsys.readouterr()
    with pytest.raises(UsageError, match="--rounds takes a number >= 1, got 0"):
        ip.run_line_magic("dt_partition", "--try 2,4,6 --rounds 0")
    ip.run_line_magic("dt_partition", "--export deepspeed")
    assert capsys.readouterr().out.strip() == "[0, 1, 3, 5, 7]"
    ip.run_line_magic("dt_partition", "--export megatron")
    assert capsys.readouterr().out.strip() == "E|t*2|t*2|L"
    with pytest.raises(UsageError, match="empty"):
        ip.run_line_magic("dt_partition", "--apply 1,1,5")
    with pytest.raises(UsageError, match="cannot read the plan"):
        ip.run_line_magic("dt_partition", "--apply fast!")
    with pytest.raises(UsageError, match="plan"):
        ip.run_line_magic("dt_demo", "--pipeline --plan 0,9")
    assert live4.partition().bounds == (0, 1, 3, 5, 7)  # the refused plans changed nothing


def test_a_job_that_is_not_a_pipeline_has_no_partition_to_show(live4, ip):
    """Said once, in one line, by the notebook; not a traceback from every rank."""
    ip.user_ns["dt"] = live4
    demo.attach(live4)  # data parallel: no stages
    live4.step(1)
    with pytest.raises(UsageError, match="not a pipeline: attach one with"):
        ip.run_line_magic("dt_partition", "")
    with pytest.raises(UsageError, match="not a pipeline"):
        ip.run_line_magic("dt_partition", "--profile")

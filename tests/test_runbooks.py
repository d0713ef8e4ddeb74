"""Runbooks 02, 05, 06, 07, 10, 11, 12, 13 and 14, executed top to bottom by a real kernel:
each names the fault it makes on purpose (rank, step, parameter or module) and shows that
the fix worked (13: that the job it connected to runs on)."""

import re
from ast import literal_eval
from pathlib import Path

import psutil
import pytest

from dtlab.records import job_folder as jf
from tests.test_doctor_text import unwrapped
from tests.test_notebooks import descendants, execute, text_of

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

PLOTLY = "application/vnd.plotly.v1+json"


def executed(name: str) -> tuple[list, set, list]:
    """Execute the notebook; no cell raised. Returns its code cells, the processes it had
    started before its last cell, and those of them still running after it."""
    before = descendants()
    nb, seen, left = execute(name, lambda: descendants() - before)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [
        (c.source, o["ename"], o["evalue"])
        for c in code
        for o in c.get("outputs", [])
        if o["output_type"] == "error"
    ]
    assert errors == []
    return code, seen or set(), left


def run_clean(name: str) -> list:
    """Execute the notebook; nothing it started outlives its last cell (``%dt_shutdown``).
    Returns its code cells."""
    code, seen, left = executed(name)
    assert len(seen) >= 10  # controller, fork server, 4 engines, 4 nannies
    assert left == []
    return code


def texts(code: list, start: str) -> list[str]:
    """The text output of every cell whose source starts with ``start``, in order (the
    doctor's summary with its lines as they were before wrapping: ``unwrapped``)."""
    found = [text_of(c) for c in code if c.source.startswith(start)]
    assert found, f"no cell starts with {start!r}"
    return [unwrapped(t) for t in found] if start.startswith("%dt_doctor") else found


def figures(code: list, start: str) -> list[dict]:
    """The plotly figure each cell starting with ``start`` shows."""
    cells = [c for c in code if c.source.startswith(start)]
    return [o["data"][PLOTLY] for c in cells for o in c.outputs if PLOTLY in o.get("data", {})]


def rows(text: str) -> dict[int, list[str]]:
    """A printed table's rows keyed by their first column, when it is a number."""
    return {
        int(line.split()[0]): line.split()[1:]
        for line in text.splitlines()
        if line.split() and line.split()[0].isdigit()
    }


def test_drift_runbook_names_step_rank_and_parameter_and_a_restart_ends_it():
    code = run_clean("02_gradients_drift.ipynb")
    assert "checkpoint of step 3:" in texts(code, "%dt_demo")[0]
    found, after = texts(code, "%dt_doctor")[0], texts(code, "%dt_step 5\n%dt_doctor")[0]
    named = "parameters diverge from step 4: blocks.1.attn.qkv.weight differs on rank 2"
    assert named in found and "from the copy ranks 0-1,3 hold" in found
    divergence = texts(code, 'found = dt.divergence("param")')[0]
    assert "step 4, parameter blocks.1.attn.qkv.weight, outliers (2,)" in divergence
    assert "rank 2 against rank 0: 12288 of 12288 elements differ" in divergence
    assert "max abs 0.001" in divergence  # the edit, and nothing else
    restarted = texts(code, "%dt_restart --from-checkpoint 3")[0]
    assert "restarted 4 ranks in " in restarted and "the job is at step 3 from " in restarted
    # the evidence: the same steps again, nothing found, one parameter state per step
    # 5 steps: too few to judge stragglers, and it says so instead of "every check passed"
    assert "steps 4-8 in " in after and "no problem found in what could be checked" in after
    states = texts(code, "for step in")[0].splitlines()
    assert states == [
        f"step {s}: ranks [0, 1, 2, 3] hold 1 parameter state(s)" for s in range(4, 9)
    ] + ["first divergence: None"]
    assert texts(code, "%dt_shutdown")[0].startswith("stopped 4 ranks in ")


def test_mixed_precision_runbook_names_rank_module_and_the_scalers_skips():
    code = run_clean("05_loss_explodes_mixed_precision.ipynb")
    attached = texts(code, "from dtlab import demo")[0]
    assert "AdamW, LambdaLR, GradScaler" in attached and "steps 1-3 in " in attached
    stopped = texts(code, "%dt_run --until nonfinite --max-steps 20")[0]
    assert "steps 4-6 in " in stopped and "stopped: nonfinite" in stopped
    first, second = texts(code, "%dt_doctor")[:2]
    for doctor in (first, second):
        assert "rank 2 went non-finite at step 6: loss nan" in doctor
        assert "first non-finite output: blocks.1.ffn on rank 2" in doctor
    assert "GradScaler skipped 9 steps, up to 9 in a row, from step 6" in second
    assert "ranks 0-3: GradScaler" in second and "scale 1024 at first, 2 at least" in second
    at_step = texts(code, "for rank, rec in dt.trace.at")[0].splitlines()
    assert len(at_step) == 4 and all(line.endswith("step skipped: True") for line in at_step)
    assert "loss nan" in at_step[2] and "first non-finite output: blocks.1.ffn" in at_step[2]
    assert all("first non-finite output: None" in at_step[r] for r in (0, 1, 3))
    # the scaler's history on rank 2: steps 6-14 skipped, the scale halved at each
    history = rows(texts(code, "%dt_step 10")[0].split("step  rank", 1)[1])
    assert sorted(history) == list(range(1, 17))
    skipped = [s for s, (_, _, _, skip) in history.items() if skip == "True"]
    assert skipped == list(range(6, 15))
    scales = {s: float(row[2]) for s, row in history.items()}
    assert [scales[s] for s in (5, 6, 7, 14, 15, 16)] == [1024, 1024, 512, 4, 2, 2]
    # the fix: 16 steps, nothing non-finite, nothing skipped, the scale never lowered
    fixed = texts(code, "print(job_summary(demo.attach(dt, scaler=True)))")[0]
    assert "steps 1-16 in " in fixed and "nonfinite never held" in fixed
    evidence = texts(code, "df = dt.trace.to_dataframe()\nhistory")[0]
    assert rows(evidence) == {r: ["16", "0", "1024.0"] for r in range(4)}
    assert "no problem found" in evidence  # "in what could be checked" if timings are too noisy


def test_learning_rate_runbook_scales_the_lr_and_finds_the_rank_that_differs():
    code = run_clean("06_learning_rate_at_scale.ipynb")
    rules = texts(code, "per_rank, accumulate, ranks")[0]
    assert "effective batch: 8 x 4 ranks x 2 micro-batches = 64" in rules
    assert "linear rule (SGD):           0.024" in rules
    assert "square-root rule (Adam-type): 0.00849" in rules
    warmup = texts(code, "df = dt.trace.to_dataframe()\nprint(df.pivot")[0]
    lrs = {step: [float(x) for x in row] for step, row in rows(warmup).items()}
    assert sorted(lrs) == list(range(1, 13))
    assert all(len(set(row)) == 1 for row in lrs.values())  # one LR per step on 4 ranks
    first = [lrs[s][0] for s in range(1, 13)]
    assert first[:10] == sorted(first[:10]) and first[9:] == [0.00849] * 3  # warm-up, then flat
    assert "samples per rank and step: [16]" in warmup
    explained = texts(code, "%dt_doctor --explain")[0]
    assert "no problem found" in explained and "global batch 4 ranks x 16 = 64" in explained
    assert re.search(r"^learning_rate +passed", explained, re.M)
    found = texts(code, "%dt_doctor")[1]
    lr = re.search(
        r"the learning rate at step 13 is ([\d.]+) on rank 1 but ([\d.]+) on the "
        r"others \(differs at 4 of 16 steps\)",
        found,
    )
    assert lr and float(lr.group(1)) == pytest.approx(2 * float(lr.group(2)), rel=1e-5), found
    tail = rows(texts(code, "df = dt.trace.to_dataframe()\nlr = ")[0])
    assert [tail[s][1] for s in range(13, 17)] == ["0.017"] * 4
    assert all(tail[s][r] == "0.00849" for s in range(11, 17) for r in (0, 2, 3))
    fixed = texts(code, "print(job_summary(demo.attach(dt, lr=sqrt_lr")[0]
    assert "steps 1-16 in " in fixed
    evidence = texts(code, "df = dt.trace.to_dataframe()\nper_step")[0]
    assert "steps 1-16: 1 LR per step across ranks" in evidence
    assert "no problem found" in evidence  # "in what could be checked" if timings are too noisy


def growth(text: str) -> dict[int, float]:
    """``growth_per_step`` as printed: MiB per step by rank."""
    return {rank: float(value[0]) for rank, value in rows(text).items()}


def test_leak_runbook_names_the_rank_and_its_growth_and_the_memory_is_flat_after():
    code = run_clean("07_memory_leak_one_rank.ipynb")
    leak = re.search(
        r"rank 1 leaks memory: rss grows ([\d.]+) MiB per step", texts(code, "%dt_doctor")[0]
    )
    assert leak and 3.0 < float(leak.group(1)) < 5.0
    before = growth(texts(code, "def growth_per_step")[0])
    assert sorted(before) == [0, 1, 2, 3] and 3.0 < before[1] < 5.0
    assert all(before[r] < 0.5 for r in (0, 2, 3))
    kept = literal_eval(texts(code, "%dt_step 5")[0].splitlines()[-1])
    assert kept[1] == pytest.approx(20.0, abs=0.5)  # 5 steps x 4 MiB of live tensors
    assert all(abs(kept[r]) < 0.5 for r in (0, 2, 3))
    assert "steps 1-20 in " in texts(code, "%dt_demo\n%dt_step 20")[0]
    evidence = texts(code, "%dt_doctor\ngrowth_per_step")[0]
    assert "no problem found" in evidence  # "in what could be checked" if timings are too noisy
    after = growth(evidence)
    assert sorted(after) == [0, 1, 2, 3] and all(g < 1.0 for g in after.values())
    assert len(figures(code, "%dt_step 20")) == 1 and len(figures(code, "%dt_plot memory")) == 1


def facts(text: str) -> dict[int, tuple[float, int, str]]:
    """``data_facts`` as printed: rank -> (data share, shared samples, epoch 1 repeats)."""
    return {rank: (float(row[0]), int(row[1]), row[2]) for rank, row in rows(text).items()}


def data_ms(figure: dict) -> dict[str, float]:
    """The data-loading bar of ``%dt_plot times``: ms by rank label."""
    bar = next(t for t in figure["data"] if t["name"] == "data")
    return dict(zip(bar["x"], bar["y"], strict=True))


def test_data_runbook_finds_shared_shards_a_missing_set_epoch_and_a_slow_rank():
    code = run_clean("10_data_loading.ipynb")
    found = texts(code, "%dt_doctor")[0]
    assert re.search(
        r"ranks 0,3 read the same samples: \d+ sample indices seen by more than "
        r"one rank in epochs 0, 1, first at step 1",
        found,
    ), found
    assert "ranks 0-3 read epoch 1 in the same order as epoch 0" in found
    assert "from step 9): the sampler's set_epoch is not called" in found
    # on a quiet machine rank 1's wait is a large share of its step; on a busy one every
    # step is longer, and what stands out is that rank 1 waits far longer than the others
    assert (
        "waiting for data takes a large share of each step (median): rank 1 " in found
        or "rank 1 wait far longer for data than the other ranks" in found
    ), found
    assert "rank 1 is a straggler" in found and "mostly in data" in found
    before = facts(texts(code, "from statistics import median")[0])
    after = facts(texts(code, "data_facts(dt.trace)")[0])
    assert before[0][1] == before[3][1] > 0 and before[1][1] == before[2][1] == 0
    assert all(before[r][2] == "True" for r in range(4))
    assert before[1][0] > 0.3 and all(before[r][0] < 0.3 for r in (0, 2, 3))
    # the fix: no shared sample, a new order in epoch 1, no rank waiting for data
    assert after == {r: (after[r][0], 0, "False") for r in range(4)}
    assert all(share < 0.3 for share, _, _ in after.values())
    explained = texts(code, "%dt_doctor --explain")[0]
    assert explained.startswith("no problem found")
    assert re.search(r"^data_order +passed", explained, re.M)
    assert re.search(r"^stragglers +passed", explained, re.M)
    slow, fixed = (data_ms(f) for f in figures(code, "%dt_plot times"))
    # judged against rank 1's planted wait, not in absolute ms: a busy machine slows all
    assert slow["rank 1"] > 50 and all(slow[f"rank {r}"] < slow["rank 1"] / 3 for r in (0, 2, 3))
    # rank 1's planted wait is gone and it no longer stands out (a busy machine lengthens
    # every rank's data time alike, so no absolute bound on the others)
    others = sorted(fixed[f"rank {r}"] for r in (0, 2, 3))
    assert fixed["rank 1"] < slow["rank 1"] / 2, (slow, fixed)
    assert fixed["rank 1"] < max(3 * others[1], slow["rank 1"] / 3), (slow, fixed)


def test_your_own_script_runbook_pauses_it_finds_its_bug_and_runs_the_fix():
    code = run_clean("11_your_own_script.ipynb")
    started = texts(code, "%dt_script --cwd {folder} train.py --steps 20")[0]
    assert "train.py paused on ranks 0-3 at step 0" in started
    assert "init_process_group(backend='gloo') uses dtlab's group" in started
    stepped = texts(code, "%dt_step 5")[0]
    # what rank 0 printed after each step came back while it ran (step 5 prints once resumed)
    assert "step 4: loss " in stepped and "step 5: loss" not in stepped
    assert "steps 1-5 in " in stepped
    batch = texts(code, "%%dt\nx = script_locals")[0]
    assert batch.startswith("ranks 0-3: batch (16, 16), first sample sums to ")
    found = texts(code, "%dt_doctor")[0]
    assert "ranks 0-3" in found and "DistributedSampler" in found
    fixed = texts(code, "%dt_script --cwd {folder} train.py --steps 20 --shard")[0]
    assert "steps 1-20 in " in fixed and "finished on ranks 0-3 after 20 optimizer steps" in fixed
    evidence = texts(code, "from itertools import combinations")[0]
    assert "epoch 0: 256 samples per rank, 0 read by two ranks" in evidence
    assert "epoch 1: 64 samples per rank, 0 read by two ranks" in evidence
    assert "no problem found" in evidence  # "in what could be checked" if timings are too noisy


@pytest.mark.timeout(900)
def test_deepspeed_runbook_names_the_scripts_own_accumulation_and_restarts(deepspeed_ops):
    code = run_clean("12_deepspeed_zero.ipynb")
    started = texts(code, "%dt_script --cwd {folder} train.py")[0]
    assert "train.py paused on ranks 0-3 at step 0" in started
    assert "(DeepSpeedEngine on Sequential)" in started
    found = texts(code, "%dt_doctor")[0]
    assert (
        "ranks 0-3: the script calls backward() 4 times per optimizer step, but "
        "gradient_accumulation_steps is 2" in found
    ), found
    fixed = texts(
        code,
        "%dt_script --cwd {folder} train.py --deepspeed --deepspeed_config "
        "ds_config.json --accumulate 1",
    )[0]
    assert "steps 1-6 in " in fixed
    assert "no problem found in what could be checked" in fixed, fixed
    counted = texts(code, "info = dt.trace.jobs[0].deepspeed")[0]
    assert "ZeRO stage 2, gradient_accumulation_steps 2" in counted
    assert "per rank: {0: [2], 1: [2], 2: [2], 3: [2]}" in counted
    # rank 2 killed at step 6: restarted by itself from the script's own checkpoint
    restarted = texts(code, "%dt_step 4")[1]
    # why, as the ranks' nannies or the controller saw it first
    assert "automatic restart: rank 2 died (" in restarted, restarted
    assert (
        "the script ran again, resumed itself from its checkpoint at step 4 (DeepSpeed's "
        "load_checkpoint) and went on to step 6: its parameters are bit for bit those of the "
        "first run" in restarted
    )
    assert "steps 7-10 in " in restarted
    resumed = texts(code, "report = %dt_resume_check --steps 2")[0]
    assert "the script resumed at step 10 on fresh engines from DeepSpeed's checkpoint " in resumed
    assert "global_step10, then 2 steps: identical" in resumed


def test_connect_runbook_finds_the_planted_learning_rate_and_leaves_the_job_running():
    code, seen, left = executed("13_connect_to_a_running_job.ipynb")
    assert len(seen) >= 3  # torchrun and its 2 ranks, until the last cell stops them
    assert left == []
    connected = texts(code, "%dt_connect")[0]
    assert "train.py on 2 ranks" in connected and "ConnectedJob: 2 ranks, running" in connected
    held = int(re.search(r"every rank paused after step (\d+)", texts(code, "%dt_pause")[0])[1])
    lrs = texts(code, "%%dt")[0]
    assert "Out[rank 0]: 0.01" in lrs and "Out[rank 1]: 0.1" in lrs, lrs
    ran = texts(code, "%dt_run --until diverged")[0]
    assert f"step {held + 1} in " in ran and "stopped: diverged on ranks 0-1" in ran, ran
    doctor = texts(code, "%dt_doctor")[0]
    assert re.search(
        r"the learning rate at step 1 is 0\.1 on rank 1 but 0\.01 on the others", doctor
    )
    assert "the job still runs: True" in texts(code, "%dt_disconnect")[0]
    offline = texts(code, "job.terminate()")[0]
    assert "the learning rate at step 1 is 0.1 on rank 1" in unwrapped(offline)
    assert offline.rstrip().endswith("exit code 1")


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie has ended)."""
    found = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_hang_runbook_names_the_uneven_shards_from_the_folder_and_the_fix_runs_clean():
    code, seen, left = executed("14_batch_job_hangs_at_epoch_end.ipynb")
    # the verdict from the folder alone, the job still running: the same collective by
    # count, another operation on each rank, and each rank's line of train.py
    found = texts(code, "text, code = found")[0]
    assert found.rstrip().endswith("exit code 1")
    assert "rank 0 made no step for 5 s after step 19" in found, found
    assert "rank 1 made no step for 5 s after step 19" in found, found
    verdict = next(line for line in found.splitlines() if line.startswith("hung: "))
    assert "mismatched collective #" in verdict and "rank 0 passed all_reduce" in verdict
    assert "rank 1 passed barrier" in verdict, verdict
    assert "no other problem in the step records" in found  # the hang is one
    script = next(c.source for c in code if 'SCRIPT = r"""' in c.source)
    lines = script.split('r"""', 1)[1].split('"""', 1)[0].splitlines()  # train.py's

    def source(text: str) -> int:
        return 1 + next(i for i, line in enumerate(lines) if text in line)

    where = found.splitlines()[found.splitlines().index(verdict) + 1 :][:2]
    assert where[0].startswith(f"    rank 0 in `<module>` (train.py:{source('loss.backward()')}")
    assert where[1].startswith(f"    rank 1 in `<module>` (train.py:{source('dist.barrier()')}")
    connected = texts(code, "%dt_connect")[0]
    assert connected.index("hung: ") < connected.index("ConnectedJob: 2 ranks")
    stacks = texts(code, "stacks = %dt_stacks")[0]
    assert f'train.py", line {source("dist.barrier()")}' in stacks, stacks
    # stopped as scancel would: every rank's ending on record, nothing of the job left
    stopped = texts(code, "%dt_disconnect")[0]
    assert "rank 0 was stopped by SIGTERM (15) at step 19" in stopped, stopped
    assert "rank 1 was stopped by SIGTERM (15) at step 19" in stopped, stopped
    started = texts(code, "run_dir = ")[0]
    pid = int(re.search(r"the job still runs \(pid (\d+)\), hung", started)[1])
    run_dir = re.search(r"\((/\S+)/rank-1/stacks\.txt\)", found)[1]
    ranks = [info.pid for info in jf.read_job(Path(run_dir)).ranks.values()]
    assert len(ranks) == 2 and alive([pid, *ranks]) == []
    assert seen == set() and left == []
    fixed = texts(code, "fixed = ")[0]
    assert "the fixed job's exit code 0" in fixed
    assert "steps 1-19 recorded on every rank" in fixed and fixed.rstrip().endswith("exit code 0")

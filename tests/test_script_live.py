"""Users' own training scripts, unchanged, on 4 live ranks with %dt_script, and the same
scripts under plain torchrun in the same test: the losses must be bit-identical.

The scripts in tests/scripts/ are written in the forms people write them: the DDP
tutorial's (argparse, DistributedSampler, clipping, a hand-set LR), nanoGPT's (module
globals, random windows, its own accumulation), a GradScaler loop, accelerate, a main()
that ends with sys.exit, and a Hugging Face Trainer whose loop is the framework's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest

from dtlab.agent.threads import thread_env
from dtlab.control.errors import RankError
from tests.conftest import rank_threads, run_torchrun, untimed

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TORCHRUN_TIMEOUT_S = 180


def torchrun(session, script: str, args: list[str], n: int = 4) -> None:
    """The script under plain torchrun, at the ranks' thread count (another count rounds
    differently: dtlab/agent/threads.py)."""
    env = {**os.environ, **thread_env(rank_threads(session))}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*run, f"--nproc-per-node={n}", str(SCRIPTS / script), *args]
    done = run_torchrun(cmd, TORCHRUN_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def losses_in(folder: Path, n: int = 4) -> dict[int, list]:
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(n)}


def recorded(session, field: str = "loss") -> dict[int, list]:
    return {r: [getattr(rec, field) for rec in recs] for r, recs in session.trace.records.items()}


def test_the_ddp_tutorial_script_runs_unchanged_and_matches_torchrun(live4, tmp_path):
    dt = live4
    args = ["--steps", "10", "--batch-size", "8"]
    torchrun(dt, "ddp_sampler.py", [*args, "--out", str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "ddp_sampler.py"), [*args, "--out", str(tmp_path / "dt")])
    assert status.paused and set(status.steps.values()) == {0}
    assert any("init_process_group(backend='gloo') uses dtlab's group" in n for n in status.notes)
    found = (status.model, status.wrapper, status.optimizers)
    assert found == ("Sequential", "DistributedDataParallel", ("SGD",))

    result = dt.step(5)
    assert result.last_step == 5
    assert {r: recs[-1].step for r, recs in dt.trace.records.items()} == {r: 5 for r in range(4)}
    # paused inside main(): its locals are readable (and their objects changeable) from %%dt
    seen = dt.execute("len(script_locals['losses']), script_locals['step']")
    assert {o.result for o in seen.values()} == {"(4, 4)"}  # appended after optimizer.step()

    end = dt.continue_script()
    assert end.stopped == "ended" and end.last_step == 10
    mine, theirs = losses_in(tmp_path / "dt"), losses_in(tmp_path / "torchrun")
    assert mine == theirs  # bit for bit, step by step, on every rank
    assert recorded(dt) == mine  # what dtlab recorded is what the script computed
    from tests.scripts.ddp_sampler import lr_at

    assert recorded(dt, "lr")[0] == [lr_at(s, 0.05) for s in range(10)]  # set by hand
    norms = [rec.grad_norm for rec in dt.trace.records[0]]
    assert all(0 < n <= 1.0 + 1e-6 for n in norms)  # after the script's own clipping (1.0)
    indices = recorded(dt, "indices")
    assert all(len(ix) == 8 for recs in indices.values() for ix in recs)
    assert untimed(dt.doctor()) == []  # a healthy script: no finding
    # its destroy_process_group() left the group alive: the ranks take the next job
    notes = dt.scripts.refresh().notes
    assert any("destroy_process_group() left dtlab's group alive" in n for n in notes)
    out = dt.execute("t = torch.ones(1); dist.all_reduce(t); t.item()")
    assert {o.result for o in out.values()} == {"4.0"}


@pytest.mark.parametrize(
    "bug, kind, ranks",
    [
        (["--same-data"], "data_order", (0, 1, 2, 3)),
        (["--no-ddp"], "divergence", (1, 2, 3)),
        (["--lr-rank", "2"], "learning_rate", (2,)),
    ],
)
def test_planted_bugs_in_a_script_are_named_with_their_ranks(live4, bug, kind, ranks):
    dt = live4
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), ["--steps", "8", *bug])
    assert dt.continue_script().stopped == "ended"
    found = [f for f in dt.doctor() if f.kind == kind]
    assert found, [f.summary for f in dt.doctor()]
    assert set(found[0].ranks) & set(ranks), (found[0].ranks, found[0].summary)
    assert found[0].step in (1, 2)


def test_an_inf_in_a_script_is_traced_to_its_first_module_without_watching(live4):
    dt = live4
    dt.run_script(
        str(SCRIPTS / "ddp_sampler.py"), ["--steps", "6", "--inf-rank", "2", "--inf-step", "4"]
    )
    dt.step(5)  # plain steps: nothing watched in advance
    [found] = [f for f in dt.doctor() if f.kind == "numerics"]
    assert found.ranks == (2,) and found.step == 4, found.summary
    assert (
        "first non-finite output: 0 on rank 2 (found by re-running micro-batch 0" in found.summary
    )
    assert "look at what 0 computes at step 4" in found.fix
    dt.continue_script()


def test_a_nanogpt_style_script_with_its_own_accumulation(live4, tmp_path):
    dt = live4
    torchrun(dt, "lm_windows.py", [f"--out={tmp_path / 'torchrun'}"])
    status = dt.run_script(str(SCRIPTS / "lm_windows.py"), [f"--out={tmp_path / 'dt'}"])
    assert status.paused and status.model == "TinyLM"
    dt.step(2)
    rec = dt.trace.records[0][-1]
    # four backward() calls per step, only the last one synchronised (its own toggle)
    assert (rec.micro_batches, rec.synced_micro_batches) == (4, 1)
    assert dt.continue_script().last_step == 6
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")
    assert recorded(dt) == mine  # the sum of what backward() was called on, per step
    assert untimed(dt.doctor()) == []


def test_ranks_drawing_the_same_windows_are_named_without_sample_indices(live4):
    dt = live4
    dt.run_script(str(SCRIPTS / "lm_windows.py"), ["--same_seed=1"])
    dt.continue_script()
    [found] = [f for f in dt.doctor() if f.kind == "data_order"]
    assert found.ranks == (0, 1, 2, 3) and found.step == 1
    assert "fed their model the same inputs in 6 of 6 steps" in found.summary


def test_a_script_variable_changed_while_paused_takes_effect(live4):
    dt = live4
    dt.run_script(str(SCRIPTS / "lm_windows.py"), ["--max_iters=4"])
    dt.step(1)
    assert {o.result for o in dt.execute("script.grad_clip").values()} == {"1.0"}
    dt.execute("script.grad_clip = 1e-3")  # its module globals, on every rank
    dt.continue_script()
    norms = recorded(dt, "grad_norm")[0]
    assert norms[0] > 1e-3 and all(n <= 1e-3 * (1 + 1e-5) for n in norms[1:])


def test_a_grad_scaler_step_that_skips_is_still_a_step(live4, tmp_path):
    dt = live4
    args = ["--steps", "6", "--inf-at", "2"]
    torchrun(dt, "amp_scaler.py", [*args, "--out", str(tmp_path / "torchrun")])
    dt.run_script(str(SCRIPTS / "amp_scaler.py"), [*args, "--out", str(tmp_path / "dt")])
    dt.continue_script()
    assert losses_in(tmp_path / "dt") == losses_in(tmp_path / "torchrun")
    assert recorded(dt, "skipped")[0] == [False, False, True, False, False, False]
    assert recorded(dt, "scale")[0] == [1024.0] * 3 + [512.0] * 3  # backed off after it
    assert [v for v, _ in losses_in(tmp_path / "dt")[1]][:2] == recorded(dt)[1][:2]  # unscaled


def test_an_accelerate_script(live4, tmp_path):
    dt = live4
    torchrun(dt, "with_accelerate.py", [str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "with_accelerate.py"), [str(tmp_path / "dt")])
    assert status.paused and status.optimizers == ("AdamW",)
    dt.continue_script()
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")
    assert recorded(dt) == {r: [loss for loss, _ in pairs] for r, pairs in mine.items()}
    assert recorded(dt, "lr")[0] == [lr for _, lr in mine[0]]  # what its scheduler set


def test_a_hugging_face_trainer_script_steps_inside_the_frameworks_loop(live4, tmp_path):
    """The loop is transformers' Trainer (accumulation, no_sync, clipping, warmup): dtlab sees
    its steps through torch's optimizer hooks only."""
    dt = live4
    torchrun(dt, "hf_trainer.py", [str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "hf_trainer.py"), [str(tmp_path / "dt")])
    assert status.paused and status.model == "GPT2LMHeadModel"
    assert (status.wrapper, status.optimizers) == ("DistributedDataParallel", ("AdamW",))
    dt.step(3)
    assert {r: recs[-1].step for r, recs in dt.trace.records.items()} == {r: 3 for r in range(4)}
    assert dt.continue_script().last_step == 6
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")  # every micro-batch, bit for bit
    for recs in dt.trace.records.values():
        # two micro-batches per step, the first under DDP's no_sync
        assert {(rec.micro_batches, rec.synced_micro_batches) for rec in recs} == {(2, 1)}
        assert all(0 < rec.grad_norm <= 0.5 + 1e-6 for rec in recs)  # the Trainer's clipping
    # its linear schedule: 2 warmup steps to 1e-3, then down to 0 at step 6
    expected = [1e-3 * s / 2 if s < 2 else 1e-3 * (6 - s) / 4 for s in range(6)]
    assert recorded(dt, "lr")[0] == pytest.approx(expected)
    assert untimed(dt.doctor()) == []


def test_an_optimizer_stepped_inside_backward_pauses_where_backward_returns(live4, tmp_path):
    """Per-parameter optimizers stepped from gradient hooks: the boundary waits for the end
    of backward() (not in the middle of autograd), and each gradient is recorded as its
    optimizer used it, before the script dropped it."""
    dt = live4
    torchrun(dt, "optimizer_in_backward.py", [str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "optimizer_in_backward.py"), [str(tmp_path / "dt")])
    assert status.paused and any("inside backward()" in n for n in status.notes)
    dt.step(2)
    assert {r: recs[-1].step for r, recs in dt.trace.records.items()} == {r: 2 for r in range(4)}
    assert dt.continue_script().last_step == 6
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")
    assert recorded(dt) == mine  # each step's loss, recorded after its backward returned
    for recs in dt.trace.records.values():
        assert all(rec.missing_grads == () and rec.micro_batches == 1 for rec in recs)
        assert all(math.isfinite(n) and n > 0 for rec in recs for n in rec.grad_norms)
    assert untimed(dt.doctor()) == []  # averaged in the hook: the ranks agree


def test_sys_exit_is_reported_per_rank_and_signal_handlers_work(live4):
    dt = live4
    engine_handlers = dt.run(lambda: str(signal.getsignal(signal.SIGTERM)))
    dt.run_script(str(SCRIPTS / "exits.py"), ["--code", "3"])  # it calls signal.signal
    assert dt.continue_script().stopped == "ended"
    status = dt.scripts.refresh()
    assert {o["kind"] for o in status.outcomes.values()} == {"exited"}
    assert {o["code"] for o in status.outcomes.values()} == {3}
    assert dt.run(lambda: str(signal.getsignal(signal.SIGTERM))) == engine_handlers


def test_an_exception_in_the_script_is_one_error_and_the_ranks_stay(live4):
    dt = live4
    dt.run_script(str(SCRIPTS / "exits.py"), ["--fail-at", "2"])
    with pytest.raises(RankError) as e:
        dt.continue_script()
    text = str(e.value)
    assert "ranks 0-3 raised RuntimeError: planted failure at step 2" in text
    assert "at step 2, exits.py:" in text
    assert "dtlab/agent/script.py" not in e.value.failures[0].traceback
    assert set(dt.run(os.getpid)) == {0, 1, 2, 3}
    assert dt.run_script(str(SCRIPTS / "exits.py"), []).paused  # the next script runs


BAD_SCRIPTS = {
    "world.py": "import torch.distributed as dist\ndist.init_process_group('gloo', world_size=8)\n",
    "nccl.py": "import torch.distributed as dist\ndist.init_process_group('nccl')\n",
    "spawn.py": "import torch.multiprocessing as mp\n\ndef work(i):\n    pass\n\n"
    "mp.spawn(work, nprocs=2)\n",
}


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.py", "no script"),
        ("binary.py", "not a Python script"),
        ("syntax.py", "not a Python script: invalid syntax at line 1"),
        ("world.py", "world_size=8, but there are 4 ranks"),
        ("nccl.py", "backend 'nccl', but these ranks run 'gloo'"),
        ("spawn.py", "starts its own worker processes"),
    ],
)
def test_bad_scripts_are_refused_clearly_and_the_ranks_stay(live4, tmp_path, name, message):
    dt = live4
    path = tmp_path / name
    if name == "binary.py":
        path.write_bytes(b"\x7fELF\x00\x01")
    elif name == "syntax.py":
        path.write_text("def (:\n")
    elif name in BAD_SCRIPTS:
        path.write_text(BAD_SCRIPTS[name])
    with pytest.raises(RankError) as e:
        dt.run_script(str(path))
    assert message in str(e.value)
    assert e.value.stuck == () and set(dt.run(os.getpid)) == {0, 1, 2, 3}


def test_a_script_that_never_steps_says_so(live4, tmp_path, ip):
    path = tmp_path / "nostep.py"
    path.write_text(
        "import torch\nw = torch.ones(2, requires_grad=True)\n"
        "(w * 2).sum().backward()\nprint('done without a step')\n"
    )
    ip.run_line_magic("dt_launch", "4")
    out = _captured(ip, "dt_script", str(path))
    assert "done without a step" in out
    assert "finished on ranks 0-3 after 0 optimizer steps" in out
    assert "never called optimizer.step() (1 backward() calls)" in out


def test_the_magics_run_a_script_and_pass_it_its_arguments(live4, ip, tmp_path):
    ip.run_line_magic("dt_launch", "4")
    out = _captured(ip, "dt_script", f"--cwd {tmp_path} {SCRIPTS / 'ddp_sampler.py'} --steps 3")
    assert "ddp_sampler.py paused on ranks 0-3 at step 0" in out
    assert _captured(ip, "dt_step", "1").startswith("step 1 in")
    out = _captured(ip, "dt_continue", "")
    assert "step 1 loss" in out or "step 2 loss" in out  # rank 0's prints, as they came
    assert "finished on ranks 0-3 after 3 optimizer steps" in out
    with pytest.raises(Exception, match="no script"):
        ip.run_line_magic("dt_script", str(tmp_path / "nope.py"))


def _captured(ip, magic: str, line: str) -> str:
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        ip.run_line_magic(magic, line)
    return out.stdout


def _children(session) -> dict[int, list[int]]:
    import psutil

    return {
        r: [c.pid for c in psutil.Process(i.pid).children(recursive=True)]
        for r, i in session.infos.items()
    }


def test_dataloader_workers_record_the_same_samples_and_end_with_the_script(live4, tmp_path):
    dt = live4
    args = ["--steps", "6", "--workers", "2"]
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), ["--steps", "6", "--out", str(tmp_path / "0")])
    dt.continue_script()
    inline = recorded(dt, "indices")
    before = _children(dt)  # what each engine always has (its sidecar's process)
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), [*args, "--out", str(tmp_path / "2")])
    dt.step(2)
    assert all(len(_children(dt)[r]) == len(before[r]) + 2 for r in range(4))  # 2 workers each
    dt.continue_script()
    assert recorded(dt, "indices") == inline  # prefetched ahead, attributed in order
    assert losses_in(tmp_path / "2") == losses_in(tmp_path / "0")
    assert _children(dt) == before  # shut down when the script ended


def test_a_hung_set_up_is_interrupted_by_the_timeout_and_the_ranks_stay(live4, tmp_path):
    from dtlab.control.errors import RankTimeoutError

    dt = live4
    path = tmp_path / "slow.py"
    path.write_text("import time\nprint('loading the dataset...', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(RankTimeoutError) as e:
        dt.run_script(str(path), timeout=3)
    assert e.value.stopped == (0, 1, 2, 3) and e.value.stuck == ()
    assert "loading the dataset" in dt.scripts.output[0]
    assert dt.run_script(str(SCRIPTS / "exits.py"), []).paused  # usable at once


def test_a_checkpoint_of_a_script_job_is_refused_not_made_wrong(live4, tmp_path):
    dt = live4
    dt.checkpoint_root = tmp_path / "checkpoints"
    dt.run_script(str(SCRIPTS / "exits.py"), ["--steps", "4"])
    dt.step(1)
    with pytest.raises(Exception, match="checkpoints of a script job are not supported yet"):
        dt.checkpoint()
    assert not list((tmp_path / "checkpoints").glob("**/manifest.json"))
    assert dt.continue_script().stopped == "ended"  # the script went on unharmed


@pytest.mark.parametrize("explicit", [False, True])
def test_two_optimizers_step_once_per_iteration(live4, tmp_path, explicit):
    dt = live4
    flags = ["--explicit"] if explicit else []
    torchrun(dt, "two_optimizers.py", [*flags, f"--out={tmp_path / 'torchrun'}"])
    status = dt.run_script(str(SCRIPTS / "two_optimizers.py"), [*flags, f"--out={tmp_path / 'dt'}"])
    assert status.paused
    dt.run_until("step>=2")  # %dt_run --until on a script job
    assert {recs[-1].step for recs in dt.trace.records.values()} == {2}
    assert dt.continue_script().last_step == 5  # five iterations, five steps
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")
    d, g = zip(*mine[0], strict=True)
    if explicit:  # from its first step_boundary() on, that call ends each iteration
        # (the first iteration's boundary was the discriminator's step: dtlab cannot read
        # ahead whether the script will call it)
        expected = [d[0], g[0] + d[1] + g[1]] + [d[i] + g[i] for i in range(2, 5)]
    else:  # the first optimizer to step (the discriminator's) marks the boundaries, so a
        # step's loss sums the backward() calls since the last: g_loss before, d_loss now
        expected = [d[0]] + [g[i - 1] + d[i] for i in range(1, 5)]
    assert recorded(dt)[0] == expected


def test_what_other_ranks_print_is_shown_after_each_magic_identical_text_once(live4, ip, tmp_path):
    path = tmp_path / "chatty.py"
    path.write_text(
        "import os\nimport torch\n"
        "print('hello from', os.environ['RANK'])\n"
        "w = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(w.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    w(torch.ones(1, 2)).sum().backward()\n"
        "    opt.step()\n"
        "    print('done a step')\n"
    )
    ip.run_line_magic("dt_launch", "4")
    started = _captured(ip, "dt_script", str(path))
    assert "hello from 0" in started  # rank 0 live
    assert "printed on other ranks:\nrank 1: hello from 1\nrank 2: hello from 2\n" in started
    stepped = _captured(ip, "dt_step", "2")
    assert "printed on other ranks:\nranks 1-3: done a step\n" in stepped  # grouped, once
    assert stepped.count("done a step") == 2  # rank 0's line, then ranks 1-3's


def test_a_dead_rank_is_recovered_by_running_the_script_again_to_its_step(live4, tmp_path, ip):
    dt = live4
    dt.set_job_setup(lambda: None)  # an earlier job's setup: the script replaces it
    args = ["--steps", "10", "--out"]
    torchrun(dt, "ddp_sampler.py", [*args, str(tmp_path / "torchrun")])
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), [*args, str(tmp_path / "dt")])
    dt.step(4)
    os.kill(dt.infos[2].pid, signal.SIGKILL)
    with pytest.raises(RankError, match="rank 2 died"):
        dt.step(1)
    out = _captured(ip, "dt_restart", "")
    assert "restarted 4 ranks in " in out and "the script ran again to step 4" in out
    assert "its parameters are bit for bit those of the first run" in out
    event = dt.restarts[-1]
    assert (event["rerun"], event["step"], event["differ"]) == (True, 4, [])
    assert dt.continue_script().last_step == 10
    assert losses_in(tmp_path / "dt") == losses_in(tmp_path / "torchrun")  # as if never died


@pytest.mark.parametrize("fresh", [True, False])
def test_a_resume_check_runs_the_script_again_to_its_step_and_compares(live4, tmp_path, fresh):
    dt = live4
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), ["--steps", "12"])
    dt.step(3)
    report = dt.resume_check(4, fresh=fresh)
    assert report.identical, report.summary()
    assert report.summary() == (
        f"the script run again to step 3 on {'fresh' if fresh else 'the same'} engines, "
        "then 4 steps: identical"
    )
    assert dt.trace.last_step == 7 and dt.continue_script().last_step == 12


def test_a_resume_check_names_what_a_script_that_does_not_reproduce_changes(live4, tmp_path):
    path = tmp_path / "clock_seeded.py"
    path.write_text(
        "import time\nimport torch\n"
        "torch.manual_seed(0)\nw = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(w.parameters(), lr=0.1)\n"
        "data = torch.Generator().manual_seed(time.time_ns())  # the bug: seeded by the clock\n"
        "for i in range(20):\n"
        "    w(torch.randn(8, 4, generator=data)).pow(2).mean().backward()\n"
        "    opt.step()\n    opt.zero_grad()\n"
    )
    dt = live4
    dt.run_script(str(path))
    dt.step(2)
    report = dt.resume_check(3, fresh=False)
    assert not report.identical
    text = report.summary()
    assert "first difference at step 3" in text and "model's inputs of step 3 differ" in text


def test_atexit_and_set_start_method_behave_as_in_a_process_of_its_own(live4, tmp_path):
    dt = live4
    path = tmp_path / "at_end.py"
    path.write_text(
        "import atexit, os, sys\nimport torch.multiprocessing as mp\n"
        "mp.set_start_method('spawn')  # a second run in the same engine must not fail\n"
        "def save():\n"
        "    open(os.path.join(sys.argv[1], f\"end{os.environ['RANK']}\"), 'w').close()\n"
        "atexit.register(save)\n"
    )
    for run in ("first", "second"):
        out = tmp_path / run
        out.mkdir()
        status = dt.run_script(str(path), [str(out)])
        assert {o["kind"] for o in status.outcomes.values()} == {"finished"}
        assert sorted(p.name for p in out.iterdir()) == [f"end{r}" for r in range(4)]
    # the engines' own start method is back for the next job
    methods = dt.run(lambda: __import__("multiprocessing").get_start_method(allow_none=True))
    assert set(methods.values()) != {"spawn"}

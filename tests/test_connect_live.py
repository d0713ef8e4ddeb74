"""``dtlab.connect(run_dir)``: a notebook (this test process) connects to a job that
``torchrun -m dtlab.run`` started in the background, pauses it at the same step on every
rank, reads and changes the script's variables, lets it go on and leaves it running.

Each test starts real ``torchrun --standalone --nproc-per-node 2`` jobs as subprocesses in a
session of their own, with a hard timeout, and kills them by pid at the end whatever happened
(tests/test_run_wrapper_live.py: ``start``/``stop``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

import dtlab
from dtlab.control.connect import ConnectedJob, ConnectError
from dtlab.control.errors import DtlabError
from dtlab.views.figures import dashboard_trace_index
from tests.conftest import GLOO_TEARDOWN, untimed
from tests.test_run_wrapper_live import (
    SCRIPTS,
    TORCHRUN,
    N,
    hangs_now,
    losses,
    run,
    start,
    stop,
)

pytestmark = pytest.mark.timeout(600)
WRAP = [*TORCHRUN, "-m", "dtlab.run"]
LONG = "100000"  # steps: the job runs until a test changes that


def connected(
    run_dir: Path, proc: subprocess.Popen, timeout: float = 120, **options
) -> ConnectedJob:
    """Connect once the job's controller is up (its first step); fail if the job ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return dtlab.connect(run_dir, timeout=20, **options)
        except ConnectError as e:
            if proc.poll() is not None:
                raise AssertionError(
                    f"the job ended before it could be connected to: {e}"
                ) from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def long_job(tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """The DDP tutorial form under ``-m dtlab.run``, long enough to run until stopped."""
    run_dir = tmp_path / "job"
    cmd = [*WRAP, "--run-dir", str(run_dir), str(SCRIPTS / "ddp_sampler.py"), "--steps", LONG]
    return run_dir, start(cmd, tmp_path)


def as_torchrun(
    proc: subprocess.Popen, out: str, err: str, tmp_path: Path, end: int, args: list[str]
) -> None:
    """The job ended well after ``end`` steps with the losses (in ``tmp_path/dtlab``) and
    stdout of the same script under plain torchrun, ``args`` then ``--out=torchrun``."""
    # gloo's teardown abort at exit is torch's (conftest); what the job did is checked next
    assert proc.returncode == 0 or GLOO_TEARDOWN in err, err[-3000:]
    ours = losses(tmp_path / "dtlab")
    assert {r: len(v) for r, v in ours.items()} == {r: end for r in range(N)}
    plain = run([*TORCHRUN, *args, "--out=torchrun"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert ours == losses(tmp_path / "torchrun")  # bit for bit, as if never paused
    assert out == plain.stdout  # nothing of dtlab's on the script's stdout


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    return out, err


def test_connect_pause_change_continue_disconnect_reconnect_and_run_to_the_end(tmp_path):
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "ddp_sampler.py")
    proc = start(
        [*WRAP, "--run-dir", str(run_dir), script, "--steps", LONG, "--out", "dtlab"], tmp_path
    )
    try:
        dt = connected(run_dir, proc)
        held = dt.pause()
        where = dt.where()
        assert {w.held for w in where.values()} == {held}  # every rank after the same step
        assert {w.step for w in where.values()} == {held}
        # held inside optimizer step `held` (its gradients made, its update not yet, as
        # under %dt_script): the script's own counter has counted the steps before it
        code = "print(script_locals['step'], script_locals['args'].steps, rank)"
        said = dt.run_code(code)
        assert said == {r: (f"{held - 1} {LONG} {r}\n", "") for r in range(N)}
        # the steps are still recorded from the folder: every step up to the hold, on every rank
        trace = dt.trace
        assert {r: [rec.step for rec in recs][-1] for r, recs in trace.records.items()} == {
            r: held for r in range(N)
        }
        assert {r: len(recs) for r, recs in trace.records.items()} == {r: held for r in range(N)}
        found = untimed(dt.doctor())
        assert found == [], [f.summary for f in found]
        assert dt.step(3).last_step == held + 3
        end = held + 3 + 20
        dt.run_code(f"script_locals['args'].steps = {end}")  # the job now ends there
        assert dt.run_code("print(script_locals['args'].steps)")[1] == (f"{end}\n", "")
        dt.continue_()
        assert dt.paused_at is None
        dt.disconnect()
        with pytest.raises(DtlabError, match="disconnected"):
            dt.pause()
        again = dtlab.connect(run_dir, timeout=20)  # while it runs, or read-only if it ended
        again.disconnect()
        out, err = finish(proc)
    finally:
        stop(proc)
    as_torchrun(proc, out, err, tmp_path, end, [script, "--steps", str(end)])
    ended = dtlab.connect(run_dir)
    assert ended.read_only and len(ended.trace.records[0]) == end
    with pytest.raises(DtlabError, match="has ended"):
        ended.pause()


def test_a_nanogpt_form_connected_mid_run_ends_where_its_changed_max_iters_says(tmp_path):
    """nanoGPT's form (module-level loop, --key=value settings, its own accumulation):
    paused mid-run, ``iter_num`` read and ``max_iters`` changed (its loop reads it each
    iteration), doctor clean, continued, reconnected; losses as plain torchrun's."""
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "lm_windows.py")
    long = [f"--max_iters={LONG}", f"--lr_decay_iters={LONG}"]
    proc = start([*WRAP, "--run-dir", str(run_dir), script, *long, "--out=dtlab"], tmp_path)
    try:
        dt = connected(run_dir, proc)
        held = dt.pause()
        said = dt.execute("script_locals['iter_num'], script_locals['max_iters'], rank")
        assert {r: o.result for r, o in said.items()} == {
            r: f"({held - 1}, {LONG}, {r})" for r in range(N)
        }
        assert untimed(dt.doctor()) == []
        end = held + 5
        dt.run_code(f"script_locals['max_iters'] = {end}")
        dt.continue_()
        dt.disconnect()
        dtlab.connect(run_dir, timeout=20).disconnect()  # again, while it runs or ended
        out, err = finish(proc)
    finally:
        stop(proc)
    as_torchrun(proc, out, err, tmp_path, end, [script, f"--max_iters={end}",
                                                f"--lr_decay_iters={LONG}"])  # fmt: skip


def test_one_notebook_at_a_time_and_a_dead_notebook_leaves_the_job_running(tmp_path, ip, capsys):
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "ddp_sampler.py")
    proc = start([*WRAP, "--run-dir", str(run_dir), script, "--steps", LONG], tmp_path)
    notebook = None
    try:
        first = connected(run_dir, proc, lease_s=4.0)
        with pytest.raises(ConnectError, match="another notebook is connected"):
            dtlab.connect(run_dir, timeout=20)
        first.disconnect()
        ip.run_line_magic("dt_connect", str(run_dir))  # the same from a notebook's cell
        said = capsys.readouterr().out
        assert f"{run_dir}: ddp_sampler.py on 2 ranks, " in said and "running" in said
        assert ip.user_ns["dt"].paused_at is None and ip.user_ns["dt"].where()[1].step > 0
        ip.run_line_magic("dt_disconnect", "")
        assert f"disconnected; the job in {run_dir} runs on" in capsys.readouterr().out
        with pytest.raises(UsageError, match="no such folder"):
            ip.run_line_magic("dt_connect", str(tmp_path / "nowhere"))
        # a notebook that pauses the job and dies (SIGKILL, no disconnect)
        code = (
            "import dtlab, os, sys\n"
            f"dt = dtlab.connect({str(run_dir)!r}, timeout=20, lease_s=4.0)\n"
            "print(dt.pause(), flush=True)\n"
            "os.kill(os.getpid(), 9)\n"
        )
        notebook = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        assert notebook.returncode == -9, notebook.stderr[-2000:]
        held = int(notebook.stdout.split()[0])
        # the job holds, then goes on by itself once the dead notebook's lease ends
        after = connected(run_dir, proc, timeout=60)
        deadline = time.monotonic() + 60
        while min(w.step for w in after.where().values()) <= held + 5:
            assert time.monotonic() < deadline, after.where()
            time.sleep(0.2)
        assert "the notebook stopped answering" in _stderr_so_far(proc)
        after.disconnect()
    finally:
        stop(proc)


def test_the_magics_act_on_a_connected_job_and_find_its_planted_bug(tmp_path, ip, capsys):
    """%dt_connect, then the notebook as on a %dt_script job: %dt_pause, %%dt on the held
    ranks (script_locals, script, a last-line value), %dt_step, %dt_run --until,
    %dt_stacks, %dt_doctor, %dt_continue, %dt_disconnect; the planted bug (rank 1 steps
    with 10x the learning rate) found by --until diverged and named by the doctor."""
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "ddp_sampler.py")
    cmd = [*WRAP, "--run-dir", str(run_dir), script, "--steps", LONG, "--lr-rank", "1"]
    proc = start(cmd, tmp_path)
    try:
        connected(run_dir, proc).disconnect()  # up: its controller answers
        ip.run_line_magic("dt_connect", str(run_dir))
        capsys.readouterr()
        ip.run_line_magic("dt_pause", "")
        said = capsys.readouterr().out
        held = ip.user_ns["dt"].paused_at
        assert f"every rank paused after step {held}; loss " in said, said
        ip.run_cell_magic("dt", "", "rank, script.__name__, script_locals['args'].lr_rank")
        said = capsys.readouterr().out
        assert "(0, '__main__', 1)" in said and "(1, '__main__', 1)" in said, said
        ip.run_cell_magic("dt", "--ranks 1", "print('on rank', rank)")
        said = capsys.readouterr().out
        assert "on rank 1" in said and "on rank 0" not in said, said
        # names persist from cell to cell; %dt_push binds the notebook's, %dt_pull reads back
        ip.run_cell_magic("dt", "", "mine = rank * 10")
        ip.user_ns["factor"] = 3
        ip.run_line_magic("dt_push", "factor")
        ip.run_cell_magic("dt", "", "scaled = mine * factor")
        assert ip.run_line_magic("dt_pull", "scaled") == {0: 0, 1: 30}
        assert ip.run_line_magic("dt_pull", "step --ranks 1") == {1: held - 1}  # the script's
        assert {r: a.lr_rank for r, a in ip.run_line_magic("dt_pull", "args").items()} == {
            0: 1,
            1: 1,
        }
        with pytest.raises(DtlabError, match="no variable 'nothing_here'"):
            ip.run_line_magic("dt_pull", "nothing_here")
        capsys.readouterr()
        ip.run_line_magic("dt_step", "2")
        assert f"steps {held + 1}-{held + 2} in " in capsys.readouterr().out
        ip.run_line_magic("dt_run", f"--until step>={held + 5}")
        said = capsys.readouterr().out
        assert f"stopped: step>={held + 5} on ranks 0-1" in said, said
        assert ip.user_ns["dt"].paused_at == held + 5
        ip.run_line_magic("dt_run", "--until loss>1e30 --max-steps 2")
        said = capsys.readouterr().out
        assert "loss>1e+30 never held" in said and ip.user_ns["dt"].paused_at == held + 7, said
        # the planted bug: rank 1's weights leave rank 0's at its first step with 10x the LR
        ip.run_line_magic("dt_run", "--until diverged --max-steps 5")
        said = capsys.readouterr().out
        assert f"step {held + 8} " in said and "stopped: diverged" in said, said
        heat = ip.run_line_magic("dt_plot", "deviation")  # the held step's parameters
        assert f"step {held + 8}" in heat.layout.title.text, heat.layout.title.text
        assert list(heat.data[0].y) == ["rank 0", "rank 1"] and len(heat.data[0].x) == 4
        # DDP averages the gradients: they agree bitwise though the weights do not (the
        # bug is in the update), which the figure says
        notes = [a.text for a in heat.layout.annotations]
        assert any("all bitwise equal" in t for t in notes), notes
        stacks = ip.run_line_magic("dt_stacks", "")
        said = capsys.readouterr().out
        assert set(stacks) == {0, 1} and "ddp_sampler.py" in said, said
        ip.run_line_magic("dt_doctor", "")
        said = capsys.readouterr().out
        found = ip.user_ns["dt"].doctor()
        assert any(1 in f.ranks for f in found), [f.summary for f in found]
        assert "rank 1" in said, said
        ip.run_line_magic("dt_continue", "")
        assert "the job runs on" in capsys.readouterr().out
        assert ip.user_ns["dt"].paused_at is None
        ip.run_line_magic("dt_disconnect", "")
        assert "runs on" in capsys.readouterr().out
        with pytest.raises(UsageError, match="%dt_connect RUN_DIR"):
            ip.run_line_magic("dt_pause", "")
        assert proc.poll() is None  # the job runs on after all of it
    finally:
        stop(proc)


def test_the_dashboard_and_the_report_on_a_connected_job(tmp_path):
    """dt.dashboard() on a job connected to, driven through its buttons' handlers as a
    kernel would: Step, Run N then Pause (the job held where the run ended), Run until;
    the notebook's other calls wait while it runs; dt.report() from the folder."""
    run_dir = tmp_path / "job"
    proc = start([*WRAP, "--run-dir", str(run_dir), str(SCRIPTS / "ddp_sampler.py"), "--steps",
                  LONG], tmp_path)  # fmt: skip
    try:
        dt = connected(run_dir, proc)

        def drawn(dash, rank: int) -> list:
            return list(dash.figure.data[dashboard_trace_index("loss", rank, N)].x)

        async def drive():
            dash = dt.dashboard()
            assert len(dash.figure.data) == 3 * N  # 3 panels x N ranks
            dash.step_button.click()
            assert dash.running and dash.step_button.disabled and not dash.pause_button.disabled
            first = await dash.wait()
            assert first.num_steps == 1 and dt.paused_at == first.last_step
            assert {w.held for w in dt.where().values()} == {first.last_step}
            assert all(drawn(dash, r)[-1] == first.last_step for r in range(N))

            dash.num_steps.value = 100_000
            dash.run_button.click()
            deadline = time.monotonic() + 60
            while dt.current_step < first.last_step + 3:  # the loop is free while it steps
                assert time.monotonic() < deadline, dash.status.value
                await asyncio.sleep(0.05)
            assert dash.running and dash.status.value.startswith("running")
            with pytest.raises(DtlabError, match="dashboard is running"):
                dt.step(1)
            dash.pause_button.click()
            paused = await dash.wait()
            assert paused.stopped == "pause" and paused.last_step >= first.last_step + 3
            assert {w.held for w in dt.where().values()} == {paused.last_step}
            assert dt.paused_at == paused.last_step and not dash.running

            dash.until.value = f"step>={paused.last_step + 2}"
            dash.until_button.click()
            until = await dash.wait()
            assert (until.last_step, until.stopped) == (paused.last_step + 2, "until")
            assert "stopped: step>=" in dash.status.value, dash.status.value
            assert all(drawn(dash, r)[-1] == until.last_step for r in range(N))
            return until.last_step

        held = asyncio.run(asyncio.wait_for(drive(), timeout=180))
        assert dt.step(1).last_step == held + 1  # the notebook's own calls work again
        page = dt.report(tmp_path / "report.html")
        assert page == tmp_path / "report.html" and "plotly" in page.read_text()
        dt.disconnect()
        assert proc.poll() is None  # the job runs on
    finally:
        stop(proc)


def _stderr_so_far(proc: subprocess.Popen) -> str:
    """What the job wrote to stderr so far (it keeps running: read without waiting)."""
    os.set_blocking(proc.stderr.fileno(), False)
    try:
        return proc.stderr.read() or ""
    finally:
        os.set_blocking(proc.stderr.fileno(), True)


def test_what_cannot_be_connected_to_says_why(tmp_path):
    with pytest.raises(ConnectError, match="no such folder"):
        dtlab.connect(tmp_path / "nothing")
    with pytest.raises(ConnectError, match="not a job folder.*-m dtlab.run"):
        dtlab.connect(tmp_path)
    # a job started with --no-connect: recorded, but nothing to connect to
    quiet = tmp_path / "quiet"
    done = run(
        [*WRAP, "--no-connect", "--run-dir", str(quiet), str(SCRIPTS / "ddp_sampler.py")], tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (quiet / "ipython").exists()
    ended = dtlab.connect(quiet)  # it ended: read-only, its records readable
    assert ended.read_only and len(ended.trace.records[1]) == 8
    (quiet / "rank-1" / "outcome.json").unlink()  # as if rank 1 still ran
    with pytest.raises(ConnectError, match="--no-connect"):
        dtlab.connect(quiet)


def test_a_connection_file_others_can_read_and_a_gone_controller_are_refused(tmp_path):
    run_dir, proc = long_job(tmp_path)
    try:
        connected(run_dir, proc).disconnect()
        security = run_dir / "ipython" / "security"
        client_file = security / "ipcontroller-job-client.json"
        assert oct(client_file.stat().st_mode & 0o777) == "0o600"
        assert oct((run_dir / "ipython").stat().st_mode & 0o777) == "0o700"
        assert oct((run_dir / "rank-1" / ".engine.json").stat().st_mode & 0o777) == "0o600"
        client_file.chmod(0o644)
        with pytest.raises(ConnectError, match="readable by others.*chmod 600"):
            dtlab.connect(run_dir)
        client_file.chmod(0o600)
        below = psutil.Process(proc.pid).children(recursive=True)
        parts = {p.pid: p for p in below if "ipyparallel.controller" in " ".join(p.cmdline())}
        main = [p for p in parts.values() if p.ppid() not in parts]  # (its schedulers below)
        assert len(main) == 1  # started by rank 0, under the job
        main[0].kill()  # by its pid; what it orphans is killed at the end, by pid too
        main[0].wait(30)
        with pytest.raises(ConnectError, match="does not answer"):
            dtlab.connect(run_dir, timeout=3)
        assert proc.poll() is None  # the job itself runs on
    finally:
        stop(proc)
        for part in locals().get("parts", {}).values():
            try:
                part.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_rank_0_killed_with_sigkill_leaves_no_controller_behind(tmp_path):
    """kill -9 of rank 0 leaves it no time to stop the controller it started: the guard
    it started beside it does, with ipyparallel's own stop; then the guard ends too."""
    run_dir, proc = long_job(tmp_path)
    try:
        connected(run_dir, proc).disconnect()
        below = psutil.Process(proc.pid).children(recursive=True)
        controller = [p for p in below if "ipyparallel.controller" in " ".join(p.cmdline())]
        guard = [p for p in below if "dtlab.agent.controller_guard" in " ".join(p.cmdline())]
        rank0 = [p for p in below if p.ppid() == proc.pid and p.environ().get("RANK") == "0"]
        assert controller and len(guard) == 1 and len(rank0) == 1, below
        rank0[0].kill()
        _, left = psutil.wait_procs(controller + guard, timeout=60)
        assert left == [], [(p.pid, p.cmdline()) for p in left]
        said = (run_dir / "ipython" / "guard.log").read_text()
        assert f"rank 0 (pid {rank0[0].pid}) is gone: stopped its controller" in said, said
        with pytest.raises(ConnectError):
            dtlab.connect(run_dir, timeout=3)
    finally:
        found = stop(proc)
        for part in locals().get("controller", []) + locals().get("guard", []):
            if part not in found:
                try:
                    part.kill()
                except psutil.NoSuchProcess:
                    pass


def test_a_hung_job_shows_its_hang_report_first_and_its_stacks(tmp_path, ip, capsys):
    """Rank 1 stops stepping after step 3, rank 0 waits in DDP's all-reduce: connecting
    says so first; a pause cannot be reached and says where to look; the stacks show it."""
    run_dir = tmp_path / "job"
    script = str(SCRIPTS / "batch_faults.py")
    cmd = [*WRAP, "--run-dir", str(run_dir), "--hang-timeout", "2", script, "--hang-rank", "1"]
    proc = start(cmd, tmp_path)
    try:
        _hung_after(run_dir, proc, 3)
        ip.run_line_magic("dt_connect", str(run_dir))
        said = capsys.readouterr().out
        assert "rank 1 made no step for 2 s after step 3" in said
        assert said.index("made no step") < said.index("<dtlab ConnectedJob")
        # the verdict from the ranks' Flight Recorders, before the notebook asks anything
        verdict = next(text for text in said.splitlines() if text.startswith("hung: "))
        assert "rank 0 is in all_reduce #" in verdict and "rank 1 never entered it" in verdict
        assert said.index(verdict) < said.index("<dtlab ConnectedJob")
        dt = ip.user_ns["dt"]
        with pytest.raises(DtlabError, match=r"not every rank reached step 4.*dt\.stacks\(\)"):
            dt.pause(timeout=3)
        assert {w.at for w in dt.where().values()} == {None}  # the hold is called off
        stacks = dt.stacks()
        source = Path(script).read_text().splitlines()
        line = 1 + next(i for i, text in enumerate(source) if "time.sleep(0.2)" in text)
        assert f'batch_faults.py", line {line} in <module>' in stacks[1]
        assert "in backward" in stacks[0]  # waiting in DDP's all-reduce
        dt.disconnect()
    finally:
        stop(proc)


def _hung_after(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    """Wait until every rank's watchdog reports it made no step after ``step`` (on a busy
    machine a rank may also be late for an earlier step and report that one resumed)."""
    deadline = time.monotonic() + 120
    while {r: h.step for r, h in hangs_now(run_dir).items()} != dict.fromkeys(range(N), step):
        assert proc.poll() is None, "the job ended instead of hanging"
        assert time.monotonic() < deadline, f"no hang report after step {step} from every rank"
        time.sleep(0.2)


def _ds_config(tmp_path: Path) -> str:
    config = tmp_path / "ds_config.json"
    config.write_text(
        '{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, '
        '"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, '
        '"zero_optimization": {"stage": 2}}'
    )
    return str(config)


@pytest.mark.parametrize("form", ["hf_trainer", "deepspeed_zero2"])
def test_a_trainer_or_deepspeed_job_connected_mid_run_ends_as_under_its_launcher(
    form, tmp_path, request
):
    """An HF Trainer script under torchrun, a DeepSpeed ZeRO-2 one under the deepspeed
    launcher: connected to mid-run, held after the same step on both ranks, the step the
    framework itself counts read there, two steps on, continued and left; the job ends as
    the same launcher's plain run does, every micro-batch's loss bit for bit."""
    # long enough to be connected to mid-run on a loaded machine (300 HF Trainer steps
    # ended before the connection, once, in a full run)
    steps = "1000" if form == "hf_trainer" else "300"
    if form == "hf_trainer":
        script = str(SCRIPTS / "hf_trainer.py")
        launcher, wrap = TORCHRUN, ["-m", "dtlab.run"]
        theirs, ours = [script, "torchrun", "--steps", steps], [script, "dtlab", "--steps", steps]
        # held inside optimizer step `held`: the Trainer has counted the ones before it
        counted, expect = "script_locals['trainer'].state.global_step", -1
    else:
        request.getfixturevalue("deepspeed_ops")
        script = str(SCRIPTS / "ds_zero.py")
        launcher = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={N}"]
        wrap = ["--module", "dtlab.run"]
        args = ["--steps", steps, "--deepspeed", "--deepspeed_config", _ds_config(tmp_path)]
        theirs, ours = [script, *args, "--out", "torchrun"], [script, *args, "--out", "dtlab"]
        # a DeepSpeed step's boundary is engine.step() returning with global_steps moved
        # (agent/deepspeed_observe.py): held after it, DeepSpeed has counted it
        counted, expect = "script_locals['engine'].global_steps", 0
    run_dir = tmp_path / "job"
    proc = start([*launcher, *wrap, "--run-dir", str(run_dir), *ours], tmp_path)
    try:
        dt = connected(run_dir, proc)
        held = dt.pause()
        assert dt.run_code(f"print({counted})") == {r: (f"{held + expect}\n", "") for r in range(N)}
        assert dt.step(2).last_step == held + 2
        dt.continue_()
        dt.disconnect()
        _, err = finish(proc)
    finally:
        stop(proc)
    assert proc.returncode == 0 or GLOO_TEARDOWN in err, err[-3000:]
    plain = run([*launcher, *theirs], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert losses(tmp_path / "dtlab") == losses(tmp_path / "torchrun")

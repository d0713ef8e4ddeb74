"""``torchrun ... -m dtlab.run train.py``: the job as torchrun runs it, every step of every
rank recorded into a job folder, and ``dtlab doctor`` on that folder, with no notebook.

Each test starts real ``torchrun --standalone --nproc-per-node 2`` jobs (the same script
with and without ``-m dtlab.run``, in the same test) as subprocesses in a session of their
own, with a hard timeout; the session is killed (by its pid) at the end whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dtlab import cli
from dtlab.analysis.doctor import all_findings
from dtlab.records import job_folder as jf
from dtlab.records.trace import Trace
from tests.conftest import GLOO_TEARDOWN, TEARDOWN_TRIES, untimed

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
N = 2
TIMEOUT_S = 240
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}"]


def env(**more) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **more}


def start(cmd: list[str], cwd: Path, **more) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env(**more),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: stopped whole, by its pid
    )


def stop(proc: subprocess.Popen) -> list:
    """The launcher and every process under it, by pid (torchrun starts each rank in a
    session of its own, so the launcher's process group alone would leave them)."""
    try:
        found = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        found = []
    for child in found:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    psutil.wait_procs(found, timeout=30)
    return found


def run(cmd: list[str], cwd: Path, **more) -> subprocess.CompletedProcess:
    for _ in range(TEARDOWN_TRIES):
        proc = start(cmd, cwd, **more)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        finally:
            stop(proc)
        # gloo's teardown abort as the process ends: torch's, not the script's (conftest)
        if GLOO_TEARDOWN not in err:
            break
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def both(script: str, args: list[str], tmp: Path, *wrapper: str, **more):
    """The script under plain torchrun, then under -m dtlab.run (its losses to
    tmp/torchrun and tmp/dtlab when it takes ``--out``)."""
    path = str(SCRIPTS / script)
    plain = run([*TORCHRUN, path, *args], tmp, **more)
    ours = run([*TORCHRUN, "-m", "dtlab.run", *wrapper, path, *args], tmp, **more)
    return plain, ours


def losses(folder: Path) -> dict[int, list]:
    return {r: json.loads((folder / f"rank{r}.json").read_text()) for r in range(N)}


def steps_of(trace: Trace) -> dict[int, list[int]]:
    return {r: [rec.step for rec in recs] for r, recs in trace.records.items()}


def doctor(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dtlab", "doctor", str(folder)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def findings_of(folder: Path) -> list:
    return all_findings(cli.checks_of(cli.load(str(folder))))


def assert_clean(folder: Path) -> None:
    found = findings_of(folder)
    assert untimed(found) == [], [f.summary for f in found]
    said = doctor(folder)
    assert said.returncode == (1 if found else 0), said.stdout + said.stderr


def test_the_ddp_tutorial_script_runs_as_under_torchrun_and_every_step_is_recorded(tmp_path):
    args = ["--steps", "10", "--batch-size", "8"]
    run_dir = tmp_path / "job"
    plain = run([*TORCHRUN, str(SCRIPTS / "ddp_sampler.py"), *args, "--out", "torchrun"], tmp_path)
    ours = run(
        [*TORCHRUN, "-m", "dtlab.run", "--run-dir", str(run_dir),
         str(SCRIPTS / "ddp_sampler.py"), *args, "--out", "dtlab"],
        tmp_path,
    )  # fmt: skip
    assert plain.returncode == ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout == plain.stdout  # rank 0 prints every step's loss
    mine = losses(tmp_path / "dtlab")
    assert mine == losses(tmp_path / "torchrun")  # bit for bit, every step, every rank
    trace = Trace.load(run_dir)
    assert steps_of(trace) == {r: list(range(1, 11)) for r in range(N)}
    assert {r: [rec.loss for rec in recs] for r, recs in trace.records.items()} == mine
    assert trace.jobs[0].wrapper == "DistributedDataParallel" and trace.jobs[1].record
    assert all(rec.param_fingerprint for recs in trace.records.values() for rec in recs)
    job = jf.read_job(run_dir)
    assert {r: (o.kind, o.step) for r, o in job.outcomes.items()} == {
        0: ("finished", 10),
        1: ("finished", 10),
    }
    assert {r: i.backend for r, i in job.ranks.items()} == {0: "gloo", 1: "gloo"}
    assert_clean(run_dir)


def test_a_nanogpt_style_script_with_its_own_accumulation(tmp_path):
    plain = run([*TORCHRUN, str(SCRIPTS / "lm_windows.py"), "--out=torchrun"], tmp_path)
    ours = run(
        [*TORCHRUN, "-m", "dtlab.run", "--run-dir", "job", str(SCRIPTS / "lm_windows.py"),
         "--out=dtlab"],
        tmp_path,
    )  # fmt: skip
    assert plain.returncode == ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout == plain.stdout
    mine = losses(tmp_path / "dtlab")
    assert mine == losses(tmp_path / "torchrun")
    trace = Trace.load(tmp_path / "job")  # (a relative --run-dir: from the job's folder)
    assert steps_of(trace) == {r: list(range(1, 7)) for r in range(N)}
    assert {r: [rec.loss for rec in recs] for r, recs in trace.records.items()} == mine
    rec = trace.records[1][-1]
    assert (rec.micro_batches, rec.synced_micro_batches) == (4, 1)  # its own toggle
    assert_clean(tmp_path / "job")


def test_a_planted_learning_rate_bug_is_named_by_dtlab_doctor(tmp_path):
    args = [str(SCRIPTS / "ddp_sampler.py"), "--steps", "8", "--lr-rank", "1"]
    done = run([*TORCHRUN, "-m", "dtlab.run", "--run-dir", "job", *args], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = doctor(tmp_path / "job")
    assert said.returncode == 1, said.stdout + said.stderr
    assert "the learning rate at step 1 is 0.166667 on rank 1" in said.stdout
    [found] = [f for f in findings_of(tmp_path / "job") if f.kind == "learning_rate"]
    assert found.ranks == (1,) and found.step == 1


def test_a_rank_that_raises_leaves_every_step_before_it_and_the_doctor_names_it(tmp_path):
    args = ["--crash-rank", "1", "--at", "3", "--steps", "6"]
    plain, ours = both("batch_faults.py", args, tmp_path, "--run-dir", "job")
    assert plain.returncode == ours.returncode == 1
    assert ours.stdout == plain.stdout
    assert "RuntimeError: planted crash on rank 1 after step 3" in ours.stderr  # its traceback
    # from the script's own frame, as Python prints it (torch prefixes the rank)
    mine = [line for line in ours.stderr.splitlines() if line.startswith("[rank1]:")]
    theirs = [line for line in plain.stderr.splitlines() if line.startswith("[rank1]:")]
    assert mine == theirs and any('batch_faults.py", line' in line for line in mine)
    trace = Trace.load(tmp_path / "job")
    assert steps_of(trace) == {r: [1, 2, 3] for r in range(N)}
    said = doctor(tmp_path / "job")
    assert said.returncode == 1, said.stdout + said.stderr
    assert "rank 1 failed at step 3: RuntimeError: planted crash on rank 1 after step 3" in (
        said.stdout
    )
    assert "steps 1-3 recorded on every rank" in said.stdout


def test_exit_code_default_folder_and_recording_off(tmp_path):
    runs = tmp_path / "runs"
    args = ["--steps", "4", "--exit-code", "3"]
    plain, ours = both("batch_faults.py", args, tmp_path, "--no-record", DTLAB_RUNS_DIR=str(runs))
    assert plain.returncode == ours.returncode == 1  # torchrun's, for a rank that failed
    assert "exitcode  : 3" in plain.stderr and "exitcode  : 3" in ours.stderr  # the ranks'
    assert ours.stdout == plain.stdout
    [folder] = list(runs.iterdir())  # one job folder, named by rank 0 for both ranks
    assert folder.name.startswith("batch_faults-")
    assert f"dtlab.run: recording every step of every rank in runs/{folder.name}" in ours.stderr
    trace = Trace.load(folder)
    assert steps_of(trace) == {r: [1, 2, 3, 4] for r in range(N)}
    assert not trace.jobs[0].record
    assert not any(rec.param_fingerprint for recs in trace.records.values() for rec in recs)
    assert all(rec.loss > 0 for recs in trace.records.values() for rec in recs)
    job = jf.read_job(folder)
    assert {(o.kind, o.code) for o in job.outcomes.values()} == {("exited", 3)}
    assert cli.describe(cli.load(str(folder)))[1:] == [
        "rank 0 exited with code 3 at step 4",
        "rank 1 exited with code 3 at step 4",
    ]


def test_a_hung_job_is_named_while_it_hangs(tmp_path):
    """One rank stops stepping; the other waits in DDP's all-reduce. With no notebook,
    each rank's watchdog writes its stack; the doctor reads the folder of the running job."""
    cmd = [*TORCHRUN, "-m", "dtlab.run", "--run-dir", "job", "--hang-timeout", "2",
           str(SCRIPTS / "batch_faults.py"), "--hang-rank", "1", "--at", "3"]  # fmt: skip
    proc = start(cmd, tmp_path)
    ranks: list = []
    try:
        reports = [jf.rank_folder(tmp_path / "job", r) / jf.HANG_FILE for r in range(N)]
        deadline = time.monotonic() + TIMEOUT_S
        while not all(p.exists() for p in reports):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no hang report"
            time.sleep(0.5)
        said = doctor(tmp_path / "job")
        assert said.returncode == 1, said.stdout + said.stderr
        out = said.stdout
        assert "steps 1-3 recorded on every rank" in out
        assert "rank 0: still running" in out and "rank 1: still running" in out
        assert "rank 1 made no step for 2 s after step 3" in out
        source = (SCRIPTS / "batch_faults.py").read_text().splitlines()
        line = 1 + next(i for i, text in enumerate(source) if "time.sleep(0.2)" in text)
        assert f'batch_faults.py", line {line} in <module>' in out  # where rank 1 is stuck
        assert "in backward" in out  # rank 0: waiting in DDP's all-reduce
        # stopped as a scheduler stops a job: torchrun passes SIGTERM on to the ranks,
        # which write what they hold and how they ended before they go
        ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        outcomes = jf.read_job(tmp_path / "job").outcomes
        assert {r: (o.kind, o.code, o.step) for r, o in outcomes.items()} == {
            r: ("killed", signal.SIGTERM, 3) for r in range(N)
        }
        assert steps_of(Trace.load(tmp_path / "job")) == {r: [1, 2, 3] for r in range(N)}
    finally:
        stopped = stop(proc) + ranks
        psutil.wait_procs(ranks, timeout=30)
    assert len(stopped) >= N and not any(p.is_running() for p in stopped)  # none left


@pytest.mark.timeout(900)
def test_the_deepspeed_launcher_passes_local_rank_through_dtlab_run(tmp_path, deepspeed_ops):
    config = tmp_path / "ds_config.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                "zero_optimization": {"stage": 2},
            }
        )
    )
    launcher = [str(Path(sys.executable).parent / "deepspeed"), f"--num_gpus={N}"]
    args = ["--steps", "4", "--deepspeed", "--deepspeed_config", str(config)]
    script = str(SCRIPTS / "ds_zero.py")
    plain = run([*launcher, script, *args, "--out", "plain"], tmp_path)
    ours = run(
        [*launcher, "--module", "dtlab.run", "--run-dir", "job", script, *args, "--out", "dtlab"],
        tmp_path,
    )
    assert plain.returncode == ours.returncode == 0, ours.stderr[-3000:]
    assert losses(tmp_path / "dtlab") == losses(tmp_path / "plain")
    trace = Trace.load(tmp_path / "job")
    assert steps_of(trace) == {r: [1, 2, 3, 4] for r in range(N)}
    assert trace.jobs[0].deepspeed is not None and trace.jobs[0].deepspeed.zero_stage == 2

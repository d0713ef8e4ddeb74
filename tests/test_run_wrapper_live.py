"""``torchrun ... -m dtlab.run train.py``: the job as torchrun runs it, every step of every
rank recorded into a job folder, and ``dtlab doctor`` on that folder, with no notebook.

Each test starts real ``torchrun --standalone --nproc-per-node 2`` jobs (the same script
with and without ``-m dtlab.run``, in the same test) as subprocesses in a session of their
own, with a hard timeout; the session is killed (by its pid) at the end whatever happened.
"""

from __future__ import annotations

import json
import os
import re
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


def line_of(text: str) -> int:
    """The line of batch_faults.py that holds ``text``."""
    source = (SCRIPTS / "batch_faults.py").read_text().splitlines()
    return 1 + next(i for i, line in enumerate(source) if text in line)


def hung(tmp_path: Path, *faults: str, at: int = 3) -> tuple[subprocess.Popen, str]:
    """batch_faults.py under -m dtlab.run with a 2 s hang timeout, once every rank wrote its
    hang report after step ``at`` (on a busy machine a rank may also be 2 s late for an
    earlier step, and report it resumed): the job (still running) and what ``dtlab
    doctor`` says of it."""
    cmd = [*TORCHRUN, "-m", "dtlab.run", "--run-dir", "job", "--hang-timeout", "2",
           str(SCRIPTS / "batch_faults.py"), *faults, "--at", str(at)]  # fmt: skip
    proc = start(cmd, tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    while {r: h.step for r, h in hangs_now(tmp_path / "job").items()} != dict.fromkeys(
        range(N), at
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            err = proc.communicate()[1]
            pytest.fail(f"no hang report from every rank (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(0.5)
    said = doctor(tmp_path / "job")
    assert said.returncode == 1, said.stdout + said.stderr
    return proc, said.stdout


def hangs_now(folder: Path) -> dict:
    """The hang reports of ranks that have not stepped on since (none: not readable yet)."""
    try:
        return {r: h for r, h in jf.read_job(folder).hangs.items() if h.resumed is None}
    except (ValueError, OSError):  # (a rank folder made while it is read)
        return {}


def end_with_sigterm(proc: subprocess.Popen) -> None:
    """Stop the job as a scheduler does: torchrun passes SIGTERM on to the ranks, which
    write what they hold and how they ended before they go."""
    ranks = psutil.Process(proc.pid).children(recursive=True)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        stopped = stop(proc) + ranks
        psutil.wait_procs(ranks, timeout=30)
    assert len(stopped) >= N and not any(p.is_running() for p in stopped)  # none left


def test_a_hung_job_is_named_while_it_hangs(tmp_path):
    """One rank stops stepping; the other waits in DDP's all-reduce. With no notebook,
    each rank's watchdog writes its stack and its last collectives (torch's Flight
    Recorder); the doctor reads the folder of the running job and gives the verdict."""
    proc, out = hung(tmp_path, "--hang-rank", "1")
    try:
        assert "steps 1-3 recorded on every rank" in out
        assert "rank 0: still running" in out and "rank 1: still running" in out
        assert "rank 1 made no step for 2 s after step 3" in out
        line = line_of("time.sleep(0.2)")
        assert f'batch_faults.py", line {line} in <module>' in out  # where rank 1 is stuck
        assert "in backward" in out  # rank 0: waiting in DDP's all-reduce
        # the verdict: the collective rank 0 waits in, which rank 1 never entered, and where
        # rank 1 is instead (its own line, not dtlab's or torch's)
        verdict = next(text for text in out.splitlines() if text.startswith("hung: "))
        assert "rank 0 is in all_reduce #" in verdict and "on default_pg" in verdict, verdict
        assert f"rank 1 never entered it: rank 1 in `<module>` (batch_faults.py:{line}" in verdict
    except BaseException:
        stop(proc)
        raise
    end_with_sigterm(proc)
    outcomes = jf.read_job(tmp_path / "job").outcomes
    assert {r: (o.kind, o.code, o.step) for r, o in outcomes.items()} == {
        r: ("killed", signal.SIGTERM, 3) for r in range(N)
    }
    assert steps_of(Trace.load(tmp_path / "job")) == {r: [1, 2, 3] for r in range(N)}


def test_a_rank_that_skips_the_all_reduces_hangs_the_job_and_the_doctor_names_it(tmp_path):
    """Uneven data: rank 1's runs out after 3 steps, so it skips step 4's gradient
    all-reduce and waits in the closing barrier while rank 0 waits in that all-reduce.
    Each rank's Flight Recorder says which collective it is in: the same number, not the
    same op. The doctor names it, the ranks and their lines, from the folder alone."""
    proc, out = hung(tmp_path, "--short-rank", "1")
    try:
        verdict = next(text for text in out.splitlines() if text.startswith("hung: "))
        assert "mismatched collective #" in verdict and "on default_pg" in verdict, verdict
        assert "rank 0 passed all_reduce [161]" in verdict  # DDP's one bucket of gradients
        assert "rank 1 passed barrier" in verdict
        where = out.splitlines()[out.splitlines().index(verdict) + 1 :][:2]
        backward, barrier = line_of("loss.backward()"), line_of("dist.barrier()")
        assert where[0].startswith(f"    rank 0 in `<module>` (batch_faults.py:{backward}: "), where
        assert where[1].startswith(f"    rank 1 in `<module>` (batch_faults.py:{barrier}: "), where
    except BaseException:
        stop(proc)
        raise
    end_with_sigterm(proc)
    # both ranks wait in gloo, where Python's handler never runs: each still says how it
    # ended (not a SIGKILL after torchrun's grace, unsaid)
    outcomes = jf.read_job(tmp_path / "job").outcomes
    assert {r: (o.kind, o.code, o.step) for r, o in outcomes.items()} == {
        r: ("killed", signal.SIGTERM, 3) for r in range(N)
    }


def test_a_rank_aborted_in_a_collective_leaves_its_steps_and_its_line(tmp_path):
    """Rank 1 skips step 3's all-reduce of the loss, so the ranks' next collectives do not
    match and gloo aborts a rank (SIGABRT: no Python runs, no outcome.json). Every step it
    made is on disk, and faulthandler's stack names the line it died in."""
    cmd = [*TORCHRUN, "-m", "dtlab.run", "--run-dir", "job",
           str(SCRIPTS / "batch_faults.py"), "--skip-rank", "1", "--at", "3"]  # fmt: skip
    proc = start(cmd, tmp_path)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        stop(proc)
    assert proc.returncode != 0, err[-3000:]
    said = doctor(tmp_path / "job")
    assert said.returncode == 1, said.stdout + said.stderr
    out = said.stdout
    died = [text for text in out.splitlines() if "died of a fatal signal" in text]
    assert died and all("(Fatal Python error: Aborted)" in text for text in died), out
    lines = {line_of("dist.all_reduce(mean)"), line_of("loss.backward()")}
    shown = {int(n) for n in re.findall(r'batch_faults.py", line (\d+) in <module>', out)}
    assert shown and shown <= lines, out  # in the collectives that did not match
    steps = steps_of(Trace.load(tmp_path / "job"))
    assert all(steps[r][:3] == [1, 2, 3] for r in range(N)), steps  # none lost to the abort


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

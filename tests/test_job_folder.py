"""A job folder as ``-m dtlab.run`` writes it, rank by rank, read back whole (no process
launched but the CLI's): the rank writer, torn-safe appends, parts, the reader, the
command line's verdicts and exit codes, dtlab.run's command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from dtlab import cli
from dtlab.agent import rank_folder as rf
from dtlab.records import job_folder as jf
from dtlab.records import run_folder
from dtlab.records.step_files import StepFiles
from dtlab.records.trace import Trace
from tests.fakes import job_info, rank_info, step_record

ROOT = Path(__file__).resolve().parent.parent


def write_job(folder: Path, ranks: int = 2, steps: int = 5, **outcome) -> None:
    jf.write_json(folder / jf.JOB_FILE, {"format": jf.FORMAT, "created": 1.0, "world_size": ranks})
    for rank in range(ranks):
        writer = rf.RankFolder(jf.rank_folder(folder, rank), rank)
        meta = {"rank_info": dataclasses.asdict(rank_info(rank)), "num_cpus": 2}
        writer.open(job_info(rank), meta, 1.0)
        for step in range(1, steps + 1):
            writer.add(step_record(step, rank))
        assert writer.flush()
        writer.write_outcome({"kind": "finished", "code": 0, "step": steps, **outcome})


def test_every_rank_folder_reads_back_as_one_trace(tmp_path):
    write_job(tmp_path, ranks=3, steps=7)
    assert jf.is_job_folder(tmp_path)
    trace = Trace.load(tmp_path)
    assert trace.ranks == (0, 1, 2)
    assert {r: [rec.step for rec in recs] for r, recs in trace.records.items()} == {
        r: list(range(1, 8)) for r in range(3)
    }
    job = jf.read_job(tmp_path)
    assert set(job.ranks) == {0, 1, 2} and job.cores_by_host
    assert {o.kind for o in job.outcomes.values()} == {"finished"}
    evidence = job.evidence(trace)
    assert set(evidence.ranks) == {0, 1, 2} and evidence.names == trace.param_names


def test_each_step_is_on_disk_when_its_record_is_handed_over(tmp_path):
    """No flush between steps: a rank killed by any signal (kill -9, an abort in gloo)
    leaves every step it made (the page cache holds the append)."""
    writer = rf.RankFolder(tmp_path / "rank-0", 0)
    writer.open(job_info(0), {}, 1.0)
    for step in (1, 2, 3):
        writer.add(step_record(step))
        assert [r.step for r in Trace.load(tmp_path / "rank-0").records[0]] == [*range(1, step + 1)]


def test_a_failed_append_leaves_the_journal_readable_and_the_rows_are_kept(tmp_path, monkeypatch):
    writer = rf.RankFolder(tmp_path / "rank-0", 0)
    writer.open(job_info(0), {}, 1.0)
    writer.add(step_record(1))
    assert writer.flush()
    real_open = open

    class Torn:  # writes half an entry, then the disk is full
        def __init__(self, path, mode):
            self.f = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(rf, "open", Torn, raising=False)
    writer.add(step_record(2))
    assert not writer.flush()  # said, not raised
    assert [r.step for r in Trace.load(tmp_path / "rank-0").records[0]] == [1]
    monkeypatch.undo()
    writer.add(step_record(3))
    assert writer.flush()  # the disk has room again: every row held is written
    assert [r.step for r in Trace.load(tmp_path / "rank-0").records[0]] == [1, 2, 3]


def test_a_full_journal_becomes_a_parquet_part(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "PART_ROWS", 4)
    writer = rf.RankFolder(tmp_path / "rank-0", 0)
    writer.open(job_info(0), {}, 1.0)
    for step in range(1, 11):
        writer.add(step_record(step))
        writer.flush()
    assert len(StepFiles(tmp_path / "rank-0").parts()) == 2  # 4 + 4 rows; 2 in the journal
    assert [r.step for r in Trace.load(tmp_path).records[0]] == list(range(1, 11))


def test_a_rank_holds_only_a_flushs_rows_in_memory_however_long_the_journal(tmp_path):
    """A job runs for days: what the journal holds stays on disk, not also in the rank's
    memory (which the doctor would see as rss growing on every rank, a leak of dtlab's)."""
    writer = rf.RankFolder(tmp_path / "rank-0", 0)
    writer.open(job_info(0), {}, 1.0)
    steps = iter(range(1, 100_000))

    def flushes(n: int) -> None:
        for _ in range(n):
            for _ in range(20):
                writer.add(step_record(next(steps)))
            assert writer.flush()

    flushes(20)  # warm: the first steps' whole records, the journal's file
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        flushes(200)  # 4,000 rows: about 1.8 MB of packed rows, were they held
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100_000, f"the rank writer kept {grown} bytes over 4,000 rows"
    assert len(Trace.load(tmp_path).records[0]) == 4_400


def test_a_rank_without_its_first_step_is_left_out_and_said(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=3)
    jf.write_json(tmp_path / jf.JOB_FILE, {"format": jf.FORMAT, "created": 1.0, "world_size": 3})
    trace = Trace.load(tmp_path)
    assert trace.ranks == (0, 1)
    assert jf.read_job(tmp_path).missing == [2]
    assert cli.doctor(str(tmp_path)) == cli.CLEAN
    assert "no step recorded by rank(s) 2" in capsys.readouterr().out


def test_a_failed_rank_is_a_finding_with_its_traceback(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=3)
    failed = {"kind": "failed", "step": 3, "ename": "RuntimeError", "evalue": "planted",
              "traceback": "Traceback (most recent call last):\n  File x\nRuntimeError: planted",
              "time": 5.0}  # fmt: skip
    jf.write_json(jf.rank_folder(tmp_path, 1) / jf.OUTCOME_FILE, {"rank": 1, **failed})
    assert cli.doctor(str(tmp_path)) == cli.FOUND
    out = capsys.readouterr().out
    assert "rank 1 failed at step 3: RuntimeError: planted" in out
    assert "steps 1-3 recorded on every rank" in out


def test_a_hang_report_is_a_finding_until_the_rank_steps_again(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=3)
    folder = jf.rank_folder(tmp_path, 1)
    jf.write_json(folder / jf.HANG_FILE, {"step": 3, "since": 1.0, "timeout_s": 5.0})
    (folder / jf.STACKS_FILE).write_text(
        "rank 1: no step\nCurrent thread 0x1 (most recent call first):\n  File w\n\n"
        'Thread 0x2 (most recent call first):\n  File "train.py", line 9 in <module>\n'
    )
    assert cli.doctor(str(tmp_path)) == cli.FOUND
    out = capsys.readouterr().out
    assert "rank 1 made no step for 5 s after step 3" in out
    assert 'File "train.py", line 9' in out and "File w" not in out
    jf.write_json(folder / jf.HANG_FILE, {"step": 3, "since": 1.0, "timeout_s": 5.0, "resumed": 4})
    assert cli.doctor(str(tmp_path)) == cli.CLEAN
    assert "slow, not hung" in capsys.readouterr().out


def call(seq: int, op: str, done: bool, sizes=((161,),)) -> dict:
    dtypes = ["Float"] if sizes else []
    where = {"group": "default_pg", "group_id": "0", "members": [0, 1]}
    return {**where, "seq": seq, "op": op, "sizes": sizes, "dtypes": dtypes, "done": done}


def hang_report(folder: Path, rank: int, line: tuple, calls: list[dict]) -> None:
    stack = [["/x/dtlab/agent/script.py", 226, "_main", "exec(code)"], ["/j/train.py", *line]]
    jf.write_json(
        jf.rank_folder(folder, rank) / jf.HANG_FILE,
        {"step": 3, "since": 1.0, "timeout_s": 5.0, "stack": stack, "collectives": calls},
    )


def test_the_hang_verdict_puts_the_ranks_last_collectives_side_by_side(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=3)
    for rank in (0, 1):
        (jf.rank_folder(tmp_path, rank) / jf.OUTCOME_FILE).unlink()  # still running
    done = [call(7, "all_reduce", True), call(8, "all_reduce", True)]
    hang_report(
        tmp_path, 0, (50, "<module>", "loss.backward()"), [*done, call(9, "all_reduce", False)]
    )
    hang_report(tmp_path, 1, (57, "<module>", "time.sleep(1)"), done)
    assert cli.doctor(str(tmp_path)) == cli.FOUND
    out = capsys.readouterr().out
    assert (
        "hung: rank 0 is in all_reduce #9 on default_pg (the default group: DDP gradients and "
        "your collectives); rank 1 never entered it: rank 1 in `<module>` (train.py:57: "
        "time.sleep(1))"
    ) in out
    # the same number, not the same op: rank 1 waits in the closing barrier instead
    hang_report(
        tmp_path, 1, (68, "<module>", "dist.barrier()"), [*done, call(9, "barrier", False, ())]
    )
    cli.doctor(str(tmp_path))
    out = capsys.readouterr().out
    assert (
        "hung: mismatched collective #9 on default_pg: rank 0 passed all_reduce [161] (Float); "
        "rank 1 passed barrier []; "
    ) in out
    assert "    rank 1 in `<module>` (train.py:68: dist.barrier())" in out
    assert cli.report(str(tmp_path)) == cli.CLEAN  # written; the report says it too
    page = (tmp_path / "report.html").read_text()
    assert "hung: mismatched collective #9 on default_pg" in page
    # a rank that stepped on since is not hung: no verdict of it
    jf.write_json(
        jf.rank_folder(tmp_path, 1) / jf.HANG_FILE,
        {"step": 3, "since": 1.0, "timeout_s": 5.0, "resumed": 4},
    )
    cli.doctor(str(tmp_path))
    assert "mismatched" not in capsys.readouterr().out


@pytest.mark.parametrize("stack", [5, [["f.py"]], [[1, "x", "y", "z"]], "abc"])
def test_a_hostile_hang_report_is_a_clear_error(tmp_path, stack, capsys):
    write_job(tmp_path, ranks=1, steps=2)
    path = jf.rank_folder(tmp_path, 0) / jf.HANG_FILE
    jf.write_json(path, {"step": 2, "since": 1.0, "timeout_s": 5.0, "stack": stack})
    assert cli.doctor(str(tmp_path)) == cli.UNREADABLE
    assert f"{path}: its stack or collectives are not a rank's" in capsys.readouterr().err


def test_a_rank_gone_by_a_fatal_signal_shows_where_its_script_was(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=3)
    folder = jf.rank_folder(tmp_path, 0)
    (folder / jf.OUTCOME_FILE).unlink()
    (folder / jf.FATAL_FILE).write_text(
        "Fatal Python error: Aborted\n\nThread 0x2 (most recent call first):\n  File w\n\n"
        'Current thread 0x1 (most recent call first):\n  File "train.py", line 55 in <module>'
        "\n\nExtension modules: numpy, torch._C (total: 2)\n"
    )
    (jf.rank_folder(tmp_path, 1) / jf.FATAL_FILE).write_text("")  # none came: nothing said
    assert cli.doctor(str(tmp_path)) == cli.FOUND
    out = capsys.readouterr().out
    assert (
        "rank 0: died of a fatal signal (Fatal Python error: Aborted) where its script was" in out
    )
    assert 'File "train.py", line 55 in <module>' in out
    assert "File w" not in out and "Extension modules" not in out
    assert "rank 1 finished at step 3" in out


def bad_header(folder: Path, text: str) -> None:
    (folder / "rank-0").mkdir(parents=True)
    (folder / "rank-0" / "trace.json").write_text(text)


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: None, "no such folder"),
        (lambda p: p.mkdir(), "not a dtlab run folder"),
        (lambda p: p.write_text("x"), "not a folder"),
        (lambda p: (p.mkdir(), (p / "job.json").write_bytes(b"\xff\x00")), "job.json: not JSON"),
        (lambda p: bad_header(p, "[]"), "rank-0/trace.json"),
    ],
)  # fmt: skip
def test_what_is_not_a_run_folder_exits_2_with_one_clear_line(tmp_path, make, said):
    folder = tmp_path / "run"
    make(folder)
    done = subprocess.run(
        [sys.executable, "-m", "dtlab", "doctor", str(folder)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and str(folder) in lines[0], done.stderr


def test_the_report_is_written_into_the_folder(tmp_path, capsys):
    write_job(tmp_path, ranks=2, steps=4)
    assert cli.report(str(tmp_path)) == cli.CLEAN
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "report.html" and "<html>" in path.read_text()


def test_the_run_command_line():
    from dtlab.run import UsageError, parse

    options = parse(["--run-dir", "d", "--no-record", "train.py", "--lr", "3", "--no-record"])
    assert (options.script, options.argv, options.run_dir, options.record) == (
        "train.py", ["--lr", "3", "--no-record"], "d", False,
    )  # fmt: skip
    # the deepspeed launcher's --local_rank goes to the script first, as it passes it
    options = parse(["--local_rank=1", "--hang-timeout=0", "train.py", "--deepspeed"])
    assert options.argv == ["--local_rank=1", "--deepspeed"] and options.hang_timeout_s == 0
    assert parse(["--", "-weird.py"]).script == "-weird.py"
    for bad in ([], ["--bogus", "t.py"], ["--hang-timeout", "soon", "t.py"], ["--run-dir"]):
        with pytest.raises(UsageError):
            parse(bad)


def test_a_run_dir_holding_an_earlier_jobs_records_is_refused(tmp_path):
    write_job(tmp_path, ranks=1, steps=2)
    script = tmp_path / "t.py"
    script.write_text("print('ran')\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "dtlab.run", "--run-dir", str(tmp_path), str(script)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "already holds rank 0's records" in done.stderr
    assert "ran" not in done.stdout
    assert json.loads((tmp_path / "rank-0" / "outcome.json").read_text())["kind"] == "finished"


def test_the_first_steps_whole_records_let_the_doctor_name_the_parameter(tmp_path):
    write_job(tmp_path, ranks=2, steps=12)
    job = jf.read_job(tmp_path)
    assert {r: [rec.step for rec in recs] for r, recs in job.details.items()} == {
        r: list(range(1, rf.DETAIL_STEPS + 1)) for r in range(2)
    }
    assert all(rec.detailed for recs in job.details.values() for rec in recs)
    # rank 1's second parameter drifts from step 3: named by name, not only by step
    drifted = tmp_path / "drift"
    drifted.mkdir()
    jf.write_json(drifted / jf.JOB_FILE, {"format": jf.FORMAT, "created": 1.0, "world_size": 2})
    for rank in range(2):
        writer = rf.RankFolder(jf.rank_folder(drifted, rank), rank)
        writer.open(job_info(rank), {}, 1.0)
        for step in range(1, 6):
            rec = step_record(step, rank)
            if rank == 1 and step >= 3:
                prints = list(rec.param_fingerprints)
                prints[1] += 7
                rec = step_record(step, rank, param_fingerprints=tuple(prints))
            writer.add(rec)
        writer.flush()
    found = [f for f in cli.checks_of(cli.load(str(drifted))) for f in f.findings]
    [divergence] = [f for f in found if f.kind == "divergence"]
    assert divergence.step == 3  # (two ranks: no majority to single one out)
    assert f"from step 3: {job_info(0).params[1].name} splits rank 0 | rank 1" in (
        divergence.summary
    )


def test_the_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert "[project.scripts]\n" in text and 'dtlab = "dtlab.cli:main"' in text
    script = Path(sys.executable).parent / "dtlab"
    if not script.exists():
        pytest.skip("dtlab is not installed with its console script here (pip install -e .)")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "doctor" in done.stdout and "report" in done.stdout

"""A run folder on a disk that fills (issue 39, item 1): a real small tmpfs, mounted as
root (skipped with the reason where the test cannot mount one). Steps go on with one
warning, the doctor's results are kept, writing resumes once space is back, and every step
said to be written loads afterwards; a new trace starts after the old one's close."""

from __future__ import annotations

import contextlib
import os
import subprocess
import warnings
from pathlib import Path

import pytest

from dtlab.control.run_folder_writer import FolderWriter
from dtlab.records.packed import pack
from dtlab.records.trace import Trace
from tests.fakes import job_info, step_record

RANKS = 2


@contextlib.contextmanager
def small_disk(where: Path, size: str = "400k"):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], timeout=30, check=False)


def feed(trace: Trace, start: int, count: int) -> None:
    for rank in range(RANKS):
        recs = [step_record(s, rank).summary() for s in range(start, start + count)]
        trace.add_packed(rank, pack(rank, recs).to_bytes())
    trace.flush()


def test_a_full_disk_loses_no_step_and_stops_nothing(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        folder = disk / "run"
        trace = Trace({r: job_info(r) for r in range(RANKS)}, sink=FolderWriter(folder), window=0)
        filler = disk / "filler"
        with open(filler, "wb") as out:  # leave a little room
            out.write(b"\0" * (300 * 1024))
        step = 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while trace._sink.all_on_disk and step < 20_000:  # noqa: SLF001
                feed(trace, step, 10)
                step += 10
            assert not trace._sink.all_on_disk, "the disk never filled"  # noqa: SLF001
            for _ in range(5):  # steps go on, warned once
                feed(trace, step, 10)
                step += 10
            trace.keep_checks([])  # doctor.json cannot be written: a warning, not a raise
        full = [w for w in caught if "could not write" in str(w.message)]
        assert len(full) == 1, [str(w.message) for w in caught]
        assert str(folder) in str(full[0].message) and "free:" in str(full[0].message)
        assert trace.last_step == step - 1
        filler.unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            feed(trace, step, 10)
            step += 10
        assert any("writing again" in str(w.message) for w in caught)
        assert trace._sink.all_on_disk  # noqa: SLF001
        trace.close()
        loaded = Trace.load(folder)
        assert loaded.last_step == step - 1
        for rank in range(RANKS):
            assert [r.step for r in loaded.records[rank]] == list(range(1, step))
        # a new trace starts
        Trace({r: job_info(r) for r in range(RANKS)}, sink=FolderWriter(tmp_path / "new"))


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_live_session_steps_through_a_full_disk(tmp_path, monkeypatch, live2):
    """The demo on 2 live ranks with its run folder on a 400 KiB tmpfs: it steps on once
    the disk is full (one warning), the doctor and a report elsewhere work meanwhile,
    writing resumes once space is back, every step loads, and a new job starts."""
    from dtlab import demo

    dt = live2
    with small_disk(tmp_path / "disk") as disk:
        monkeypatch.setenv("DTLAB_RUNS_DIR", str(disk))
        demo.attach(dt)
        dt.step(1)
        trace = dt.trace
        assert trace.folder is not None and disk in trace.folder.parents
        filler = disk / "filler"
        with open(filler, "wb") as out:
            out.write(b"\0" * (360 * 1024))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(200):
                dt.step(20)
                if not trace._sink.all_on_disk:  # noqa: SLF001
                    break
            assert not trace._sink.all_on_disk, "the disk never filled"  # noqa: SLF001
            dt.step(20)
            dt.doctor()
            report = dt.report(path=tmp_path / "report.html")
        assert Path(report).exists()
        full = [w for w in caught if "could not write" in str(w.message)]
        assert len(full) == 1, [str(w.message) for w in caught]
        filler.unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dt.step(5)
        assert any("writing again" in str(w.message) for w in caught)
        last = trace.last_step
        folder = trace.folder
        trace.close()
        loaded = Trace.load(folder)
        assert loaded.last_step == last
        assert [r.step for r in loaded.records[0]] == list(range(1, last + 1))
        monkeypatch.setenv("DTLAB_RUNS_DIR", str(tmp_path / "runs"))
        demo.attach(dt)  # a new job, a new trace
        dt.step(2)
        assert dt.trace is not trace and dt.trace.last_step == 2

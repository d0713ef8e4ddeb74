"""A second notebook reads a run folder while the one running the job writes it.

The writer is a real process writing a real Trace (small parts, merged two at a time, so
parts are merged away and journals sealed and turned into parts all the time); this
process loads the folder over and over meanwhile. Every load must hold each rank's steps
from 1 without a gap, and never fewer than the load before it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtlab.records.step_files import StepFiles
from dtlab.records.trace import Trace

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
STEPS = 600

WRITER = f"""
import sys
from pathlib import Path
from dtlab.control.run_folder_writer import FolderWriter
from dtlab.records import run_folder, step_files
from dtlab.records.trace import Trace
from tests.fakes import job_info, step_record

run_folder.PART_ROWS = 3 * {RANKS}  # a part every 3 steps
step_files.MERGE_AT = 2  # and merges all the time
jobs = {{r: job_info(r) for r in range({RANKS})}}
trace = Trace(jobs, sink=FolderWriter(Path(sys.argv[1])), window=0)
for step in range(1, {STEPS} + 1):
    for rank in range({RANKS}):
        trace.add(rank, [step_record(step, rank)])
    trace.flush()  # the end of a run of one step: the journal, and a part every third
    if step == 30:
        (Path(sys.argv[1]) / "started").touch()
trace.close()
"""


@pytest.mark.timeout(120)
def test_a_folder_read_while_its_notebook_writes_it_has_no_gap(tmp_path):
    folder = tmp_path / "run"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "started").exists():
            assert writer.poll() is None, "the writer stopped before its 30th step"
            assert time.monotonic() < deadline, "the writer wrote no 30 steps in 60 s"
            time.sleep(0.01)
        loads, before, with_parts = 0, 0, 0
        while writer.poll() is None:
            with_parts += bool(StepFiles(folder).parts())
            trace = Trace.load(folder, window=0)
            for rank, recs in trace.records.items():
                steps = [rec.step for rec in recs]
                assert steps == list(range(1, len(steps) + 1)), f"rank {rank}: a gap"
            least = min(len(recs) for recs in trace.records.values())
            assert least >= before, f"load {loads}: {least} steps, {before} the load before"
            before, loads = least, loads + 1
        assert writer.wait() == 0
    finally:
        writer.kill()
        writer.wait()
    assert loads >= 3 and with_parts >= 1, f"only {loads} loads while it wrote ({with_parts})"
    final = Trace.load(folder)
    assert [len(final.records[r]) for r in range(RANKS)] == [STEPS] * RANKS

"""A run folder as an attacker or an unlucky user leaves it (issue 39, items 2, 4, 5): the
reader follows no link, waits on no FIFO, reads nothing unbounded or outside the folder,
tells a torn tail from corruption, checks part names, and names the file and the field of
a malformed header. Each case ends within seconds in a clear error or a correct result."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from dtlab.control.run_folder_writer import FolderWriter
from dtlab.records import run_folder
from dtlab.records.step_files import StepFiles
from dtlab.records.trace import Trace
from tests.fakes import job_info, step_record

pytestmark = pytest.mark.timeout(60)


def made(folder: Path, steps: int = 6, *, part: bool = False) -> Trace:
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(folder))
    for step in range(1, steps + 1):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    if part:
        trace.close()
    return trace


def test_a_journal_linked_to_dev_zero_or_a_fifo_is_refused(tmp_path):
    folder = tmp_path / "run"
    made(folder)
    sealed = folder / "steps" / run_folder.SEALED.format(1)
    sealed.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="link"):
        Trace.load(folder)
    sealed.unlink()
    os.mkfifo(sealed)
    with pytest.raises(ValueError, match="FIFO|fifo"):
        Trace.load(folder)


def test_files_linked_outside_are_not_opened(tmp_path):
    outside = tmp_path / "outside"
    os.mkfifo(outside)  # opening it for reading would block
    for name in ("trace.json", "steps/journal.bin"):
        folder = tmp_path / name.replace("/", "_")
        made(folder)
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
        with pytest.raises(ValueError, match="link"):
            Trace.load(folder)
    folder = tmp_path / "parts"
    made(folder, part=True)
    (part,) = StepFiles(folder).parts()
    part[3].unlink()
    part[3].symlink_to(outside)
    with pytest.raises(ValueError, match="link"):
        Trace.load(folder)


def test_steps_as_a_link_is_refused_not_no_steps(tmp_path):
    folder = tmp_path / "run"
    made(folder, part=True)
    other = tmp_path / "other"
    shutil.move(folder / "steps", other)
    (folder / "steps").symlink_to(other)
    with pytest.raises(ValueError, match="steps is a link"):
        Trace.load(folder)


def test_a_torn_tail_is_dropped_with_a_word(tmp_path):
    folder = tmp_path / "run"
    made(folder)
    journal = folder / "steps" / run_folder.JOURNAL
    journal.write_bytes(journal.read_bytes()[:-7])
    with pytest.warns(RuntimeWarning, match="torn last entry"):
        loaded = Trace.load(folder)
    assert loaded.last_step == 5


def test_a_part_whose_name_overstates_its_rows_is_named(tmp_path):
    folder = tmp_path / "run"
    made(folder, part=True)
    (part,) = StepFiles(folder).parts()
    lying = part[3].with_name(f"L0-000000000000-{part[2] + 60}.parquet")
    part[3].rename(lying)
    with pytest.raises(ValueError, match=lying.name):
        Trace.load(folder)


def header_of(folder: Path) -> dict:
    return json.loads((folder / "trace.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda h: b"\xff\xfe\x00binary", "trace.json"),
        (lambda h: json.dumps([1, 2]).encode(), "list"),
        (lambda h: json.dumps({k: v for k, v in h.items() if k != "jobs"}).encode(), "jobs"),
        (lambda h: json.dumps({**h, "jobs": {"0": {**h["jobs"]["0"], "odd": 1}}}).encode(), "odd"),
        (lambda h: ("[" * 100_000 + "]" * 100_000).encode(), "trace.json"),
        (
            lambda h: json.dumps(
                {**h, "jobs": {str(r): h["jobs"]["0"] for r in range(200_000)}}
            ).encode(),
            "200000 ranks",
        ),
    ],
)
def test_a_malformed_header_names_the_file_and_field(tmp_path, change, field):
    folder = tmp_path / "run"
    made(folder)
    (folder / "trace.json").write_bytes(change(header_of(folder)))
    with pytest.raises(ValueError, match=field) as caught:
        Trace.load(folder)
    assert "trace.json" in str(caught.value)


def test_a_bad_doctor_json_leaves_the_trace_loadable(tmp_path):
    folder = tmp_path / "run"
    made(folder)
    (folder / "doctor.json").write_bytes(b'[{"name": 1, "nonsense": {}}]')
    with pytest.warns(RuntimeWarning, match="doctor.json"):
        loaded = Trace.load(folder)
    assert loaded.last_step == 6 and loaded.checks == []


def test_fuzzed_run_folders_end_in_a_clear_error_or_a_trace(tmp_path):
    """Seeded: bytes of every file of a real folder flipped, cut or grown; each load is a
    Trace or a ValueError (a warning at most), never another exception or a hang."""
    base = tmp_path / "base"
    made(base, steps=8)
    files = [p for p in base.rglob("*") if p.is_file()]
    rng = random.Random(39)
    for case in range(60):
        folder = tmp_path / f"case{case}"
        shutil.copytree(base, folder)
        target = folder / rng.choice(files).relative_to(base)
        data = bytearray(target.read_bytes())
        how = rng.choice(("flip", "cut", "grow"))
        if how == "flip" and data:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == "cut":
            data = data[: rng.randrange(len(data) + 1)]
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        target.write_bytes(bytes(data))
        try:
            Trace.load(folder)
        except ValueError:
            pass

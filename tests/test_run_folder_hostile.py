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
    whole = journal.read_bytes()
    last = run_folder.journal_entries(journal)[-1][0]
    for cut in (7, len(whole) - last - 5):  # the last batch cut short; its header cut short
        journal.write_bytes(whole[:-cut])
        with pytest.warns(RuntimeWarning, match=f"byte {last}: a torn last entry") as said:
            loaded = Trace.load(folder)
        assert str(journal) in str(said[0].message) and "the 11 entries before it" in str(
            said[0].message
        )
        assert steps_loaded(loaded) == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5]}
    # appended, never on disk (a crash on a file system that zero-fills): torn too
    journal.write_bytes(whole[:last] + bytes(len(whole) - last))
    with pytest.warns(RuntimeWarning, match="zeros"):
        assert steps_loaded(Trace.load(folder)) == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5]}


def entry_starts(journal: Path) -> list[int]:
    return [at for at, _ in run_folder.journal_entries(journal)]


def steps_loaded(trace: Trace) -> dict[int, list[int]]:
    return {rank: [r.step for r in recs] for rank, recs in trace.records.items()}


@pytest.mark.parametrize("where", ["head", "middle"])
def test_a_garbage_length_is_corruption_not_a_torn_tail(tmp_path, where):
    """Format 3 took a garbage length for a torn tail and dropped every entry after it
    with a warning; now the header's checksum names it, and salvage reads what is intact."""
    folder = tmp_path / "run"
    made(folder)  # 6 steps x 2 ranks: 12 entries
    journal = folder / "steps" / run_folder.JOURNAL
    starts = entry_starts(journal)
    at = starts[0] if where == "head" else starts[5]
    data = bytearray(journal.read_bytes())
    data[at : at + 4] = (0x7FFFFFFF).to_bytes(4, "little")
    journal.write_bytes(bytes(data))
    with pytest.raises(run_folder.CorruptJournal) as caught:
        Trace.load(folder)
    message = str(caught.value)
    assert str(journal) in message and f"byte {at}:" in message
    assert "header whose checksum fails" in message and "2147483647 bytes follow" in message
    intact = starts.index(at)
    assert caught.value.intact == intact and "salvage=True" in message
    assert ("no entry before" if intact == 0 else f"the {intact} entries before") in message
    assert isinstance(caught.value, ValueError)  # what every caller of Trace.load catches
    with pytest.warns(RuntimeWarning, match=f"SALVAGED {journal}: byte {at}") as said:
        salvaged = Trace.load(folder, salvage=True)
    assert "LEFT OUT" in str(said[0].message)
    expected = {0: [1, 2, 3], 1: [1, 2]} if where == "middle" else {0: [], 1: []}
    assert steps_loaded(salvaged) == expected


def test_a_flipped_byte_inside_an_entry_is_named_not_read(tmp_path):
    folder = tmp_path / "run"
    trace = made(folder)
    journal = folder / "steps" / run_folder.JOURNAL
    starts = entry_starts(journal)
    data = bytearray(journal.read_bytes())
    data[starts[7] + run_folder.ENTRY_HEADER + 40] ^= 0x01  # one bit of a row's numbers
    journal.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"byte {starts[7]}: its \\d+-byte batch's checksum"):
        Trace.load(folder)  # format 3 loaded it, one value silently wrong
    with pytest.warns(RuntimeWarning, match="SALVAGED"):
        salvaged = Trace.load(folder, salvage=True)
    assert steps_loaded(salvaged) == {0: [1, 2, 3, 4], 1: [1, 2, 3]}  # entries 0-6
    assert salvaged.records[0][2] == trace.records[0][2]


def test_a_corrupt_sealed_journal_is_named_and_salvage_reads_the_other_journal(
    tmp_path, monkeypatch
):
    folder = tmp_path / "run"
    trace = made(folder)
    steps = folder / "steps"
    sealed = steps / run_folder.SEALED.format(1)
    (steps / run_folder.JOURNAL).rename(sealed)  # as a part being written leaves it
    trace.add(0, [step_record(7, 0)])
    trace.add(1, [step_record(7, 1)])
    trace.flush()  # a new journal: step 7
    data = bytearray(sealed.read_bytes())
    data[entry_starts(sealed)[2] + 20] ^= 0xFF
    sealed.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=sealed.name):
        Trace.load(folder)
    with pytest.warns(RuntimeWarning, match=sealed.name):
        salvaged = Trace.load(folder, salvage=True)
    assert steps_loaded(salvaged) == {0: [1, 7], 1: [1, 7]}


def test_a_corrupt_journal_of_a_batch_job_is_named_with_its_rank_folder(tmp_path):
    from dtlab.agent import rank_folder as rf

    writer = rf.RankFolder(tmp_path / "rank-0", 0)
    writer.open(job_info(0), {}, 1.0)
    for step in (1, 2, 3):
        writer.add(step_record(step))
        writer.flush()
    assert json.loads((tmp_path / "rank-0" / "trace.json").read_text())["format"] == (
        run_folder.FORMAT
    )
    journal = writer.journal
    data = bytearray(journal.read_bytes())
    data[entry_starts(journal)[1] + 1] ^= 0x10  # the second entry's length
    journal.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rank-0/steps/journal.bin: byte \\d+: an entry header"):
        Trace.load(tmp_path)
    with pytest.warns(RuntimeWarning, match="SALVAGED"):
        assert steps_loaded(Trace.load(tmp_path, salvage=True)) == {0: [1]}


def test_the_cli_names_the_corruption_and_salvages_on_request(tmp_path, capsys):
    from dtlab import cli

    folder = tmp_path / "run"
    made(folder)
    journal = folder / "steps" / run_folder.JOURNAL
    data = bytearray(journal.read_bytes())
    data[entry_starts(journal)[4]] ^= 0x01
    journal.write_bytes(bytes(data))
    assert cli.main(["doctor", str(folder)]) == cli.UNREADABLE
    assert "--salvage" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning, match="SALVAGED"):
        assert cli.main(["doctor", str(folder), "--salvage"]) != cli.UNREADABLE


def format_3(folder: Path) -> None:
    """Turn a folder this dtlab wrote into one as format 3 wrote it: each journal entry
    only its length, then its batch (the writer before checksums), and the header's
    format "dtlab-trace/3"."""
    for journal in [*folder.glob("steps/journal*.bin")]:
        batches = [data for _, data in run_folder.journal_entries(journal)]
        journal.write_bytes(b"".join(len(d).to_bytes(4, "little") + d for d in batches))
    header = header_of(folder)
    (folder / "trace.json").write_text(json.dumps({**header, "format": "dtlab-trace/3"}))


def test_a_format_3_folder_still_loads_and_reads_back_old_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "PART_ROWS", 8)
    folder = tmp_path / "run"
    trace = made(folder, steps=6)  # a part of steps 1-4, steps 5-6 in the journal
    trace.sync()
    assert StepFiles(folder).parts() and (folder / "steps" / run_folder.JOURNAL).exists()
    format_3(folder)
    loaded = Trace.load(folder, window=2)
    assert loaded.records[0].last_step == 6 and loaded.first_step > 1  # the window slid
    assert steps_loaded(loaded.read_steps(range(1, 7))) == {0: list(range(1, 7)), 1: [*range(1, 7)]}
    # a format 3 journal has no checksum: a cut, or a garbage length, is a torn tail, said
    journal = folder / "steps" / run_folder.JOURNAL
    journal.write_bytes(journal.read_bytes()[:-3])
    with pytest.warns(RuntimeWarning, match="torn last entry.*format 3 journals carry no checksum"):
        assert steps_loaded(Trace.load(folder)) == {0: list(range(1, 7)), 1: [1, 2, 3, 4, 5]}


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

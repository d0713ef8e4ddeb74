"""Pure pieces of stepping: --until conditions, the step-record codec, Trace files."""

import dataclasses
import json
import math
from dataclasses import replace

import pytest

from dtlab.agent.stepping import _RunState
from dtlab.analysis.conditions import condition_holds, describe_condition, parse_condition
from dtlab.control.run_folder_writer import FolderWriter
from dtlab.records import Condition, run_folder, step_record_from_dict, step_record_to_dict
from dtlab.records.packed import pack
from dtlab.records.run_folder import FORMAT, JOURNAL, new_run_folder
from dtlab.records.step_files import MERGE_AT, StepFiles
from dtlab.records.trace import Trace
from tests.fakes import healthy_trace, job_info, step_record


@pytest.mark.parametrize(
    "text, expected",
    [
        ("step>=200", Condition("step", 200.0)),
        (" loss > 4.5 ", Condition("loss_above", 4.5)),
        ("loss<1e-2", Condition("loss_below", 0.01)),
        ("NonFinite", Condition("nonfinite")),
        ("diverged", Condition("diverged")),
    ],
)
def test_conditions_parse_and_read_back(text, expected):
    assert parse_condition(text) == expected
    assert parse_condition(describe_condition(expected)) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("loss=3", "cannot read the condition 'loss=3'; write one of: step>=N"),
        ("step>=2.5", "whole number of steps"),
        ("step>=0", "whole number of steps"),
        ("loss>abc", "cannot read"),
        ("loss>1.2.3", "is not a number"),
        ("", "cannot read"),
    ],
)
def test_bad_conditions_say_what_is_understood(text, message):
    with pytest.raises(ValueError, match=message):
        parse_condition(text)


def test_conditions_hold_on_the_records_they_describe():
    rec = step_record(5, loss=3.0)
    assert condition_holds(Condition("step", 5), rec)
    assert not condition_holds(Condition("step", 6), rec)
    assert condition_holds(Condition("loss_above", 2.5), rec)
    assert not condition_holds(Condition("loss_below", 2.5), rec)
    assert not condition_holds(Condition("nonfinite"), rec)
    assert condition_holds(Condition("nonfinite"), replace(rec, loss=math.nan))
    assert condition_holds(Condition("nonfinite"), step_record(5, nonfinite=(0, 3, 0, 0)))
    assert not condition_holds(Condition("diverged"), rec)  # decided across ranks
    assert not condition_holds(None, rec)


def test_step_records_survive_the_json_codec():
    rec = step_record(7, rank=2, lr=None, missing_grads=(1,))
    line = json.dumps(step_record_to_dict(2, rec))
    assert step_record_from_dict(json.loads(line)) == (2, rec)


def test_trace_keeps_steps_in_order_and_answers_by_step():
    trace = healthy_trace(num_ranks=3, num_steps=4)
    trace.add(1, [step_record(2, 1, loss=99.0)])  # a repeated step is ignored
    assert trace.at(2)[1].loss == 1.0 and trace.last_step == 4 and len(trace) == 12
    trace.add(0, [step_record(5, 0)])
    assert trace.last_step == 4  # rank 0 alone at step 5: not every rank has it
    assert sorted(trace.at(5)) == [0] and trace.at(9) == {}
    assert trace.param_names[0] == "embed.weight"


def test_trace_folder_round_trip_and_dataframe(tmp_path):
    folder = new_run_folder(tmp_path)
    assert folder.parent == tmp_path and new_run_folder(tmp_path) != folder
    trace = Trace(
        {r: job_info(r) for r in range(2)}, sink=FolderWriter(folder), meta={"backend": "gloo"}
    )
    trace.add(0, [step_record(1, 0), step_record(2, 0)])
    trace.add_packed(1, pack(1, [step_record(1, 1)]).to_bytes())
    with pytest.raises(ValueError, match="record of rank 0 arrived from rank 1"):
        trace.add_packed(1, pack(0, [step_record(3, 0)]).to_bytes())
    trace.flush()
    loaded = Trace.load(folder)
    assert loaded.records == trace.records and loaded.jobs == trace.jobs
    assert json.loads((folder / "trace.json").read_text())["format"] == FORMAT
    frame = loaded.to_dataframe()
    assert len(frame) == 3 and {"rank", "step", "loss", "times.forward", "memory.rss"} <= set(frame)
    copy = trace.save(tmp_path / "copy")
    assert Trace.load(copy).records == trace.records
    trace.close()


def format_1_folder(trace: Trace, folder):
    """A run folder as dtlab wrote them before Parquet: steps.jsonl, one record a line."""
    folder.mkdir()
    header = {"format": "dtlab-trace/1", "created": 1.0, "world_size": trace.world_size}
    header["jobs"] = {str(r): dataclasses.asdict(j) for r, j in trace.jobs.items()}
    (folder / "trace.json").write_text(json.dumps(header))
    lines = [
        json.dumps(step_record_to_dict(rank, rec))
        for rank, recs in trace.records.items()
        for rec in recs
    ]
    (folder / "steps.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_a_format_1_folder_loads_its_half_written_last_line_dropped(tmp_path):
    trace = healthy_trace(num_ranks=2, num_steps=3)
    folder = format_1_folder(trace, tmp_path / "run")
    steps = folder / "steps.jsonl"
    steps.write_text(steps.read_text() + '{"rank": 0, "step": 4, "lo')
    assert Trace.load(folder).records == trace.records
    lines = steps.read_text().splitlines()
    steps.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="steps.jsonl:2: not a step record"):
        Trace.load(folder)


def test_every_field_of_a_record_survives_the_step_files(tmp_path):
    odd = step_record(
        3,
        rank=1,
        lr=None,
        scale=65536.0,
        skipped=True,
        grad_norm=math.nan,  # a NaN norm is a finding, not "not recorded" (None)
        missing_grads=(1, 4),
        unreached=(),
        epoch_starts=(2,),
        nonfinite_module="layers.1.mlp",
        nonfinite_found="forward hook",
        rng=(("torch", 123), ("numpy", (1 << 64) - 5)),
        input_fingerprints=(7, 8),
        synced_micro_batches=1,
        comm_calls=2,
        comm_bytes=4096,
        grad_fingerprint=(1 << 64) - 1,
    )
    odd = replace(odd, memory=replace(odd.memory, cuda_allocated=2**40, cuda_peak=0))
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(tmp_path / "run"))
    trace.add(0, [step_record(s, 0) for s in (1, 2, 3)])
    trace.add(1, [step_record(1, 1), step_record(2, 1), odd])
    trace.close()
    loaded = Trace.load(tmp_path / "run").records[1][-1]
    assert math.isnan(loaded.grad_norm) and loaded.lr is None  # (nan != nan: compare the rest)
    assert replace(loaded, grad_norm=0.0) == replace(odd, grad_norm=0.0)
    assert loaded.unreached == () and loaded.memory.cuda_reserved is None


def test_many_flushes_leave_few_files_and_lose_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "PART_ROWS", 2)  # a part at every flush here
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(tmp_path / "run"))
    for step in range(1, 41):  # 40 runs of one step each: 40 parts, merged as they pile up
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    trace.sync()  # (the last part is written on a thread of its own)
    parts = StepFiles(tmp_path / "run").parts()
    assert len(parts) < MERGE_AT + 1  # 40 = 5 x 8: five level-1 parts
    assert {level for level, *_ in parts} == {1}
    assert Trace.load(tmp_path / "run").records == trace.records
    trace.close()


def test_parts_are_not_merged_past_their_largest_size(tmp_path, monkeypatch):
    """Merging rewrites every row; parts that would merge into one bigger than
    MAX_PART_ROWS stay as they are (and read back whole)."""
    from dtlab.records import step_files

    monkeypatch.setattr(run_folder, "PART_ROWS", 2)  # a part of 2 rows at every flush
    monkeypatch.setattr(step_files, "MAX_PART_ROWS", 2 * MERGE_AT)  # level 1 merges no more
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(tmp_path / "run"))
    steps = 3 * MERGE_AT * MERGE_AT
    for step in range(1, steps + 1):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    trace.sync()
    parts = StepFiles(tmp_path / "run").parts()
    assert {(level, count) for level, _, count, _ in parts} == {(1, 2 * MERGE_AT)}
    assert len(parts) == 3 * MERGE_AT
    assert Trace.load(tmp_path / "run").records == trace.records
    trace.close()


def test_a_part_too_big_to_merge_does_not_stop_the_parts_after_it_merging(tmp_path, monkeypatch):
    """One flush of more than MAX_PART_ROWS rows (a long run in one dt.step) is a part
    no merge may take; the parts written after it still merge, and all rows read back
    in order."""
    from dtlab.records import step_files

    monkeypatch.setattr(run_folder, "PART_ROWS", 2)
    monkeypatch.setattr(step_files, "MAX_PART_ROWS", 2 * MERGE_AT)
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(tmp_path / "run"))
    big = 2 * MERGE_AT  # steps: 4 x MERGE_AT rows in one flush
    for rank in range(2):
        trace.add(rank, [step_record(step, rank) for step in range(1, big + 1)])
    trace.flush()
    for step in range(big + 1, big + 1 + 2 * MERGE_AT):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    trace.sync()
    parts = StepFiles(tmp_path / "run").parts()
    assert [(level, count) for level, _, count, _ in parts] == [
        (0, 2 * big),
        (1, 2 * MERGE_AT),
        (1, 2 * MERGE_AT),
    ]
    assert Trace.load(tmp_path / "run").records == trace.records
    trace.close()


def test_a_deleted_part_is_named_as_missing_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "PART_ROWS", 2)
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(tmp_path / "run"))
    for step in range(1, 4):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    trace.close()
    parts = StepFiles(tmp_path / "run").parts()
    assert [first for _, first, _, _ in parts] == [0, 2, 4]
    parts[1][3].unlink()
    with pytest.raises(ValueError, match=r"rows 2\.\.3 are in no part file"):
        Trace.load(tmp_path / "run")


def test_runs_between_parts_are_in_the_journal_until_the_trace_closes(tmp_path):
    folder = tmp_path / "run"
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(folder))
    trace.add(0, [step_record(1, 0)])
    trace.add_packed(1, pack(1, [step_record(1, 1)]).to_bytes())
    trace.flush()  # the end of a run: two records, far from a part's worth
    journal = folder / "steps" / JOURNAL
    assert journal.is_file() and not StepFiles(folder).parts()
    assert Trace.load(folder).records == trace.records  # a notebook that died here
    trace.add(0, [step_record(2, 0)])
    trace.add(1, [step_record(2, 1)])
    trace.flush()
    assert journal_entries(journal) == 4  # a batch a rank a run
    trace.close()
    assert not journal.exists() and len(StepFiles(folder).parts()) == 1
    assert Trace.load(folder).records == trace.records


def test_a_part_written_on_its_thread_loses_nothing_if_the_notebook_stops_meanwhile(
    tmp_path, monkeypatch
):
    """Its journal is sealed before the thread writes the part: a folder left with the sealed
    journal (no part yet), or with both (the part written, the journal not yet removed),
    loads every record once; a part that cannot be written is a warning at the next flush,
    and its records stay in the sealed journal."""
    monkeypatch.setattr(run_folder, "PART_ROWS", 4)
    folder = tmp_path / "run"
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(folder))
    for step in (1, 2):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    trace.sync()
    (part,) = StepFiles(folder).parts()
    sealed = folder / "steps" / run_folder.SEALED.format(1)
    sealed.write_bytes(b"".join(run_folder.journal_entry(f.data) for f in frames_of(trace)))
    assert Trace.load(folder).records == trace.records  # both: each record once
    part[3].unlink()
    assert Trace.load(folder).records == trace.records  # the sealed journal alone
    sealed.unlink()

    def broken(self, batch) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(StepFiles, "write", broken)
    for step in (3, 4):
        for rank in range(2):
            trace.add(rank, [step_record(step, rank)])
        trace.flush()
    with pytest.warns(RuntimeWarning, match="No space left"):  # said, not raised
        trace.sync()
    assert [p.name for p in (folder / "steps").glob(run_folder.SEALED_GLOB)]  # kept
    assert [r.step for r in Trace.load(folder).records[1]] == [3, 4]  # (part 1-2 removed above)


def frames_of(trace: Trace) -> list:
    from dtlab.records.packed import pack, read_frame

    return [read_frame(pack(r, list(recs)).to_bytes(), r) for r, recs in trace.records.items()]


def journal_entries(journal) -> int:
    entries = run_folder.journal_entries(journal)
    at, last = entries[-1]
    assert at + run_folder.ENTRY_HEADER + len(last) == journal.stat().st_size
    return len(entries)


def test_a_journal_cut_off_mid_write_loses_its_last_entry_and_a_corrupt_one_is_named(tmp_path):
    folder = tmp_path / "run"
    trace = Trace({r: job_info(r) for r in range(2)}, sink=FolderWriter(folder))
    for rank in range(2):
        trace.add(rank, [step_record(1, rank), step_record(2, rank)])
    trace.flush()
    journal = folder / "steps" / JOURNAL
    whole = journal.read_bytes()
    journal.write_bytes(whole + whole[:30])  # a third entry, cut off
    assert Trace.load(folder).records == trace.records
    head = run_folder.ENTRY_HEADER
    journal.write_bytes(whole[:head] + b"XXXX" + whole[head + 4 :])  # the first batch's magic
    with pytest.raises(ValueError, match=r"journal.bin: byte 0: its \d+-byte batch's checksum"):
        Trace.load(folder)


def test_a_format_2_folder_with_its_json_journal_loads(tmp_path):
    trace = healthy_trace(num_ranks=2, num_steps=6)
    folder = tmp_path / "run"
    early = Trace(trace.jobs, sink=FolderWriter(folder))
    for rank, recs in trace.records.items():
        early.add(rank, recs[:4])
    early.close()  # a part of steps 1-4, as format 2 wrote them too
    lines = [
        json.dumps(step_record_to_dict(rank, rec))
        for rank, recs in trace.records.items()
        for rec in recs[4:]
    ]
    (folder / "steps" / "journal.jsonl").write_text("\n".join(lines) + "\n")
    header = json.loads((folder / "trace.json").read_text())
    (folder / "trace.json").write_text(json.dumps({**header, "format": "dtlab-trace/2"}))
    assert Trace.load(folder).records == trace.records


def test_a_part_cut_off_mid_write_is_ignored_and_a_corrupt_one_is_named(tmp_path):
    trace = healthy_trace(num_ranks=2, num_steps=3)
    folder = trace.save(tmp_path / "run")
    (folder / "steps" / "L0-000000000006-2.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert Trace.load(folder).records == trace.records
    (part,) = [p for p in (folder / "steps").iterdir() if p.suffix == ".parquet"]
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{part.name}: not a dtlab step file"):
        Trace.load(folder)


def test_the_dataframe_takes_a_step_range():
    frame = healthy_trace(num_ranks=2, num_steps=10).to_dataframe(steps=range(4, 7))
    assert sorted(set(frame["step"])) == [4, 5, 6] and len(frame) == 6


def test_loading_something_that_is_not_a_run_folder_says_so(tmp_path):
    with pytest.raises(ValueError, match="no trace.json"):
        Trace.load(tmp_path)
    (tmp_path / "trace.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(ValueError, match="this dtlab reads 'dtlab-trace/1' and 'dtlab-trace/2'"):
        Trace.load(tmp_path)


def run_state(steps, agree_every=1, until=None, index=0, agreed_at=-1):
    state = _RunState(7, steps, until, agree_every, 0.25)
    state.index, state.agreed_at = index, agreed_at
    return state


def agreements(state, step_s):
    """The iterations at which ``state`` agrees when every agreement says ``step_s``."""
    found = []
    for i in range(state.steps):
        if state.must_agree(i):
            found.append(i)
            state.agreed_at = i
            state.agreed(i, step_s)
    return found


def test_every_rank_agrees_at_the_same_iterations_and_a_failed_rank_finds_the_next():
    assert agreements(run_state(10, agree_every=3), step_s=0.34) == [2, 4, 6, 8]  # ~1 s apart
    assert agreements(run_state(12, agree_every=3), step_s=0.2) == [2, 7]  # never the last
    # a first run knows no step time (every step): twice as far each time, up to ~1 s apart
    assert agreements(run_state(100, agree_every=1), step_s=0.03) == [0, 2, 6, 14, 30, 62, 95]
    assert [i for i in range(4) if run_state(4, until=Condition("nonfinite")).must_agree(i)] == [
        0,
        1,
        2,
        3,
    ]
    assert run_state(10, 3, index=0).next_agreement() == 2
    assert run_state(10, 3, index=2).next_agreement() == 2  # failed before agreeing at 2
    after = run_state(10, 3, index=2, agreed_at=2)
    after.agreed(2, 0.34)
    assert after.next_agreement() == 4
    assert run_state(10, 3, index=9).next_agreement() is None  # peers finish, no agreement
    assert run_state(1, until=Condition("loss_above", 1.0)).next_agreement() == 0
    assert run_state(1).next_agreement() is None
    assert run_state(10, 3).seq(2) != run_state(10, 3).seq(5)


def _same_cell(a, b) -> bool:
    missing_a = a is None or (isinstance(a, float) and math.isnan(a))
    missing_b = b is None or (isinstance(b, float) and math.isnan(b))
    return (missing_a and missing_b) or a == b


def test_the_dataframe_made_from_columns_holds_what_every_record_holds(tmp_path):
    """Each cell of to_dataframe() (made from the rows, no record objects) equals the field
    of the record it came from, for records added as objects and as packed frames, with
    None, NaN, extras and sample indices; and after the window moved (read back)."""
    odd = step_record(
        3,
        rank=1,
        lr=None,
        grad_norm=math.nan,
        missing_grads=(1, 4),
        unreached=(),
        epoch_starts=(2,),
        nonfinite_module="layers.1.mlp",
        rng=(("torch", 123), ("numpy", (1 << 64) - 5)),
        synced_micro_batches=1,
        comm_calls=2,
        grad_fingerprint=(1 << 64) - 1,
        indices=(5, 6, 7),
    )
    odd = replace(odd, memory=replace(odd.memory, cuda_allocated=2**40))
    trace = Trace({r: job_info(r) for r in range(3)}, sink=FolderWriter(tmp_path / "run"))
    trace.add(0, [step_record(s, 0, indices=(s,)) for s in (1, 2, 3)])
    trace.add_packed(1, pack(1, [step_record(1, 1), step_record(2, 1), odd]).to_bytes())
    plain = [step_record(s, 2, nonfinite_found="x") for s in (1, 2)]
    trace.add_packed(2, pack(2, plain).to_bytes())
    trace.flush()
    for made in (trace.to_dataframe(), trace.to_dataframe(range(1, 4))):
        expected = [(rank, rec) for rank in sorted(trace.records) for rec in trace.records[rank]]
        assert len(made) == len(expected) == 8
        flat = trace.to_records()  # the record-by-record form, same order
        assert list(made.columns) == list(flat[0])
        for i, row in enumerate(flat):
            cells = made.iloc[i].to_dict()
            wrong = {k: (cells[k], v) for k, v in row.items() if not _same_cell(cells[k], v)}
            assert not wrong, (i, wrong)
    assert made["memory.cuda_allocated"].isna().sum() == 7  # None as NaN; 2**40 kept
    assert made["grad_fingerprint"].dtype == "uint64"
    trace.close()

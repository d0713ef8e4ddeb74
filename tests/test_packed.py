"""Step records as packed rows: the wire's binary frames, kept as they came in a Trace."""

import json
import math
import random
import struct
from dataclasses import replace

import numpy as np
import pytest

from dtlab.records.columns import ROW, StepColumns
from dtlab.records.packed import MAGIC, concat, pack, read_frame, unpack
from dtlab.records.trace import Trace
from tests.fakes import job_info, step_record


def odd_record(step: int, rank: int):
    """A record with every kind of field away from its default (None, nan, tuples, pairs)."""
    rec = step_record(
        step,
        rank=rank,
        lr=None,
        scale=65536.0,
        skipped=True,
        grad_norm=math.nan,
        missing_grads=(1, 4),
        unreached=(),
        epoch=2,
        epoch_starts=(2,),
        nonfinite_module="layers.1.mlp",
        nonfinite_found="forward hook",
        rng=(("torch", 123), ("numpy", (1 << 64) - 5)),
        input_fingerprints=(7, 8),
        module_outputs=(("layers.0", 5),),
        synced_micro_batches=1,
        comm_calls=2,
        comm_bytes=4096,
        grad_fingerprint=(1 << 64) - 1,
        indices=(),
    )
    return replace(rec, memory=replace(rec.memory, cuda_allocated=2**40, cuda_peak=0))


def same(a, b) -> bool:
    """Records equal, a nan equal to a nan."""

    def nan(v) -> bool:
        return isinstance(v, float) and math.isnan(v)

    names = a.__dataclass_fields__
    return all(
        getattr(a, n) == getattr(b, n) or (nan(getattr(a, n)) and nan(getattr(b, n))) for n in names
    )


def test_every_field_survives_the_frame():
    recs = [step_record(1, 3), odd_record(2, 3), step_record(3, 3, lr=math.nan)]
    batch = unpack(pack(3, recs).to_bytes(), 3)
    back = [batch.record(i) for i in range(len(recs))]
    assert all(same(a, b) for a, b in zip(back, recs, strict=True))
    assert back[1].lr is None and math.isnan(back[2].lr)  # None and nan stay apart
    assert back[1].unreached == () and back[0].unreached is None
    assert back[1].memory.cuda_reserved is None and back[1].memory.cuda_peak == 0


def test_packed_rows_fill_the_columns_as_records_do():
    recs = {r: [step_record(s, r) for s in range(1, 4)] + [odd_record(4, r)] for r in range(3)}
    by_objects = StepColumns.from_records(recs)
    trace = Trace({r: job_info(r) for r in range(3)})
    for rank in (2, 0, 1):  # arrival order does not matter
        trace.add_packed(rank, pack(rank, recs[rank][:2]).to_bytes())
        trace.add_packed(rank, pack(rank, recs[rank][1:]).to_bytes())  # step 2 again
    a, b = by_objects.rows(), trace.columns.rows()
    for name in set(a.dtype.names) - {"indices_at"}:  # where they start: arrival order
        assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), name

    def indices(columns):
        every = columns.indices()
        return [every[r["indices_at"] :][: r["num_indices"]].tolist() for r in columns.rows()]

    assert indices(by_objects) == indices(trace.columns)
    assert len(trace) == 12 and trace.last_step == 4
    assert all(same(x, y) for x, y in zip(trace.records[1], recs[1], strict=True))


def test_records_are_made_only_when_read():
    trace = Trace({0: job_info(0)})
    trace.add_packed(0, pack(0, [step_record(s, 0) for s in range(1, 101)]).to_bytes())
    mine = trace.records[0]
    assert mine._made.count(None) == 100  # the rows only
    assert mine[-1] == step_record(100, 0) and mine[49].step == 50
    assert mine._made.count(None) == 98
    assert [r.step for r in mine[10:13]] == [11, 12, 13]
    assert list(mine) == [step_record(s, 0) for s in range(1, 101)]


def frame_with(rows: int = 1, indices: int = 0, extras: bytes = b"", body: bytes | None = None):
    good = pack(0, [step_record(1, 0, indices=()).summary()]).to_bytes()  # no extras
    header = struct.pack("<4sIII", MAGIC, rows, indices, len(extras))
    return header + (good[16:] if body is None else body) + extras


@pytest.mark.parametrize(
    "frame, message",
    [
        (b"DTR", "shorter than its header"),
        (b"JSON" + bytes(12), "not a step-record frame"),
        (frame_with(rows=2), "its header says 2 rows"),
        (frame_with(indices=1), "its header says 1 rows, 1 sample indices"),
        (frame_with(extras=b"[[0, {"), "extras are not valid"),
        (frame_with(extras=b'[[5, {"rng": []}]]'), "extras for row 5 of 1"),
        (frame_with(extras=b'[[0, {"__class__": 1}]]'), r"unknown fields \['__class__'\]"),
        (frame_with(extras=b'{"a": 1}'), "extras are not valid"),
    ],
)
def test_a_frame_that_is_not_one_says_what_is_wrong(frame, message):
    with pytest.raises(ValueError, match=message):
        unpack(frame, 0)


def test_counts_and_offsets_in_a_frame_are_checked_not_trusted():
    batch = pack(0, [step_record(1, 0), step_record(2, 0)])
    rows = batch.rows.copy()
    rows["indices_at"] = [1000, -7]  # offsets outside: recomputed from the counts
    frame = replace(batch, rows=rows).to_bytes()
    back = unpack(frame, 0)
    assert back.record(1).indices == step_record(2, 0).indices
    rows["num_indices"] = [9, -1]
    with pytest.raises(ValueError, match="counts do not add up"):
        unpack(replace(batch, rows=rows).to_bytes(), 0)
    rows = batch.rows.copy()
    rows["step"] = [0, 1]
    with pytest.raises(ValueError, match="step 0"):
        unpack(replace(batch, rows=rows).to_bytes(), 0)
    with pytest.raises(ValueError, match="record of rank 0 arrived from rank 5"):
        unpack(batch.to_bytes(), 5)


def test_a_bad_frame_adds_nothing_to_the_trace():
    trace = Trace({0: job_info(0)})
    trace.add_packed(0, pack(0, [step_record(1, 0)]).to_bytes())
    with pytest.raises(ValueError):
        trace.add_packed(0, pack(0, [step_record(2, 0)]).to_bytes()[:-3])
    assert len(trace) == 1 and len(trace.columns) == 1 and trace.last_step == 1


def test_extras_travel_as_json_data_only():
    recs = [odd_record(1, 0)]
    frame = pack(0, recs).to_bytes()
    extras = json.loads(frame[16 + len(pack(0, recs).rows.tobytes()) :])
    assert extras[0][0] == 0 and extras[0][1]["nonfinite_module"] == "layers.1.mlp"


def test_records_added_one_by_one_and_as_frames_keep_their_places():
    trace = Trace({0: job_info(0)})
    trace.add_packed(0, pack(0, [step_record(1, 0), step_record(2, 0)]).to_bytes())
    trace.add(0, [step_record(3, 0)])
    trace.add_packed(0, pack(0, [step_record(s, 0) for s in (3, 4, 5)]).to_bytes())
    assert trace.records[0][3].step == 4  # made alone, before the rest
    assert [r.step for r in trace.records[0]] == [1, 2, 3, 4, 5]
    assert list(trace.records[0]) == [step_record(s, 0) for s in range(1, 6)]
    assert trace.columns.rows()["step"].tolist() == [1, 2, 3, 4, 5]


def test_a_frame_whose_steps_go_back_keeps_only_those_that_go_forward():
    trace = Trace({0: job_info(0)})
    trace.add_packed(0, pack(0, [step_record(s, 0) for s in (1, 3, 2, 3, 4)]).to_bytes())
    assert [r.step for r in trace.records[0]] == [1, 3, 4]
    assert trace.columns.rows()["step"].tolist() == [1, 3, 4]


def host_frame(frames_by_rank: dict[int, list]) -> bytes:
    """What a relay sends up: its ranks' frames joined into one (records.packed.concat)."""
    return concat([read_frame(pack(r, recs).to_bytes(), r) for r, recs in frames_by_rank.items()])


def test_a_hosts_joined_frame_fills_the_trace_as_its_ranks_frames_do():
    sent = {
        r: [step_record(s, r) for s in (1, 2)] + [odd_record(3, r)] + [step_record(4, r)]
        for r in (4, 5, 6)
    }
    by_rank = Trace({r: job_info(r) for r in sent})
    for rank, recs in sent.items():
        by_rank.add_packed(rank, pack(rank, recs).to_bytes())
    joined = Trace({r: job_info(r) for r in sent})
    joined.add_host(host_frame(sent), {4, 5, 6, 7})
    assert joined.columns.rows().tobytes() == by_rank.columns.rows().tobytes()
    for rank, recs in sent.items():  # each rank's records, the extras of its own rows
        assert all(same(a, b) for a, b in zip(joined.records[rank], recs, strict=True))
        assert joined.records[rank].last_step == 4
        assert joined.records[rank].extras() == by_rank.records[rank].extras()


def test_a_joined_frame_with_steps_a_rank_has_keeps_only_each_ranks_new_rows():
    trace = Trace({r: job_info(r) for r in (0, 1)})
    trace.add_packed(0, pack(0, [step_record(s, 0) for s in (1, 2)]).to_bytes())
    # rank 0 repeats step 2; rank 1's rows come in two runs with rank 0's between
    data = concat(
        [
            read_frame(pack(1, [step_record(1, 1)]).to_bytes(), 1),
            read_frame(pack(0, [step_record(s, 0) for s in (2, 3)]).to_bytes(), 0),
            read_frame(pack(1, [step_record(s, 1) for s in (2, 3)]).to_bytes(), 1),
        ]
    )
    trace.add_host(data, {0, 1})
    assert [r.step for r in trace.records[0]] == [1, 2, 3]
    assert [r.step for r in trace.records[1]] == [1, 2, 3]
    rows = trace.columns.rows()
    assert list(zip(rows["step"].tolist(), rows["rank"].tolist(), strict=True)) == [
        (s, r) for s in (1, 2, 3) for r in (0, 1)
    ]


def test_a_joined_frame_keeps_only_the_rows_of_the_ranks_given():
    """Rows of a rank whose reply the channel did not take are left out, and named."""
    trace = Trace({r: job_info(r) for r in (0, 1, 2)})
    data = host_frame({0: [step_record(1, 0), odd_record(2, 0)], 2: [step_record(1, 2)]})
    assert trace.add_host(data, {0, 1}) == [2]
    assert 2 not in trace.records or len(trace.records[2]) == 0
    assert [r.step for r in trace.records[0]] == [1, 2]
    assert trace.records[0][1].nonfinite_module == "layers.1.mlp"  # its extras kept
    assert trace.columns.rows()["rank"].tolist() == [0, 0]


def test_a_joined_frame_on_the_slow_path_keeps_each_rows_extras():
    trace = Trace({r: job_info(r) for r in (0, 1)})
    trace.add_packed(1, pack(1, [step_record(1, 1)]).to_bytes())
    sent = {0: [step_record(1, 0), odd_record(2, 0)], 1: [step_record(1, 1), odd_record(2, 1)]}
    trace.add_host(host_frame(sent), {0, 1})  # rank 1's step 1 is a repeat: the slow path
    for rank in (0, 1):
        assert [r.step for r in trace.records[rank]] == [1, 2]
        assert same(trace.records[rank][1], odd_record(2, rank))


def test_extras_nested_too_deep_are_a_clear_error():
    frame = pack(0, [odd_record(1, 0)]).to_bytes()
    header = struct.Struct("<4sIII")
    _, n, k, _ = header.unpack_from(frame)
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads: RecursionError, not ValueError
    bad = (
        header.pack(MAGIC, n, k, len(deep))
        + frame[header.size : header.size + n * ROW.itemsize + 8 * k]
        + deep
    )
    with pytest.raises(ValueError, match="extras are not valid.*RecursionError"):
        read_frame(bad, 0)


@pytest.mark.parametrize("seed", range(20))
def test_many_rows_are_checked_in_numpy_as_a_few_are_row_by_row(seed):
    """read_frame checks frames of more than _FEW_ROWS rows with numpy: the same parts
    (runs of a rank, their steps, whether each rises) and the same errors as row by row."""
    from dtlab.records import packed as packed_module

    rng = random.Random(seed)
    frames = []
    for _ in range(rng.randint(1, 12)):  # runs of ranks, some again, steps not always rising
        rank = rng.randint(0, 5)
        steps = sorted(rng.sample(range(1, 60), rng.randint(1, 9)))
        if rng.random() < 0.3:
            steps.reverse()
        frames.append(read_frame(pack(rank, [step_record(s, rank) for s in steps]).to_bytes()))
    data = concat(frames)
    _, n, k, _ = struct.unpack_from("<4sIII", data)
    few = packed_module._few_parts_of(data, n, k, None)
    assert packed_module._parts_of(data, n, k, None) == few
    errors = []
    for check in (packed_module._parts_of, packed_module._few_parts_of):
        with pytest.raises(ValueError) as refused:
            check(data, n, k, 99)  # no row is rank 99's
        errors.append(str(refused.value))
    assert errors[0] == errors[1] == f"a record of rank {few[0].rank} arrived from rank 99"


def test_numpy_checks_refuse_what_row_by_row_refuses(monkeypatch):
    from dtlab.records import packed as packed_module

    frame = pack(0, [step_record(s, 0) for s in range(1, 41)]).to_bytes()
    header = struct.Struct("<4sIII")
    zero = bytearray(frame)
    struct.pack_into("<q", zero, header.size + 4, 0)  # the first row's step: 0
    for few in (0, 100):  # numpy, then row by row
        monkeypatch.setattr(packed_module, "_FEW_ROWS", few)
        with pytest.raises(ValueError, match="with step 0"):
            read_frame(bytes(zero), 0)
        with pytest.raises(ValueError, match="rank 0 arrived from rank 3"):
            read_frame(frame, 3)
        assert [p[:3] for p in read_frame(frame, 0).parts] == [(0, 0, 40)]

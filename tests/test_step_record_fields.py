"""One field list: every codec of a step record (the row, the frame's extras, the Parquet
columns) follows from ``records/row.py: ROW`` and the dataclasses' fields; a record is
made in one place on a rank (``agent/step_record.py``), by every kind of job."""

import hashlib
import math
import re
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from dtlab.agent import job as jobs
from dtlab.agent.attach import attach
from dtlab.agent.deepspeed_job import DeepSpeedJob
from dtlab.agent.jobs_base import JobCore, RankJob
from dtlab.agent.script_job import ScriptJob
from dtlab.agent.state import RANK
from dtlab.agent.step_fn_job import StepFnJob
from dtlab.records import StepMemory, StepRecord, StepTimes
from dtlab.records.packed import EXTRA_FIELDS, INT_MEMORY, ROW_FIELDS, pack, unpack
from dtlab.records.row import COUNTS, NULLABLE, ROW, ROW_OWN, row_of
from dtlab.records.step_files import _DICTIONARY, _schema, packed_of, table_of

RECORD = {f.name: f for f in fields(StepRecord)}
TIMES = [f.name for f in fields(StepTimes)]
MEMORY = {f.name: f for f in fields(StepMemory)}


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def test_every_field_travels_one_way():
    """A number of the row, the times, the memory, the sample indices, or an extra."""
    ways = [set(ROW_FIELDS), set(EXTRA_FIELDS), {"times", "memory", "indices"}]
    for name in RECORD:
        assert sum(name in way for way in ways) == 1, name
    columns = set(ROW.names)
    assert set(TIMES) | set(MEMORY) <= columns
    counted = set(COUNTS.values())
    assert counted <= set(RECORD) and counted - {"indices"} <= set(EXTRA_FIELDS)
    assert columns == set(ROW_OWN) | set(COUNTS) | set(ROW_FIELDS) | set(TIMES) | set(MEMORY)


def test_the_null_bits_are_the_optional_fields_the_row_holds():
    def optional(f):
        return "None" in str(f.type)

    held = [RECORD[n] for n in (*ROW_FIELDS, *COUNTS.values())] + list(MEMORY.values())
    assert {f.name for f in held if optional(f)} == set(NULLABLE)
    assert INT_MEMORY == {n for n in MEMORY if optional(MEMORY[n])}


def test_parquet_columns_are_the_rows_numbers():
    schema = _schema()
    scalars = [n for n in schema.names if n in RECORD and n != "indices"]
    assert sorted(scalars) == sorted(ROW_FIELDS)
    assert schema.names == [
        "rank",
        *scalars,
        *(f"times.{n}" for n in TIMES),
        *(f"memory.{n}" for n in MEMORY),
        "indices",
        "extra",
    ]
    assert set(_DICTIONARY) <= set(schema.names)


def _records():
    times = StepTimes(0.1, 0.2, 0.3, 0.4, 0.05)
    memory = StepMemory(100, 10, 20, 30, None, None, None, 7)
    cuda = StepMemory(100, 10, 20, 30, 1 << 40, 2, 3, 0)
    return [
        StepRecord(1, 1.5, 2.0, None, None, False, times, memory),
        StepRecord(
            2,
            2.5,
            math.nan,
            0.1,
            1024.0,
            True,
            times,
            cuda,
            indices=(1, 2, 3),
            epoch=3,
            epoch_starts=(1,),
            nonfinite_module="a.b",
            nonfinite_found="watched",
            grad_norms=(1.0, math.nan),
            grad_fingerprints=(1, -2),
            param_fingerprints=(3, 4),
            nonfinite=(0, 1),
            missing_grads=(1,),
            unreached=(0,),
            grad_norm=2.5,
            grad_fingerprint=-5,
            param_fingerprint=(1 << 64) - 1,
            num_nonfinite=1,
            buffer_fingerprints=(9,),
            buffer_fingerprint=-9,
            micro_batches=4,
            synced_micro_batches=1,
            input_fingerprints=(5, 6),
            comm_calls=2,
            comm_bytes=300,
            rng=(("torch", 5), ("numpy", -1)),
            module_outputs=(("m", 3),),
            update_rms=0.25,
        ),
        StepRecord(3, 3.5, 1.0, 0.2, None, False, times, memory, unreached=(), comm_calls=0),
    ]


# the frame of _records() as dtlab has always written it (DTR2): a change here is a new
# frame layout, which needs a new MAGIC and old frames read as before (packed.OLD_MAGIC)
FRAME_SHA256 = "8fc6c1c3405a378675d352dfe7cf75c5528011e299322888c040462f3c3388ec"


def test_the_frame_and_the_row_keep_their_bytes():
    records = _records()
    frame = pack(4, records).to_bytes()
    assert hashlib.sha256(frame).hexdigest() == FRAME_SHA256
    rows = [row_of(4, r, at) for r, at in zip(records, (0, 0, 3), strict=True)]
    assert np.array(rows, dtype=ROW).tobytes() == pack(4, records).rows.tobytes()
    back = unpack(frame).records()
    assert [r.step for r in back] == [1, 2, 3] and back[2] == records[2]
    assert back[1].rng == records[1].rng and back[1].unreached == (0,)
    again = packed_of(table_of(unpack(frame)))
    assert again.rows.tobytes() == unpack(frame).rows.tobytes()
    assert again.extras == unpack(frame).extras


def test_a_record_is_made_in_one_place_on_a_rank():
    agent = Path(jobs.__file__).parent
    sites = [
        f"{path.name}:{n}"
        for path in sorted(agent.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bStepRecord\(", line)
    ]
    assert [site.split(":")[0] for site in sites] == ["step_record.py"], sites


def test_every_kind_of_job_is_a_rank_job_and_none_fakes_another():
    for kind in (jobs.Job, StepFnJob, DeepSpeedJob, ScriptJob):
        assert issubclass(kind, JobCore), kind
    assert not issubclass(ScriptJob, jobs.Job) and not issubclass(StepFnJob, jobs.Job)
    assert not issubclass(DeepSpeedJob, jobs.Job)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"x": torch.randn(2, 3), "index": torch.tensor([0, 1])}]

    def step(batch):
        opt.zero_grad()
        loss = model(batch["x"]).sum()
        loss.backward()
        opt.step()
        return loss

    for how in ({"loss_fn": lambda m, b: m(b["x"]).sum()}, {"step": step}):
        attach(model, opt, data, **how)
        job = jobs.current()
        assert isinstance(job, RankJob)
        rec = job.step()
        assert rec.step == 1 and job.records[-1] is rec and rec.indices == (0, 1)
        assert rec.rng and rec.grad_fingerprint and rec.param_fingerprint
        assert job.take_output() == ""

"""TensorBoard export: event files written per rank, read back with TensorBoard's own
event reader (no cluster: records from the demo job in this process)."""

from dataclasses import replace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtlab.agent import job as jobs
from dtlab.agent.demo_job import attach_demo
from dtlab.agent.state import RANK
from dtlab.records.trace import Trace
from dtlab.views.tb_export import export_tensorboard


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


def test_every_rank_is_a_run_with_its_own_scalars(tmp_path):
    info = attach_demo(num_samples=64)
    job = jobs.current()
    trace = Trace({0: info, 1: info})
    records = [job.step() for _ in range(4)]
    trace.add(0, records)
    trace.add(1, [replace(rec, loss=rec.loss + 1) for rec in records])
    folder = export_tensorboard(trace, tmp_path / "tb")
    for rank, shift in ((0, 0.0), (1, 1.0)):
        events = EventAccumulator(str(folder / f"rank{rank}"))
        events.Reload()
        tags = events.Tags()["scalars"]
        assert {"loss", "grad_norm", "lr", "time/step_ms", "time/forward_ms", "memory/mib"} <= set(
            tags
        )
        loss = events.Scalars("loss")
        assert [e.step for e in loss] == [1, 2, 3, 4]
        assert [e.value for e in loss] == pytest.approx([r.loss + shift for r in records], rel=1e-6)

"""FSDP1 (``FullyShardedDataParallel``) jobs on 4 live gloo ranks, flat parameters and
``use_orig_params=True``: attached, and as an unchanged torchrun script.

Records name the model's own parameters (not ``_fsdp_wrapped_module._flat_param``), in
the model's order and shapes, each fingerprinted whole: the same fingerprints as the
unwrapped model's at the start, equal across ranks after every step. Memory shows the
shards; the doctor is clean; a checkpoint resumes bit for bit on fresh engines, and one
taken on 4 ranks is refused on another world size with the reason.
"""

from __future__ import annotations

import pytest

import dtlab
from dtlab import demo
from dtlab.control.checkpointing import CheckpointFailed
from tests.conftest import quiet, untimed
from tests.test_script_live import SCRIPTS, losses_in, recorded, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]


@pytest.fixture
def unwrapped(live4):
    """The demo under plain DDP: names, shapes, starting fingerprints, memory."""
    infos = demo.attach(live4, num_samples=512)
    live4.step(2)
    start = live4.training.evidence().initial[0].param_fingerprints
    memory = {rank: rec.memory for rank, rec in live4.trace.at(2).items()}
    return infos[0].params, start, memory[0]


@pytest.mark.parametrize("sharding", ["fsdp1", "fsdp1-orig"])
def test_an_fsdp1_job_records_the_models_own_parameters_and_resumes(
    live4, tmp_path, unwrapped, sharding
):
    dt = live4
    params, start, full = unwrapped
    dt.checkpoint_root = tmp_path / "checkpoints"
    infos = demo.attach(dt, num_samples=512, sharding=sharding, accumulate=2)
    assert {i.wrapper for i in infos.values()} == {"FullyShardedDataParallel"}
    assert {i.params for i in infos.values()} == {params}  # names, shapes, order: the model's
    dt.step(4)
    initial = dt.training.evidence().initial
    assert {s.param_fingerprints for s in initial.values()} == {start}  # whole, as unwrapped
    for rank, rec in dt.trace.at(4).items():  # parameters, gradients, Adam state: a quarter
        mem = rec.memory
        assert mem.param_bytes == pytest.approx(full.param_bytes / 4, rel=0.05), rank
        assert mem.grad_bytes == pytest.approx(full.grad_bytes / 4, rel=0.05), rank
        assert mem.optimizer_bytes == pytest.approx(full.optimizer_bytes / 4, rel=0.05), rank
    for step in range(1, 5):
        now = dt.trace.at(step).values()
        assert len({r.grad_fingerprint for r in now}) == 1, step  # whole gradients agree
        assert len({r.param_fingerprint for r in now}) == 1, step
    details = dt.step_details(4)
    assert all(len(r.grad_norms) == len(params) and not r.missing_grads for r in details.values())
    assert untimed(dt.doctor()) == []
    verdicts = {c.check: c.checked for c in dt.training.checks()}
    assert verdicts["initial_state"] and verdicts["gradient_sync"]  # compared, whole
    parts = dt.params(params[0].name)  # each rank's own part of it, flattened
    assert sum(p.size for p in parts.values()) == params[0].numel
    report = dt.resume_check(3)
    assert report.identical, report.summary()


@pytest.mark.parametrize("orig", [False, True])
def test_an_fsdp1_script_runs_unchanged_and_matches_torchrun(live4, tmp_path, orig):
    dt = live4
    args = ["--steps", "6", *(["--orig"] if orig else [])]
    torchrun(dt, "fsdp1_wrap.py", [*args, "--out", str(tmp_path / "torchrun")])
    status = dt.run_script(str(SCRIPTS / "fsdp1_wrap.py"), [*args, "--out", str(tmp_path / "dt")])
    assert (status.model, status.wrapper) == ("Net", "FullyShardedDataParallel")
    dt.step(3)
    names = [p.name for p in dt.trace.jobs[0].params]
    assert names[:3] == ["embed.weight", "embed.bias", "blocks.0.norm.weight"]
    assert names[-2:] == ["head.weight", "head.bias"] and len(names) == 2 + 3 * 6 + 2
    for step in range(1, 4):
        now = dt.trace.at(step).values()
        assert len({r.grad_fingerprint for r in now}) == 1, step
        assert len({r.param_fingerprint for r in now}) == 1, step
        assert all(0 < r.grad_norm <= 1.0 + 1e-5 for r in now)  # after FSDP's own clipping
    assert untimed(dt.doctor()) == []
    assert dt.continue_script().last_step == 6
    mine = losses_in(tmp_path / "dt")
    assert mine == losses_in(tmp_path / "torchrun")  # bit for bit, on every rank
    assert recorded(dt) == mine


def test_an_fsdp1_checkpoint_is_refused_on_another_world_size(live4, tmp_path):
    dt = live4
    dt.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(dt, num_samples=512, sharding="fsdp1")
    dt.step(2)
    saved = dt.checkpoint()
    two = dtlab.launch(2, progress=quiet)  # in place of the 4-rank session (last test here)
    demo.attach(two, num_samples=512, sharding="fsdp1")
    two.step(1)
    with pytest.raises(CheckpointFailed, match="FSDP1 flat shards as FSDP laid them out for 4"):
        two.load_checkpoint(saved.path)
    assert two.step(1).last_step == 2  # the job is unchanged and steps on

"""Device meshes and update sizes (issue 43), in one process.

- the data check takes which ranks should read different data from the device mesh
  (``JobInfo.mesh``): tensor-parallel peers sharing a batch is by design, data-parallel
  ranks sharing one is named, with advice by data-parallel rank and degree;
- ``StepRecord.update_rms`` travels as the other numbers do (frames, columns, Parquet parts,
  an older folder's frames and parts without it), and the ``update_size`` check names a rank
  whose update per unit of LR stands apart, and stays quiet on healthy twins;
- ``dtlab.agent.update_size.UpdateSample`` on plain tensors and a DTensor, and
  ``dtlab.agent.mesh.describe`` on a 1-rank gloo world and (torch's fake process group)
  on 4-rank layouts.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from dtlab.analysis.checks_data import (
    ITERABLE_FIX,
    SAME_SHARD_FIX,
    SEEDED_FIX,
    check_data_order,
    data_fix,
)
from dtlab.analysis.checks_updates import check_update_size
from dtlab.analysis.doctor import run_checks
from dtlab.analysis.mesh_groups import data_coordinates, shared_mesh
from dtlab.analysis.registry import registered
from dtlab.records import Evidence, MeshInfo
from dtlab.records.packed import OLD_MAGIC, ROW_V1, pack, unpack
from dtlab.records.step_files import StepFiles, table_of
from tests.fakes import PARAMS, job_info, step_record

NAMES = tuple(p.name for p in PARAMS)
ITERABLE = "DataLoader, _InfiniteConstantSampler"  # describe_data of an IterableDataset's


def mesh_of(rank: int, dims=("dp", "tp"), shape=(2, 2), data_dims=("dp",)) -> MeshInfo:
    coordinate = tuple(int(c) for c in np.unravel_index(rank, shape))
    return MeshInfo(dims, shape, coordinate, data_dims, "fully_shard")


def jobs_on_mesh(num_ranks=4, data=ITERABLE, **mesh):
    return {r: job_info(r, data=data, mesh=mesh_of(r, **mesh)) for r in range(num_ranks)}


def evidence(records, jobs=None):
    jobs = jobs if jobs is not None else {r: job_info(r) for r in records}
    return Evidence(records=records, names=NAMES, jobs=jobs)


# --- the mesh record -------------------------------------------------------------------------


def test_a_mesh_says_each_ranks_data_shard():
    mesh = mesh_of(3, ("dp_replicate", "dp_shard", "tp"), (2, 2, 2), ("dp_replicate", "dp_shard"))
    assert mesh.coordinate == (0, 1, 1) and mesh.size == 8
    assert mesh.data_coordinate == (0, 1)
    assert (mesh.data_rank, mesh.data_degree) == (1, 4)
    assert mesh.describe() == (
        "mesh dp_replicate=2 x dp_shard=2 x tp=2 (data-parallel: dp_replicate, dp_shard)"
    )
    top = mesh_of(7, ("dp_replicate", "dp_shard", "tp"), (2, 2, 2), ("dp_replicate", "dp_shard"))
    assert top.data_rank == 3


def test_data_coordinates_only_from_meshes_that_describe_every_rank():
    jobs = jobs_on_mesh()
    assert data_coordinates(jobs, range(4)) == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    # a rank without a mesh, a mesh of another size, two ranks on one coordinate: no mesh
    assert data_coordinates({**jobs, 2: job_info(2)}, range(4)) is None
    assert data_coordinates(jobs, range(3)) is None
    assert data_coordinates({**jobs, 3: jobs[2]}, range(4)) is None
    other = {**jobs, 1: replace(jobs[1], mesh=replace(jobs[1].mesh, data_dims=("tp",)))}
    assert data_coordinates(other, range(4)) is None
    assert shared_mesh(jobs, range(4)) == jobs[0].mesh


# --- data order on a mesh: inputs ------------------------------------------------------------


def inputs_job(shard_of, num_ranks=4, num_steps=6):
    """A script with its own batching (no sample indices): rank r draws shard shard_of(r)."""
    return {
        r: [
            step_record(s, r, indices=(), input_fingerprints=(1000 * shard_of(r) + s, 7 * s))
            for s in range(1, num_steps + 1)
        ]
        for r in range(num_ranks)
    }


def test_tensor_parallel_peers_sharing_inputs_is_by_design():
    records = inputs_job(lambda r: r // 2)  # dp=2 x tp=2: peers (0, 1) and (2, 3)
    result = check_data_order(evidence(records, jobs_on_mesh()))
    assert result.findings == () and result.checked
    assert "mesh dp=2 x tp=2" in result.looked_at and "share their data by design" in (
        result.looked_at
    )
    # without the mesh, as before: the peers are named
    found = check_data_order(evidence(records)).findings
    assert {f.ranks for f in found} == {(0, 1), (2, 3)}


def test_data_parallel_ranks_sharing_inputs_are_named_with_shard_advice_first():
    records = inputs_job(lambda r: 0)  # the planted bug: every rank reads shard 0
    (finding,) = check_data_order(evidence(records, jobs_on_mesh())).findings
    assert finding.ranks == (0, 1, 2, 3) and finding.severity == "error"
    assert "data-parallel ranks 0 and 1 of 2 (dp)" in finding.summary
    assert "2 data-parallel ranks do the work of one" in finding.summary
    fix = finding.fix
    assert fix.startswith("the DataLoader reads an IterableDataset")
    assert 'mesh["dp"].get_local_rank()' in fix and 'mesh["dp"].size()' in fix
    assert fix.index("its own shard") < fix.index("seed")
    assert finding.evidence["data_coordinates"] == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}


def test_only_the_data_shards_that_coincide_are_named():
    # dp=4 x tp=2: shards 0..3; shards 1 and 2 read the same
    records = inputs_job(lambda r: {2: 1}.get(r // 2, r // 2), num_ranks=8)
    jobs = jobs_on_mesh(8, shape=(4, 2))
    (finding,) = check_data_order(evidence(records, jobs)).findings
    assert finding.ranks == (2, 3, 4, 5)
    assert "data-parallel ranks 1 and 2 of 4 (dp)" in finding.summary


def test_a_mesh_of_data_dimensions_only_is_todays_check():
    records = inputs_job(lambda r: 9 if r in (1, 3) else r)
    jobs = {r: job_info(r, mesh=mesh_of(r, ("dim0",), (4,), ("dim0",))) for r in range(4)}
    (finding,) = check_data_order(evidence(records, jobs)).findings
    assert finding.ranks == (1, 3)


# --- data order on a mesh: sample indices ----------------------------------------------------


def indices_job(shard_of, num_ranks=4, num_steps=6, batch=4):
    return {
        r: [
            step_record(
                s,
                r,
                indices=tuple(
                    range(s * 100 + shard_of(r) * batch, s * 100 + (shard_of(r) + 1) * batch)
                ),
            )
            for s in range(1, num_steps + 1)
        ]
        for r in range(num_ranks)
    }


def test_peers_reading_the_same_samples_pass_on_a_mesh():
    records = indices_job(lambda r: r // 2)
    result = check_data_order(
        evidence(records, jobs_on_mesh(data="DataLoader, DistributedSampler"))
    )
    assert result.findings == ()
    assert "ranks that share a data-parallel coordinate read the same samples" in (
        result.passed_because
    )
    assert {f.ranks for f in check_data_order(evidence(records)).findings} == {(0, 1, 2, 3)}


def test_data_parallel_ranks_reading_the_same_samples_are_named_with_their_peers():
    records = indices_job(lambda r: 0)
    jobs = jobs_on_mesh(data="DataLoader, DistributedSampler")
    (finding,) = check_data_order(evidence(records, jobs)).findings
    assert finding.ranks == (0, 1, 2, 3) and finding.severity == "error"
    assert "ranks 0,2 read the same samples" in finding.summary
    assert "tensor-parallel peers (ranks 1,3) read the same" in finding.summary
    assert "num_replicas=dp_degree and rank=dp_rank" in finding.fix
    assert 'mesh["dp"]' in finding.fix


def test_peers_reading_different_samples_are_named():
    records = indices_job(lambda r: r)  # a DistributedSampler over the whole world
    (finding,) = check_data_order(evidence(records, jobs_on_mesh())).findings
    assert finding.ranks == (0, 1, 2, 3) and finding.severity == "error"
    assert "share a data-parallel coordinate" in finding.summary
    assert "read different samples in 6 of 6 steps, from step 1" in finding.summary
    assert 'mesh["dp"].get_local_rank()' in finding.fix


# --- the advice ------------------------------------------------------------------------------


def test_the_advice_without_a_mesh_is_todays():
    def jobs(kind):
        return {r: job_info(r, data=kind) for r in range(4)}

    assert data_fix(jobs("DataLoader, DistributedSampler"), "x") == SAME_SHARD_FIX
    assert data_fix(jobs("no DataLoader: generator"), "x") == SEEDED_FIX.format(kind="generator")
    iterable = data_fix(jobs(ITERABLE), "x")
    assert iterable == ITERABLE_FIX.format(
        dp="its rank and the world size (dist.get_rank(), dist.get_world_size())",
        seed="the rank (torch.manual_seed(seed + rank))",
    )
    assert iterable.index("own shard") < iterable.index("seeding")


def test_the_advice_on_a_mesh_shards_by_data_parallel_rank_first():
    own_code = data_fix(jobs_on_mesh(data="no DataLoader: generator"), "x")
    assert own_code.startswith("batches come from generator, not a DataLoader")
    assert own_code.index("own shard") < own_code.index("seed the drawing with dp_rank")
    assert "tensor-parallel peers keep reading the same batches" in own_code
    sampler = data_fix(jobs_on_mesh(data="DataLoader, RandomSampler"), "x")
    assert "num_replicas=dp_degree, rank=dp_rank" in sampler
    unknown = data_fix(jobs_on_mesh(data=""), "x")
    assert unknown.startswith("give each data-parallel rank its own shard")
    two = jobs_on_mesh(
        8,
        dims=("dp_replicate", "dp_shard", "tp"),
        shape=(2, 2, 2),
        data_dims=("dp_replicate", "dp_shard"),
    )
    two = {r: replace(j, data="") for r, j in two.items()}
    assert "_flatten()" in data_fix(two, "x") and '"dp_replicate", "dp_shard"' in data_fix(two, "x")
    # a mesh without tensor-parallel peers (FSDP alone): shard first, by the rank
    fsdp = {
        r: job_info(r, data="no DataLoader: list", mesh=mesh_of(r, ("dim0",), (4,), ("dim0",)))
        for r in range(4)
    }
    text = data_fix(fsdp, "x")
    assert text.index("own shard") < text.index("seed") and "dist.get_rank()" in text


# --- update_rms as a record field ------------------------------------------------------------


def test_update_rms_travels_in_frames_and_defaults_to_nan():
    recs = [step_record(1, 2, update_rms=0.25), replace(step_record(2, 2), update_rms=math.nan)]
    back = unpack(pack(2, recs).to_bytes(), 2).records()
    assert back[0].update_rms == 0.25 and back == recs  # a nan read back equals the default
    assert math.isnan(replace(step_record(1), update_rms=math.nan).update_rms)


def old_frame(batch) -> bytes:
    """A batch as a frame of the layout before update_rms (what an older journal holds)."""
    old = np.zeros(len(batch.rows), dtype=ROW_V1)
    for name in ROW_V1.names:
        old[name] = batch.rows[name]
    extras = json.dumps(sorted(batch.extras.items())).encode() if batch.extras else b""
    header = struct.pack("<4sIII", OLD_MAGIC, len(old), len(batch.indices), len(extras))
    return header + old.tobytes() + batch.indices.astype("<i8").tobytes() + extras


def test_an_older_frame_reads_with_update_sizes_not_measured():
    recs = [step_record(s, 1, update_rms=0.5, missing_grads=(2,)) for s in (1, 2)]
    back = unpack(old_frame(pack(1, recs)), 1).records()
    assert all(math.isnan(r.update_rms) for r in back)
    assert back == [replace(r, update_rms=math.nan) for r in recs]


def test_update_rms_in_parquet_parts_old_and_new(tmp_path):
    import pyarrow.parquet as pq

    files = StepFiles(tmp_path)
    files.folder.mkdir(parents=True)
    old = [step_record(s, 0, update_rms=0.5) for s in range(1, 8)]
    for i, rec in enumerate(old):  # seven parts written before the column existed
        table = table_of(pack(0, [rec])).drop_columns(["update_rms"])
        pq.write_table(table, files.folder / f"L0-{i:012d}-1.parquet")
    new = [step_record(8, 0, update_rms=0.125)]
    files.write(pack(0, new))  # the eighth part: the eight merge into one
    assert [p[0] for p in files.parts()] == [1]
    (batch,) = list(files.read())
    got = batch.rows["update_rms"]
    assert np.isnan(got[:7]).all() and got[7] == 0.125
    assert batch.records()[7] == new[0]


def test_a_run_folder_keeps_each_ranks_mesh(tmp_path):
    from dtlab.records import run_folder

    jobs = jobs_on_mesh()
    jobs[0] = replace(jobs[0], unobserved=(("update size", 3),))
    run_folder.write_header(tmp_path, jobs, {}, 0.0)
    _, back = run_folder.read_header(tmp_path)
    assert back == jobs


# --- the update_size check -------------------------------------------------------------------


def updates_job(sizes, lrs=None, num_steps=8):
    """``sizes(rank, step)``: each rank's update RMS; ``lrs(rank, step)``: its LR."""
    lrs = lrs or (lambda r, s: 1e-3)
    return {
        r: [
            step_record(s, r, lr=lrs(r, s), update_rms=sizes(r, s)) for s in range(1, num_steps + 1)
        ]
        for r in range(4)
    }


def test_update_size_is_registered_after_the_learning_rate():
    names = [c.name for c in registered()]
    assert names.index("update_size") == names.index("learning_rate") + 1
    (entry,) = [c for c in registered() if c.name == "update_size"]
    assert entry.compares == "ranks" and entry.observes == ("update size",)


def test_equal_updates_pass():
    result = check_update_size(evidence(updates_job(lambda r, s: 8e-4)))
    assert result.findings == () and result.checked
    assert "per unit of LR" in result.looked_at


@pytest.mark.parametrize("seed", range(5))
def test_adam_on_different_shards_differing_a_little_passes(seed):
    rng = np.random.default_rng(seed)
    noise = rng.uniform(0.8, 1.2, size=(4, 9))  # ranks agree within ~20%
    result = check_update_size(evidence(updates_job(lambda r, s: 8e-4 * noise[r, s])))
    assert result.findings == ()


def test_a_rank_whose_update_is_twice_the_others_is_named():
    records = updates_job(lambda r, s: 8e-4 * (2.0 if r == 2 and s >= 3 else 1.0))
    (finding,) = check_update_size(evidence(records)).findings
    assert finding.ranks == (2,) and finding.step == 3 and finding.kind == "update_size"
    assert "rank 2: 2x the others' median at 6 of 8 steps, from step 3" in finding.summary
    assert finding.evidence["ranks"][2]["ratio"] == 2.0
    assert "its LR" in finding.fix and "optimizer state" in finding.fix and "scaler" in finding.fix


def test_a_smaller_update_is_named_too():
    records = updates_job(lambda r, s: 8e-4 * (0.5 if r == 1 else 1.0))
    (finding,) = check_update_size(evidence(records)).findings
    assert finding.ranks == (1,) and "1/2 of theirs" in finding.summary


def test_an_lr_that_explains_the_update_is_the_learning_rate_checks():
    # rank 2's LR is 2x and its update 2x (Adam): the same per unit of LR
    records = updates_job(
        lambda r, s: 8e-4 * (2.0 if r == 2 else 1.0), lambda r, s: 2e-3 if r == 2 else 1e-3
    )
    assert check_update_size(evidence(records)).findings == ()
    # a schedule moves every rank's LR alike
    sched = updates_job(lambda r, s: 8e-4 / s, lambda r, s: 1e-3 / s)
    assert check_update_size(evidence(sched)).findings == ()


def test_without_lrs_the_raw_update_is_compared():
    records = updates_job(lambda r, s: 8e-4 * (2.0 if r == 0 else 1.0), lambda r, s: None)
    result = check_update_size(evidence(records))
    (finding,) = result.findings
    assert finding.ranks == (0,) and "raw" in finding.summary
    assert "raw (LR not known at every step)" in result.looked_at


def test_a_few_steps_apart_are_not_enough():
    one = updates_job(lambda r, s: 8e-4 * (3.0 if r == 3 and s == 5 else 1.0))
    assert check_update_size(evidence(one)).findings == ()
    some = updates_job(lambda r, s: 8e-4 * (3.0 if r == 3 and s in (2, 5, 7) else 1.0))
    assert check_update_size(evidence(some)).findings == ()  # 3 of 8: not most steps
    short = {r: recs[:2] for r, recs in updates_job(lambda r, s: 1.0 + (r == 3)).items()}
    assert check_update_size(evidence(short)).findings[0].ranks == (3,)  # 2 of 2 steps


def test_skipped_steps_are_left_out():
    records = updates_job(lambda r, s: 0.0 if r == 1 and s > 2 else 8e-4)
    assert check_update_size(evidence(records)).findings[0].ranks == (1,)
    skipped = {
        r: [replace(rec, skipped=rec.step > 2) if r == 1 else rec for rec in recs]
        for r, recs in records.items()
    }
    assert check_update_size(evidence(skipped)).findings == ()


def test_two_ranks_that_differ_are_both_named():
    records = {r: recs for r, recs in updates_job(lambda r, s: 8e-4 * (1 + r)).items() if r < 2}
    (finding,) = check_update_size(evidence(records)).findings
    assert finding.ranks == (0, 1)


def test_without_update_sizes_it_says_not_checked():
    records = updates_job(lambda r, s: math.nan)
    result = check_update_size(evidence(records))
    assert result.outcome == "not checked" and "no rank recorded" in result.passed_because
    assert result.needs


def test_pipeline_stages_are_compared_within_a_stage_only():
    stage_a, stage_b = PARAMS[:2], PARAMS[2:]
    jobs = {r: job_info(r, params=stage_a if r < 2 else stage_b) for r in range(4)}
    # stage b's updates are 3x stage a's: different layers, not a fault
    records = updates_job(lambda r, s: 8e-4 * (3.0 if r >= 2 else 1.0))
    assert check_update_size(evidence(records, jobs)).findings == ()
    one_each = {r: job_info(r, params=PARAMS[r : r + 1]) for r in range(4)}
    result = check_update_size(evidence(records, one_each))
    assert result.outcome == "not checked" and "pipeline" in result.passed_because


def test_sgd_on_shards_is_not_judged():
    records = updates_job(lambda r, s: 8e-4 * (2.0 if r == 2 else 1.0))
    jobs = jobs_on_mesh()
    sgd = {r: replace(j, optimizer="SGD") for r, j in jobs.items()}
    result = check_update_size(evidence(records, sgd))
    assert result.outcome == "not checked" and "SGD on sharded parameters" in (
        result.passed_because
    )
    assert check_update_size(evidence(records, jobs)).findings[0].ranks == (2,)  # AdamW
    ddp = {r: job_info(r, optimizer="SGD") for r in range(4)}  # replicas: equal updates
    assert check_update_size(evidence(records, ddp)).findings[0].ranks == (2,)


def test_the_doctor_says_not_checked_where_the_observation_failed():
    records = updates_job(lambda r, s: 8e-4 * (2.0 if r == 2 else 1.0))
    jobs = {r: job_info(r, unobserved=(("update size", 1),)) for r in range(4)}
    (entry,) = [c for c in registered() if c.name == "update_size"]
    (result,) = run_checks(evidence(records, jobs), [entry])
    assert result.outcome == "not checked"


# --- UpdateSample on tensors -----------------------------------------------------------------

from dtlab.agent.update_size import RUN, SAMPLE_CAP, UpdateSample  # noqa: E402


def params_of(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def test_the_rms_of_a_known_change():
    params = params_of((1000, 100), (50,), (7, 3))
    sample = UpdateSample(params)
    sample.before()
    with torch.no_grad():
        for p in params:
            p.add_(0.01)
    assert sample.after() == pytest.approx(0.01, rel=1e-4)
    plan = sample._plan
    assert sum(t.count for t in plan) <= SAMPLE_CAP
    assert [t.count for t in plan][1:] == [50, 21]  # small tensors: every element


def test_the_sample_is_fixed_and_shared_equally():
    params = params_of((1 << 20,), (1000,))
    a, b = UpdateSample(params), UpdateSample(params)
    a.before(), b.before()
    assert a._plan == b._plan
    big, small = (t.count for t in a._plan)
    assert small == 1000 and big == (SAMPLE_CAP - 1000) // RUN * RUN  # runs of RUN elements
    with torch.no_grad():
        params[0].add_(0.5)  # only the big tensor moves
    assert a.after() == pytest.approx(0.5 * math.sqrt(big / (big + small)), rel=1e-4)


def test_many_parameters_are_sampled_evenly_through_the_list():
    params = params_of(*[(64,)] * 100)
    sample = UpdateSample(params, max_tensors=8)
    sample.before()
    assert [t.index for t in sample._plan] == [0, 14, 28, 42, 57, 71, 85, 99]
    assert sample.after() == 0.0


def test_nan_without_a_sample_and_after_a_change_of_shape():
    assert math.isnan(UpdateSample([]).after())
    empty = UpdateSample([])
    empty.before()
    assert math.isnan(empty.after())
    params = params_of((10, 10))
    sample = UpdateSample(params)
    assert math.isnan(sample.after())  # before() was not called
    sample.before()
    params[0].data = torch.zeros(5)
    assert math.isnan(sample.after())
    sample.before()  # a new plan for the new shape
    assert sample.after() == 0.0


def test_autograd_never_sees_it_and_the_parameters_are_not_touched():
    params = params_of((100, 10), (10,))  # small: every element is sampled
    old = torch.cat([p.detach().reshape(-1).clone() for p in params])
    sample = UpdateSample(params)
    with torch.enable_grad():
        versions = [p._version for p in params]
        sample.before()
        assert not any(t.requires_grad for t in sample._before.values())
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        torch.optim.SGD(params, lr=0.1).step()  # each element moves by 0.1 * 2p
        rms = sample.after()
    assert isinstance(rms, float)
    assert rms == pytest.approx(float((0.2 * old).square().mean().sqrt()), rel=1e-4)
    assert [p._version for p in params] == [v + 1 for v in versions]  # the step's own only
    assert all(p.grad is not None and p.grad.grad_fn is None for p in params)


def test_bfloat16_changes_are_measured_in_float32():
    params = params_of((4096,), dtype=torch.bfloat16)
    sample = UpdateSample(params)
    sample.before()
    with torch.no_grad():
        params[0].mul_(2)
    expected = float(params[0].detach().float().square().mean().sqrt()) / 2
    assert sample.after() == pytest.approx(expected, rel=1e-3)


def test_of_optimizers_takes_each_parameter_once():
    params = params_of((4,), (5,))
    one = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=1.0)
    two = torch.optim.SGD(params[:1], lr=1.0)
    assert UpdateSample.of_optimizers([one, two]).params == params


def adam_shards(lr_of, num_shards=4, steps=6, numel=200_000, seed=0):
    """Each shard of one parameter under its own Adam, with its own gradients: the update
    RMS of each shard at each step, measured by UpdateSample."""
    torch.manual_seed(seed)
    shards = [torch.nn.Parameter(torch.randn(numel // num_shards)) for _ in range(num_shards)]
    optims = [torch.optim.Adam([p], lr=lr_of(i)) for i, p in enumerate(shards)]
    samples = [UpdateSample([p]) for p in shards]
    sizes = np.zeros((num_shards, steps + 1))
    for step in range(1, steps + 1):
        for i, (p, opt, sample) in enumerate(zip(shards, optims, samples, strict=True)):
            p.grad = torch.randn_like(p) * (1 + i)  # shards see gradients of other scales
            sample.before()
            opt.step()
            sizes[i, step] = sample.after()
    return sizes


def test_adam_shards_agree_and_a_doubled_lr_doubles_the_update():
    healthy = adam_shards(lambda i: 1e-3)
    each_step = healthy[:, 1:]
    assert (each_step.max(axis=0) / each_step.min(axis=0)).max() < 1.2
    records = updates_job(lambda r, s: healthy[r, s], num_steps=6)
    assert check_update_size(evidence(records)).findings == ()
    doubled = adam_shards(lambda i: 2e-3 if i == 2 else 1e-3)
    assert doubled[2, 1:] / np.median(doubled[[0, 1, 3], 1:], axis=0) == pytest.approx(2, rel=0.1)
    # the LR it recorded is the others' (a param group, a scaler of its own): named
    records = updates_job(lambda r, s: doubled[r, s], num_steps=6)
    (finding,) = check_update_size(evidence(records)).findings
    assert finding.ranks == (2,) and finding.step == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_parameters():
    params = [
        torch.nn.Parameter(torch.randn(1 << 20, device="cuda")),
        torch.nn.Parameter(torch.randn(7, device="cuda")),
    ]
    sample = UpdateSample(params)
    sample.before()
    with torch.no_grad():
        for p in params:
            p.add_(0.25)
    assert sample.after() == pytest.approx(0.25, rel=1e-4)


# --- in-process worlds -----------------------------------------------------------------------


@pytest.fixture
def one_rank_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_rank_3_of_4():
    """This process as rank 3 of 4 on torch's fake process group (collectives do nothing):
    enough to lay out meshes, not to train."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=3, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_update_sample_of_a_dtensor_takes_its_local_shard(one_rank_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(64, 8), mesh, [Shard(0)]))
    sample = UpdateSample([param])
    sample.before()
    with torch.no_grad():
        param.add_(0.5)
    assert sample.after() == pytest.approx(0.5, rel=1e-5)
    assert sample._plan[0].numel == param.to_local().numel()


def test_describe_a_one_rank_world(one_rank_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtlab.agent.mesh import describe

    assert describe(torch.nn.Linear(2, 2)) is None  # no mesh: plain parameters
    fsdp = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
    assert describe(fsdp) == MeshInfo(("dim0",), (1,), (0,), ("dim0",), "fully_shard")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert describe(model) == MeshInfo(("dp", "tp"), (1, 1), (0, 0), ("dp",), "DTensor")
    fully_shard(model, mesh=mesh["dp"])
    assert describe([model]) == MeshInfo(("dp", "tp"), (1, 1), (0, 0), ("dp",), "fully_shard")
    # what it cannot read is no mesh, never an error
    assert describe(None) is None and describe(42) is None and describe([object()]) is None

    class Odd(torch.nn.Module):
        def parameters(self, recurse=True):
            raise RuntimeError("no")

    assert describe(Odd()) is None


def test_describe_four_rank_layouts(fake_rank_3_of_4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from dtlab.agent.mesh import describe

    def linear():
        return torch.nn.Linear(4, 4)

    # FSDP x TP on a named 2-D mesh: rank 3 is dp 1, tp 1
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = torch.nn.Sequential(linear())
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    info = describe(model)
    assert info == MeshInfo(("dp", "tp"), (2, 2), (1, 1), ("dp",), "fully_shard")
    assert (info.data_rank, info.data_degree) == (1, 2)
    # FSDP over the whole world, an unnamed mesh: every dimension is data-parallel
    assert describe(fully_shard(linear(), mesh=init_device_mesh("cpu", (4,)))) == MeshInfo(
        ("dim0",), (4,), (3,), ("dim0",), "fully_shard"
    )
    # HSDP: both dimensions, whatever their names
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s"))
    hsdp = describe(fully_shard(linear(), mesh=hsdp_mesh))
    assert hsdp.data_dims == ("r", "s") and hsdp.coordinate == (1, 1)
    # torchtitan's FSDP over dp_shard and cp flattened: cp stays a batch-sharing dimension
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = named[("dp_shard", "cp")]._flatten("dp_shard_cp")
    assert describe(fully_shard(linear(), mesh=flat)).data_dims == ("dp_shard",)
    # a dimension FSDP shards over is data-parallel whatever its name
    odd = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    assert describe(fully_shard(linear(), mesh=odd["b"])).data_dims == ("b",)
    # tensor parallel alone: no data dimension, every rank a peer
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    alone = torch.nn.Sequential(linear())
    parallelize_module(alone, tp, {"0": ColwiseParallel()})
    assert describe(alone) == MeshInfo(("tp",), (4,), (3,), (), "DTensor")

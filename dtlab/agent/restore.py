"""Load a dtlab checkpoint into the attached job, on every rank at once.

Stages, each ended by all ranks agreeing (one all_gather), so that a checkpoint refused on
one rank is refused on all and no rank's job has changed:

1. check, touching nothing: the manifest; the model (names and shapes) and optimizer
   (groups, parameters) against the job; the data position (converted by samples when the
   world size or batch size changed, and within the data's length); this rank's share of
   the files (size and checksum); ``rank-R.pt`` read with ``weights_only``;
2. read the tensors (``torch.distributed.checkpoint``, any world size) straight into the
   model's parameters and the optimizer's state: only files every rank has just verified,
   so only an I/O error mid-read can leave the job half-loaded, and the error says so
   (fresh buffers for everything would cost a copy of the whole state);
3. apply the rest: optimizer hyper-parameters, scheduler, scaler, step counter, the data
   position (its iterator re-made from the RNG states it was first made from: a shuffling
   sampler draws its order there), and the RNGs last.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from dtlab.agent import checkpoint_state as parts
from dtlab.agent import job as jobs
from dtlab.agent import rng
from dtlab.agent.checkpoint import attempt
from dtlab.agent.groups import control_group
from dtlab.agent.rendezvous import identity
from dtlab.records.checkpoints import CheckpointError, file_problem, open_confined, read_manifest


def load(path: str) -> dict:
    """Replace this rank's job state with the checkpoint at ``path`` (every rank).

    Returns ``{"step", "restored": parts, "missing": parts the checkpoint lacks,
    "notes": [...]}``; raises CheckpointError (job unchanged) when it must not be loaded.
    """
    import torch.distributed.checkpoint as dcp

    from dtlab.agent.dcp_io import tensors_only_planner

    job, me = jobs.current(), identity()
    folder = Path(path)
    checked, error = attempt(lambda: _check(job, folder, me.rank, me.world_size), folder)
    _agree(error, folder)
    manifest, extras, position, source = checked
    tensors, error = attempt(lambda: _targets(job, manifest, extras, source), folder)
    _agree(error, folder)
    group = control_group()  # None: one process, no collective to make
    read = dict(
        storage_reader=confined_reader(folder, manifest),
        planner=tensors_only_planner(),
        process_group=group,
        no_dist=group is None,
    )
    _, error = attempt(lambda: dcp.load(tensors, **read), folder)  # every rank: collective
    _agree(
        error,
        folder,
        after="its files checked out, but reading them failed; the model "
        "and optimizer may be partly overwritten: load another checkpoint",
    )
    same_world = manifest["world_size"] == me.world_size
    if not manifest.get("replicated", True):
        tensors = {key: value[str(source)] for key, value in tensors.items()}
    try:
        restored = _apply(job, tensors, extras, position, same_world)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {folder}: rank {me.rank} could not apply its "
            f"state ({type(e).__name__}: {e}); the job is partly loaded: "
            "load another checkpoint"
        ) from None
    notes = (
        []
        if same_world
        else [
            f"world size {manifest['world_size']} -> {me.world_size}: RNG streams are per rank "
            "and were not restored; the data position was converted"
        ]
    )
    missing = [p for p in parts.PARTS if p not in extras["parts"]]
    return {"step": job.step_count, "restored": restored, "missing": missing, "notes": notes}


def _agree(error: str | None, folder: Path, *, after: str | None = None) -> None:
    said = [e for e in dict.fromkeys(parts.gather(error)) if e]
    if said and after:
        raise CheckpointError(f"checkpoint {folder}: {after} ({'; '.join(said)})")
    if said:
        raise CheckpointError(
            f"checkpoint {folder} refused: {'; '.join(said)}. The job is unchanged; "
            "dt.checkpoints() lists the others"
        )


def _check(job, folder: Path, rank: int, world_size: int):
    if job.checkpoint_problem:
        raise CheckpointError(job.checkpoint_problem)
    manifest = read_manifest(folder)
    source = rank if rank < manifest["world_size"] else 0
    if getattr(job, "flat", None) is not None and manifest["world_size"] != world_size:
        raise CheckpointError(
            f"{folder} holds FSDP1 flat shards as FSDP laid them out for "
            f"{manifest['world_size']} ranks; this job has {world_size}: load it on "
            f"{manifest['world_size']} ranks (dtlab does not re-cut FSDP1's flat shards)"
        )
    _check_model(manifest, job, folder, source)
    position = _position(manifest, job, world_size)
    if position is not None and (problem := job.stream.seek_problem(position[1])):
        raise CheckpointError(f"rank {rank}: {problem}")
    files = manifest["files"]
    mine = [e for i, e in enumerate(files) if i % world_size == rank]
    # the files this rank opens itself are checked here too, whoever checks the rest:
    # listed, regular files of their listed size and checksum, before anything opens them
    extras_name = f"rank-{source}.pt"
    listed = [e for e in files if e["name"] == extras_name]
    if not listed:
        raise CheckpointError(f"{folder}: the manifest lists no {extras_name}")
    own = {id(e) for e in [*mine, *listed]} | {id(e) for e in files if e["name"] == ".metadata"}
    # every listed file, whoever reads it: a regular file of its size (no link, FIFO,
    # folder), so that no rank's DCP read can block or leave the folder
    problems = [p for p in (file_problem(folder, e, checksum=id(e) in own) for e in files) if p]
    if problems:
        raise CheckpointError("; ".join(dict.fromkeys(problems)))
    _check_metadata(folder, manifest)
    with open_confined(folder, extras_name, size=listed[0]["size"]) as f:
        extras = torch.load(f, weights_only=True)
    if "optimizer" in extras:
        _check_optimizer(extras["optimizer"], job, folder)
    return manifest, extras, position, source


def _check_metadata(folder: Path, manifest: dict) -> None:
    """DCP's ``.metadata`` read (with the classes it may hold only, through the confined
    opener) before anything is loaded, and every data file it names listed in the
    manifest: one it refuses leaves the job as it was, and says so."""
    import pickle

    try:
        metadata = confined_reader(folder, manifest).read_metadata()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{folder}/.metadata was refused ({e}); nothing was loaded, the job is as it was"
        ) from None
    listed = {e["name"] for e in manifest["files"]}
    for info in (metadata.storage_data or {}).values():
        if info.relative_path not in listed:
            raise CheckpointError(
                f"{folder}/.metadata names {info.relative_path!r}, a file the manifest does "
                "not list: refused; nothing was loaded, the job is as it was"
            )


def confined_reader(folder: Path, manifest: dict):
    """DCP's reader of ``folder`` that opens only the files the manifest lists, each
    confined (no link followed, no FIFO waited on, a regular file of its listed size,
    never read past it: ``records.checkpoints.open_confined``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from dtlab.agent.dcp_io import SafeFileSystemReader

    sizes = {e["name"]: e["size"] for e in manifest["files"]}

    class ConfinedFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode: str):
            path = Path(path)
            if mode != "rb" or path.parent != folder or path.name not in sizes:
                raise CheckpointError(
                    f"{path}: DCP asked for a file the manifest of {folder} does not list "
                    f"(mode {mode!r}): refused"
                )
            with open_confined(folder, path.name, size=sizes[path.name]) as stream:
                yield stream

    reader = SafeFileSystemReader(str(folder))
    reader.fs = ConfinedFileSystem()
    return reader


def _check_model(manifest: dict, job, folder: Path, source: int) -> None:
    model = manifest["model"]
    listed = model.get("params_by_rank", {}).get(str(source), model["params"])
    saved = {name: tuple(shape) for name, shape in listed}
    here = {name: tuple(p.shape) for name, p in job.module.named_parameters()}
    if saved == here:
        return
    only_saved = sorted(set(saved) - set(here))[:3]
    only_here = sorted(set(here) - set(saved))[:3]
    shapes = [
        f"{n} is {saved[n]} there, {here[n]} here"
        for n in sorted(set(saved) & set(here))
        if saved[n] != here[n]
    ][:3]
    detail = "; ".join(
        ([f"only in the checkpoint: {only_saved}"] if only_saved else [])
        + ([f"only in the job: {only_here}"] if only_here else [])
        + shapes
    )
    raise CheckpointError(f"{folder} is from another model ({manifest['model']['name']}; {detail})")


def _check_optimizer(saved: dict, job, folder: Path) -> None:
    groups = [g["params"] for g in saved["groups"]]
    here = [[n for n in group] for group in _groups_by_name(job)]
    if [sorted(g) for g in groups] != [sorted(g) for g in here]:
        raise CheckpointError(
            f"{folder}: the optimizer's parameter groups differ from the job's "
            f"({len(groups)} groups of {[len(g) for g in groups]} parameters there, "
            f"{len(here)} of {[len(g) for g in here]} here)"
        )
    keys = {k for state in saved["shapes"].values() for k in state}
    live, _ = parts.optimizer_split(job)
    kinds = {k for state in live.values() for k in state}
    if kinds and keys and kinds != keys:
        kind = type(parts.local_optimizer(job)).__name__
        raise CheckpointError(
            f"{folder}: the optimizer state holds {sorted(keys)}, this "
            f"job's {kind} {sorted(kinds)}: another optimizer"
        )


def _groups_by_name(job) -> list[list[str]]:
    names = {id(p): n for n, p in job.module.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in parts.local_optimizer(job).param_groups]


def _position(manifest: dict, job, world_size: int) -> tuple[int, int] | None:
    """(epoch, batch offset) here, from rank 0's saved position; by samples when the
    world size or the batch size changed (4 ranks x 8 = 2 ranks x 16 samples a step)."""
    data = manifest["ranks"]["0"].get("data")
    if data is None:
        return None
    saved_world, batch, new_batch = (
        manifest["world_size"],
        data.get("batch_size"),
        parts.batch_size(job),
    )
    if saved_world == world_size and batch == new_batch:
        return data["epoch"], data["offset"]
    if batch is None or new_batch is None:
        raise CheckpointError(
            f"cannot carry the data position from {saved_world} to {world_size} ranks: the "
            "data has no batch_size to convert batches with"
        )
    samples = data["offset"] * batch * saved_world
    if samples % (new_batch * world_size):
        per_step = batch * saved_world
        hint = (
            f"; a per-rank batch of {per_step // world_size} keeps the steps equal"
            if per_step % world_size == 0
            else ""
        )
        raise CheckpointError(
            f"cannot carry the data position from {saved_world} ranks x {batch} samples to "
            f"{world_size} x {new_batch}: {samples} samples is not a whole number of steps{hint}"
        )
    return data["epoch"], samples // (new_batch * world_size)


def _targets(job, manifest: dict, extras: dict, source: int) -> dict:
    """Where DCP reads the tensors to: the model's own parameters and buffers, and the
    optimizer's own state tensors where they have the saved shape (new ones elsewhere,
    e.g. a fresh optimizer that has no state yet). Per-rank keys when the checkpoint kept
    each rank's tensors apart."""
    tensors = {}
    if "model" in extras["parts"]:
        tensors["model"] = parts.model_state(job)
    if "optimizer" in extras["parts"]:
        live, _ = parts.optimizer_split(job)
        params = dict(job.module.named_parameters())
        tensors["optim"] = {
            name: {
                k: _reuse(live.get(name, {}).get(k), shape, dtype, params.get(name))
                for k, (shape, dtype) in s.items()
            }
            for name, s in extras["optimizer"]["shapes"].items()
        }
    if manifest.get("replicated", True):
        return tensors
    return {key: {str(source): value} for key, value in tensors.items()}


def _reuse(tensor, shape: list[int], dtype: str, param=None):
    kind = getattr(torch, dtype)
    if tensor is not None and list(tensor.shape) == shape and tensor.dtype == kind:
        return tensor
    if param is not None and hasattr(param, "to_local") and list(param.shape) == shape:
        # state of a sharded (FSDP2) parameter: sharded like it, so DCP reads this rank's part
        return torch.zeros_like(param, dtype=kind)
    return torch.empty(shape, dtype=kind)


def _apply(job, tensors: dict, extras: dict, position, same_world: bool) -> list[str]:
    """``tensors`` as read (per-rank keys taken off)."""
    restored = ["model"] if "model" in tensors else []  # read in place already
    if "optim" in tensors:
        index = {name: i for i, name in enumerate(parts.optimizer_names(job))}
        plain = extras["optimizer"]
        state = {index[n]: {**t, **plain["state"].get(n, {})} for n, t in tensors["optim"].items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in plain["groups"]]
        local = parts.local_optimizer(job)
        local.load_state_dict({"state": state, "param_groups": groups})
        if local is not job.optimizer:  # ZeRO copies its own groups' settings down each step
            for outer, inner in zip(job.optimizer.param_groups, local.param_groups, strict=True):
                outer.update({k: v for k, v in inner.items() if k != "params"})
        restored.append("optimizer")
    for part, target in (("scheduler", job.scheduler), ("scaler", job.scaler)):
        if part in extras and target is not None:
            target.load_state_dict(extras[part])
            restored.append(part)
    job.step_count = extras["step"]
    job.records.clear()  # they belong to the timeline this load leaves
    if position is not None:
        job.stream.seek(*position, extras.get("epoch_rng") if same_world else None)
        restored.append("data")
    if same_world:  # last: seeking re-made the data iterator
        restored.extend(rng.restore(extras["rng"]))
    return restored

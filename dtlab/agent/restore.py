"""Load a dtlab checkpoint into the attached job, on every rank at once.

Stages, each ended by all ranks agreeing (one all_gather), so that a checkpoint refused on
one rank is refused on all and no rank's job has changed:

1. check: the manifest, the model (names and shapes), the world size (RNG streams are per
   rank; the data position is converted to another world size when batches allow), and
   this rank's share of the files (size and checksum), and read ``rank-R.pt``
   (``weights_only``);
2. read the tensors (``torch.distributed.checkpoint``, any world size) straight into the
   model's parameters and the optimizer's state: only files that every rank has just
   verified, so only an I/O error mid-read can leave the job half-loaded (the error says
   so); fresh buffers for everything would cost a copy of the whole state (~1.3x the read);
3. apply: model, optimizer, scheduler, scaler, step counter, data position, and the RNGs
   last (re-creating the data iterator draws from torch's RNG).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dtlab.agent import job as jobs
from dtlab.agent import rng
from dtlab.agent.checkpoint import (
    PARTS,
    _batch_size,
    _gather,
    _group,
    _optimizer_names,
    _optimizer_split,
    failure_text,
)
from dtlab.agent.rendezvous import identity
from dtlab.checkpoint_format import CheckpointError, file_problem, read_manifest


def load(path: str) -> dict:
    """Replace this rank's job state with the checkpoint at ``path`` (every rank).

    Returns ``{"step", "restored": parts, "missing": parts the checkpoint lacks,
    "notes": [...]}``; raises CheckpointError (job unchanged) when it must not be loaded.
    """
    import torch.distributed.checkpoint as dcp

    from dtlab.agent.dcp_io import SafeFileSystemReader

    job, me = jobs.current(), identity()
    folder = Path(path)
    manifest, position, error = None, None, None
    try:
        manifest = read_manifest(folder)
        _check_model(manifest, job, folder)
        position = _position(manifest, job, me.world_size)
        files = manifest["files"]
        mine = [e for i, e in enumerate(files) if i % me.world_size == me.rank]
        error = "; ".join(p for p in (file_problem(folder, e) for e in mine) if p) or None
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = _say(e, folder)
    _agree(error, folder)

    source = me.rank if me.rank < manifest["world_size"] else 0
    try:
        extras = torch.load(folder / f"rank-{source}.pt", weights_only=True)
        tensors = _targets(job, extras)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = _say(e, folder)
    _agree(error, folder)
    try:  # a collective: when one rank's read fails, all raise
        if tensors:
            dcp.load(tensors, storage_reader=SafeFileSystemReader(str(folder)),
                     process_group=_group())  # fmt: skip
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = _say(e, folder)
    _agree(
        error,
        folder,
        after="verified files could not be read; the model and optimizer "
        "may be partly overwritten: load another checkpoint",
    )

    same_world = manifest["world_size"] == me.world_size
    restored = _apply(job, tensors, extras, position, same_world)
    notes = [] if same_world else [
        f"world size {manifest['world_size']} -> {me.world_size}: RNG streams are per rank "
        "and were not restored; the data position was converted"
    ]  # fmt: skip
    missing = [p for p in PARTS if p not in extras["parts"]]
    return {"step": job.step_count, "restored": restored, "missing": missing, "notes": notes}


def _say(e: BaseException, folder: Path) -> str:
    if isinstance(e, KeyboardInterrupt):
        raise e
    return failure_text(e, folder)


def _agree(error: str | None, folder: Path, *, after: str | None = None) -> None:
    errors = _gather(error)
    said = [e for e in dict.fromkeys(errors) if e]
    if said and after:
        raise CheckpointError(f"checkpoint {folder}: {after} ({'; '.join(said)})")
    if said:
        raise CheckpointError(
            f"checkpoint {folder} refused: {'; '.join(said)}. The job is unchanged; "
            "dt.checkpoints() lists the others"
        )


def _check_model(manifest: dict, job, folder: Path) -> None:
    saved = {name: tuple(shape) for name, shape in manifest["model"]["params"]}
    here = {name: tuple(p.shape) for name, p in job.module.named_parameters()}
    if saved == here:
        return
    only_saved = sorted(set(saved) - set(here))[:3]
    only_here = sorted(set(here) - set(saved))[:3]
    shapes = [f"{n} is {saved[n]} there, {here[n]} here"
              for n in sorted(set(saved) & set(here)) if saved[n] != here[n]][:3]  # fmt: skip
    detail = "; ".join(
        ([f"only in the checkpoint: {only_saved}"] if only_saved else [])
        + ([f"only in the job: {only_here}"] if only_here else [])
        + shapes
    )
    raise CheckpointError(f"{folder} is from another model ({manifest['model']['name']}; {detail})")


def _position(manifest: dict, job, world_size: int) -> tuple[int, int] | None:
    """(epoch, batch offset) for this world size, from rank 0's saved position."""
    data = manifest["ranks"]["0"].get("data")
    if data is None:
        return None
    saved_world = manifest["world_size"]
    if saved_world == world_size:
        return data["epoch"], data["offset"]
    # resharded: the same samples per step overall, e.g. 4 ranks x 8 = 2 ranks x 16
    batch, new_batch = data.get("batch_size"), _batch_size(job)
    if batch is None or new_batch is None:
        raise CheckpointError(
            f"cannot carry the data position from {saved_world} to {world_size} ranks: the "
            "data has no batch_size to convert batches with"
        )
    samples = data["offset"] * batch * saved_world
    if samples % (new_batch * world_size):
        raise CheckpointError(
            f"cannot carry the data position from {saved_world} ranks x {batch} samples to "
            f"{world_size} x {new_batch}: {samples} samples is not a whole number of steps; "
            f"a per-rank batch of {batch * saved_world // world_size} keeps the steps equal"
        )
    return data["epoch"], samples // (new_batch * world_size)


def _targets(job, extras: dict) -> dict:
    """Where DCP reads the tensors to: the model's own parameters and buffers, and the
    optimizer's own state tensors where they have the saved shape (new ones elsewhere,
    e.g. a fresh optimizer that has no state yet)."""
    tensors = {}
    if "model" in extras["parts"]:
        tensors["model"] = {k: v.detach() for k, v in job.module.state_dict().items()}
    if "optimizer" in extras["parts"]:
        live, _ = _optimizer_split(job)
        tensors["optim"] = {
            name: {k: _reuse(live.get(name, {}).get(k), shape, dtype)
                   for k, (shape, dtype) in s.items()}
            for name, s in extras["optimizer"]["shapes"].items()
        }  # fmt: skip
    return tensors


def _reuse(tensor, shape: list[int], dtype: str):
    if tensor is not None and list(tensor.shape) == shape and tensor.dtype == getattr(torch, dtype):
        return tensor
    return torch.empty(shape, dtype=getattr(torch, dtype))


def _apply(job, tensors: dict, extras: dict, position, same_world: bool) -> list[str]:
    restored = []
    if "model" in tensors:  # read in place already
        restored.append("model")
    if "optim" in tensors:
        index = {name: i for i, name in enumerate(_optimizer_names(job))}
        plain = extras["optimizer"]
        state = {index[n]: {**t, **plain["state"].get(n, {})} for n, t in tensors["optim"].items()}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in plain["groups"]]
        job.optimizer.load_state_dict({"state": state, "param_groups": groups})
        restored.append("optimizer")
    for part, target in (("scheduler", job.scheduler), ("scaler", job.scaler)):
        if part in extras and target is not None:
            target.load_state_dict(extras[part])
            restored.append(part)
    job.step_count = extras["step"]
    job.records.clear()  # they belong to the timeline this load leaves
    if position is not None:
        job.seek(*position)
        restored.append("data")
    if same_world:  # last: seeking re-created the data iterator, which draws from torch's
        restored.extend(rng.restore(extras["rng"]))
    return restored

"""What a checkpoint holds of the attached job, and the collectives save and load share.

Tensors (model, optimizer state) go to ``torch.distributed.checkpoint``; everything else
(RNGs, the data position, scheduler, GradScaler, optimizer hyper-parameters) goes to the
rank's own ``rank-R.pt`` as tensors and plain data, readable with ``weights_only=True``.
"""

from __future__ import annotations

import io

import torch
import xxhash

from dtlab.agent import rng
from dtlab.agent.groups import control_group
from dtlab.agent.recorder import fingerprint
from dtlab.records.checkpoints import CheckpointError

PARTS = ("model", "optimizer", "scheduler", "scaler", "data", *rng.NAMES)


# --- collectives on dtlab's own gloo group (agent/groups.py: CPU objects, NCCL jobs too) -
def gather(obj) -> list:
    """``obj`` of every rank, in rank order (every rank must call it)."""
    group = control_group()
    if group is None:
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --- the parts ----------------------------------------------------------------------------
def local_optimizer(job):
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer keeps only its
    shard's, in the optimizer it wraps (its own state_dict would gather every rank's)."""
    return getattr(job.optimizer, "optim", job.optimizer)


def optimizer_names(job) -> list[str]:
    """Parameter names in the optimizer's own order (its state_dict numbers them)."""
    names = {id(p): n for n, p in job.module.named_parameters()}
    return [names[id(p)] for g in local_optimizer(job).param_groups for p in g["params"]]


def optimizer_split(job) -> tuple[dict, dict]:
    """(state tensors by parameter name, plain data) of this rank's optimizer state."""
    sd = local_optimizer(job).state_dict()
    names = optimizer_names(job)
    tensors, plain = {}, {}
    for index, state in sd["state"].items():
        name = names[index]
        tensors[name] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        plain[name] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    if local_optimizer(job) is not job.optimizer:  # ZeRO: its own groups are up to date (the
        # scheduler sets them; the wrapped optimizer's follow only at the next step)
        for group, outer in zip(groups, job.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in outer.items() if k != "params"})
    return tensors, {"groups": groups, "state": plain}


def model_state(job) -> dict[str, torch.Tensor]:
    """The model's tensors, as DCP writes them and reads them back in place. FSDP1: each
    unit's flat shard as this rank holds it and the buffers, not ``state_dict()`` (whose
    FSDP hooks would gather the nested units' parameters whole, every rank a copy)."""
    if getattr(job, "flat", None) is not None:
        from dtlab.agent.fsdp1 import clean

        buffers = {clean(k): b.detach() for k, b in job.module.named_buffers()}
        return {**job.flat.flat_state(), **buffers}
    return {k: v.detach() for k, v in job.module.state_dict().items()}


def model_hash(job) -> int:
    """One number for the model's parameters and buffers: equal on every rank when they
    are replicated (XXH3 of the bytes, ~10 GB/s; a fingerprint on GPU)."""
    hasher = xxhash.xxh3_64()
    for tensor in model_state(job).values():
        if hasattr(tensor, "to_local"):
            continue  # a shard (FSDP2): different on every rank by design; DCP keeps its layout
        # (an FSDP1 flat shard is a plain tensor: its ranks differ, so the save is per rank)
        if tensor.device.type == "cpu":
            hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy())
        else:
            hasher.update(fingerprint(tensor).to_bytes(8, "little"))
    return hasher.intdigest()


def tensor_state(job, omit: set[str], rank: int | None) -> dict:
    """What DCP writes; under ``"{rank}"`` keys when ranks hold different tensors (DCP
    keeps one copy of a key it sees on several ranks)."""
    state = {}
    if "model" not in omit:
        state["model"] = model_state(job)
    if "optimizer" not in omit:
        state["optim"], _ = optimizer_split(job)
    return state if rank is None else {key: {str(rank): value} for key, value in state.items()}


def batch_size(job) -> int | None:
    size = getattr(job.data, "batch_size", None)
    return int(size) if isinstance(size, int) else None


def extras(job, omit: set[str]) -> dict:
    found: dict = {"step": job.step_count, "parts": [p for p in PARTS if p not in omit]}
    if "data" not in omit:
        stream = job.stream
        found["data"] = {
            "epoch": stream.epoch,
            "offset": stream.offset,
            "batch_size": batch_size(job),
        }
        # the RNGs as the epoch's data iterator was made (it draws from torch's)
        found["epoch_rng"] = {k: v for k, v in stream.epoch_rng.items() if k not in omit}
    found["rng"] = {k: v for k, v in rng.capture().items() if k not in omit}
    if "scheduler" not in omit and job.scheduler is not None:
        found["scheduler"] = job.scheduler.state_dict()
    if "scaler" not in omit and job.scaler is not None:
        found["scaler"] = job.scaler.state_dict()
    if "optimizer" not in omit:
        tensors, found["optimizer"] = optimizer_split(job)
        found["optimizer"]["shapes"] = {
            name: {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in s.items()}
            for name, s in tensors.items()
        }
    return found


def safe_bytes(found: dict, rank: int) -> bytes:
    """``found`` as torch.save bytes, refused now if weights_only loading could not read
    them back (a scheduler holding a lambda object, say)."""
    buffer = io.BytesIO()
    torch.save(found, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"rank {rank}: the job's non-tensor state holds objects dtlab cannot store "
            f"safely ({e}); keep scheduler and scaler state to tensors and plain data"
        ) from None
    return buffer.getvalue()

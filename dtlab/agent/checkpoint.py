"""Full-state checkpoints of the attached job, written and read by every rank at once.

Save (:func:`save`, called on all ranks with the same arguments):

1. model and optimizer tensors -> ``torch.distributed.checkpoint`` (each replicated
   tensor written once, by one rank; loadable at another world size);
2. everything else the step depends on (every RNG, the data position, scheduler,
   GradScaler, optimizer hyper-parameters, the step counter) -> ``rank-R.pt``, tensors
   and plain data only;
3. each rank's files are fsynced and checksummed (XXH3-64, as they are written); all
   ranks report (one all_gather);
4. rank 0 writes ``manifest.json`` and renames the partial folder into place, or
   removes it when any rank failed. Until that rename, the checkpoint does not exist.

Load (:func:`load`): manifest -> same model? -> every file's size and checksum (shared out
across ranks) -> all ranks agree -> tensors read into fresh memory -> all ranks agree ->
only then is the job's state replaced. A refused checkpoint leaves the job as it was.

Nothing is unpickled beyond tensors and plain data: ``rank-R.pt`` is read with
``weights_only=True`` and DCP's ``.metadata`` with an unpickler that knows only DCP's own
metadata classes (:mod:`dtlab.agent.dcp_io`).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from dtlab.agent import job as jobs
from dtlab.agent import rng
from dtlab.agent.dcp_io import ChecksummingFileSystem
from dtlab.agent.rendezvous import identity
from dtlab.checkpoint_format import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    checksum_text,
    file_checksum,
    final_name,
    fsync_dir,
    partial_name,
    write_atomic,
)

PARTS = ("model", "optimizer", "scheduler", "scaler", "data", *rng.NAMES)

# Fault injection (dtlab.inject): parts this rank leaves out of its saves, and a function
# run between writing and committing (to die or stall mid-save on purpose).
omitted: set[str] = set()
before_commit: Callable[[], None] | None = None


def failure_text(e: BaseException, folder: Path) -> str:
    """What went wrong, by rank: DCP gathers every rank's failure into one exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        said = [f"rank {r}: {type(exc).__name__}: {str(exc).strip()}"
                for r, (exc, _) in sorted(e.failures.items())]  # fmt: skip
        text = "; ".join(said)
    elif isinstance(e, CheckpointError):
        return str(e)
    else:
        text = f"{type(e).__name__}: {e}"
    if "unexpected pos" in text or "No space" in text or "too large" in text:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        text += (f" (a write into {folder} came up short: a full disk or a file size limit? "
                 f"{free / 2**30:.1f} GiB free there)")  # fmt: skip
    return text


# --- collective helpers (the stepping channel's gloo group: CPU objects, NCCL jobs too)
def _group():
    from dtlab.agent.stepping import _control_group

    return _control_group()


def _gather(obj) -> list:
    group = _group()
    if group is None:
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --- what is saved --------------------------------------------------------------------
def _optimizer_names(job) -> list[str]:
    """Parameter names in the optimizer's own order (its state_dict numbers them)."""
    names = {id(p): n for n, p in job.module.named_parameters()}
    return [names[id(p)] for g in job.optimizer.param_groups for p in g["params"]]


def _optimizer_split(job) -> tuple[dict, dict]:
    """(tensors by parameter name, plain data) of the optimizer's state."""
    sd = job.optimizer.state_dict()
    names = _optimizer_names(job)
    tensors, plain = {}, {}
    for index, state in sd["state"].items():
        name = names[index]
        tensors[name] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        plain[name] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return tensors, {"groups": groups, "state": plain}


def _tensor_state(job, omit: set[str]) -> dict:
    state = {}
    if "model" not in omit:
        state["model"] = {k: v.detach() for k, v in job.module.state_dict().items()}
    if "optimizer" not in omit:
        state["optim"], _ = _optimizer_split(job)
    return state


def _batch_size(job) -> int | None:
    size = getattr(job.data, "batch_size", None)
    return int(size) if isinstance(size, int) else None


def _extras(job, omit: set[str]) -> dict:
    extras: dict = {"step": job.step_count, "parts": [p for p in PARTS if p not in omit]}
    if "data" not in omit:
        extras["data"] = {"epoch": job.epoch, "offset": job.offset,
                          "batch_size": _batch_size(job), "accumulate": job.accumulate}  # fmt: skip
    extras["rng"] = {k: v for k, v in rng.capture().items() if k not in omit}
    if "scheduler" not in omit and job.scheduler is not None:
        extras["scheduler"] = job.scheduler.state_dict()
    if "scaler" not in omit and job.scaler is not None:
        extras["scaler"] = job.scaler.state_dict()
    if "optimizer" not in omit:
        tensors, extras["optimizer"] = _optimizer_split(job)
        extras["optimizer"]["shapes"] = {
            name: {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in s.items()}
            for name, s in tensors.items()
        }
    return extras


def _safe_bytes(extras: dict, rank: int) -> bytes:
    """``extras`` as torch.save bytes, refused now if weights_only loading could not read
    them back (a scheduler holding a lambda object, say)."""
    buffer = io.BytesIO()
    torch.save(extras, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"rank {rank}: the job's non-tensor state holds objects dtlab cannot store "
            f"safely ({e}); keep scheduler and scaler state to tensors and plain data"
        ) from None
    return buffer.getvalue()


# --- save -----------------------------------------------------------------------------
def save(root: str, token: str, *, tag: str | None = None) -> dict:
    """Write a checkpoint of this rank's job under ``root`` (every rank, same arguments).
    Returns ``{"path", "step", "bytes", "seconds"}``; raises CheckpointError naming each
    rank that failed (then nothing was committed)."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    job, me = jobs.current(), identity()
    root_path = Path(root)
    folder = root_path / partial_name(job.step_count, token)
    omit = set(omitted)
    try:  # first what can fail on one rank alone: all must know before the collective
        folder.mkdir(parents=True, exist_ok=True)
        state = _tensor_state(job, omit)
        extras = _safe_bytes(_extras(job, omit), me.rank)
        problem = None
    except Exception as e:
        problem = failure_text(e, folder)
    problems = _gather({"rank": me.rank, "error": problem})
    report: dict = {"rank": me.rank, "error": None, "files": []}
    if not any(p["error"] for p in problems):
        try:
            writer = dcp.FileSystemWriter(str(folder), sync_files=True)
            writer.fs = written = ChecksummingFileSystem()  # checksums without reading back
            dcp.save(state, storage_writer=writer, process_group=_group())  # raises on all
            write_atomic(folder / f"rank-{me.rank}.pt", extras)
            if before_commit is not None:
                before_commit()
            written.sums[str(folder / f"rank-{me.rank}.pt")] = xxhash.xxh3_64_intdigest(extras)
            report["files"] = _describe_files(folder, me.rank, written.sums)
            report["loss"] = job.records[-1].loss if job.records else None
            report["data"] = (
                None
                if "data" in omit
                else {"epoch": job.epoch, "offset": job.offset, "batch_size": _batch_size(job)}
            )
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            report["error"] = failure_text(e, folder)
        reports = _gather(report)
    else:
        reports = problems
    failed = [r for r in reports if r["error"]]
    path = _commit(root_path, folder, job, reports, tag) if me.rank == 0 and not failed else None
    if me.rank == 0 and failed:
        shutil.rmtree(folder, ignore_errors=True)  # the previous checkpoints stay as they are
    path = _gather(path)[0]  # every rank returns once the checkpoint exists (or not)
    if failed or path is None:
        said = "; ".join(_by_error(failed))
        raise CheckpointError(
            f"checkpoint of step {job.step_count} not written "
            f"({said or 'rank 0 could not commit it'}); earlier checkpoints are untouched "
            "and the job goes on"
        )
    mine = sum(f["size"] for f in report["files"])
    return {"path": path, "step": job.step_count, "bytes": mine,
            "seconds": time.perf_counter() - t0}  # fmt: skip


def _by_error(failed: list[dict]) -> list[str]:
    """One line per distinct error; DCP's name the failing ranks themselves."""
    texts: dict[str, list[int]] = {}
    for r in failed:
        texts.setdefault(r["error"], []).append(r["rank"])
    return [t if t.startswith("rank ") else f"ranks {ranks}: {t}" if len(ranks) > 1
            else f"rank {ranks[0]}: {t}" for t, ranks in texts.items()]  # fmt: skip


def _describe_files(folder: Path, rank: int, sums: dict[str, int]) -> list[dict]:
    """This rank's files with size and checksum (known from writing them; else read)."""
    names = [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_")]
    names.append(f"rank-{rank}.pt")
    if rank == 0:
        names.append(".metadata")  # DCP's coordinator wrote it when dcp.save returned
    files = []
    for name in sorted(names):
        path = folder / name
        known = sums.get(str(path))
        digest = checksum_text(known) if known is not None else file_checksum(path)
        files.append({"name": name, "rank": rank, "size": path.stat().st_size, "xxh3": digest})
    return files


def _commit(root: Path, folder: Path, job, reports: list[dict], tag: str | None) -> str | None:
    try:
        losses = [r["loss"] for r in reports if r["loss"] is not None]
        manifest = {
            "format": FORMAT,
            "step": job.step_count,
            "created": time.time(),
            "world_size": len(reports),
            "loss": sum(losses) / len(losses) if losses else None,
            "tag": tag,
            "model": {"name": type(job.module).__name__,
                      "params": [[n, list(p.shape)] for n, p in job.module.named_parameters()]},
            "files": [f for r in reports for f in r["files"]],
            "ranks": {str(r["rank"]): {"data": r["data"]} for r in reports},
        }  # fmt: skip
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(folder)
        final = root / final_name(root, job.step_count)
        folder.rename(final)
        fsync_dir(root)
        return str(final)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        return None

"""Save a full-state checkpoint of the attached job, written by every rank at once.

Stages of :func:`save` (called on all ranks with the same arguments), each ended by all
ranks agreeing in one all_gather, so that every rank takes the same path:

1. prepare: the partial folder, the parts (:mod:`dtlab.agent.checkpoint_state`), and a
   hash of the model; the ranks check they are at the same step, and whether their model
   tensors are replicated (else each rank's are saved under its own key: DCP would keep
   one copy of a key that several ranks write, and quietly merge diverged ranks);
2. write: model and optimizer tensors through ``torch.distributed.checkpoint``, the rest
   to ``rank-R.pt``; every file fsynced, its XXH3-64 taken as it is written;
3. commit (rank 0): ``manifest.json`` (files, sizes, checksums, writer ranks), then the
   partial folder renamed into place. Until that rename the checkpoint does not exist; a
   failure on any rank removes the partial folder instead.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from dtlab.agent import checkpoint_state as parts
from dtlab.agent import job as jobs
from dtlab.agent.dcp_io import ChecksummingFileSystem
from dtlab.agent.groups import control_group
from dtlab.agent.rendezvous import identity
from dtlab.agent.state import RANK
from dtlab.analysis.ranks import label_ranks
from dtlab.records.checkpoints import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    checksum_text,
    file_checksum,
    fsync_dir,
    partial_name,
    write_atomic,
)
from dtlab.records.checkpoints import commit as commit_folder

PARTS = parts.PARTS

_WRITE_SHORT = ("unexpected pos", "No space left", "File too large", "Disk quota exceeded")


def failure_text(e: BaseException, folder: Path) -> str:
    """What went wrong, by rank: DCP gathers every rank's failure into one exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointError):
        return str(e)
    if isinstance(e, CheckpointException):
        text = "; ".join(
            f"rank {r}: {type(exc).__name__}: {str(exc).strip()}"
            for r, (exc, _) in sorted(e.failures.items())
        )
    else:
        text = f"{type(e).__name__}: {e}"
    if any(sign in text for sign in _WRITE_SHORT):
        try:
            free = f"{shutil.disk_usage(folder.parent).free / 2**30:.1f} GiB free there"
        except OSError:
            free = "free space unknown"
        text += f" (a write into {folder} came up short: a full disk or a size limit? {free})"
    return text


def attempt(action: Callable[[], object], folder: Path) -> tuple[object, str | None]:
    """(result, None) or (None, what went wrong); Ctrl-C too, so that this rank still
    meets its peers at the next all_gather instead of leaving them waiting."""
    try:
        return action(), None
    except KeyboardInterrupt:
        return None, "interrupted (KeyboardInterrupt)"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        return None, failure_text(e, folder)


def save(root: str, token: str, *, tag: str | None = None, commit: bool = True) -> dict:
    """Write a checkpoint of this rank's job under ``root`` (every rank, same arguments).
    Returns ``{"path", "step", "bytes", "seconds", "replicated", "committed"}``; raises
    CheckpointError naming each rank that failed (then nothing was committed).

    ``commit=False`` (a save asked for from the notebook): the finished folder, manifest
    written, stays ``.partial-*`` and its path is returned; the notebook renames it into
    place only once every rank has returned, so a rank that dies at any point of the save
    means no new checkpoint. ``commit=True`` (autosave during a run): rank 0 renames it."""
    t0 = time.perf_counter()
    job, me = jobs.current(), identity()
    root_path = Path(root)
    omit = set(RANK.fault_omitted_parts)  # dtlab.inject.checkpoint_without
    folder = root_path / partial_name(job.step_count, token)
    prepared, error = attempt(lambda: _prepare(job, folder, omit, me.rank), folder)
    said = parts.gather(
        {
            "rank": me.rank,
            "error": error,
            "step": job.step_count,
            "hash": prepared[2] if prepared else None,
        }
    )
    error = error or _same_step(said)
    replicated = len({r["hash"] for r in said}) == 1
    reports = [r for r in said if r["error"]]
    if not any(r["error"] for r in said) and not error:
        state, extras = prepared[0], prepared[1]
        if not replicated:
            state = parts.tensor_state(job, omit, me.rank)
        written, error = attempt(lambda: _write(job, folder, state, extras, me.rank), folder)
        reports = parts.gather(written or {"rank": me.rank, "error": error})
    failed = [r for r in reports if r.get("error")] or (
        [{"rank": None, "error": error}] if error else []  # the same on every rank
    )
    committed = None
    if me.rank == 0:
        if failed:
            shutil.rmtree(folder, ignore_errors=True)  # the earlier checkpoints stay as they are
        else:
            committed = _commit(root_path, folder, job, reports, tag, replicated, commit)
    if RANK.fault_after_commit is not None:  # dtlab.inject: between commit and the end
        RANK.fault_after_commit()
    path, why = parts.gather(committed or (None, None))[0]
    if failed or path is None:
        said = "; ".join(_by_error(failed)) or f"rank 0 could not commit it: {why}"
        raise CheckpointError(
            f"checkpoint of step {job.step_count} not written ({said}); "
            "earlier checkpoints are untouched and the job goes on"
        )
    mine = sum(f["size"] for f in next(r for r in reports if r["rank"] == me.rank)["files"])
    return {
        "path": path,
        "step": job.step_count,
        "bytes": mine,
        "replicated": replicated,
        "seconds": time.perf_counter() - t0,
        "committed": commit,
    }


def _prepare(job, folder: Path, omit: set[str], rank: int) -> tuple[dict, bytes, int]:
    if job.checkpoint_problem:  # said by every rank alike, nothing written
        raise CheckpointError(job.checkpoint_problem)
    folder.mkdir(parents=True, exist_ok=True)
    state = parts.tensor_state(job, omit, None)
    extras = parts.safe_bytes(parts.extras(job, omit), rank)
    return state, extras, parts.model_hash(job)


def _same_step(said: list[dict]) -> str | None:
    steps = {r["step"] for r in said}
    if len(steps) == 1:
        return None
    by_rank = ", ".join(f"rank {r['rank']} at {r['step']}" for r in said)
    return f"the ranks are not at the same step ({by_rank}): run %dt_step on every rank first"


def _write(job, folder: Path, state: dict, extras: bytes, rank: int) -> dict:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(folder), sync_files=True)
    writer.fs = written = ChecksummingFileSystem()  # checksums without reading back
    group = control_group()  # None: one process, no collective to make
    dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    write_atomic(folder / f"rank-{rank}.pt", extras)
    written.sums[str(folder / f"rank-{rank}.pt")] = xxhash.xxh3_64_intdigest(extras)
    if RANK.fault_before_commit is not None:  # dtlab.inject: to die or stall mid-save
        RANK.fault_before_commit()
    data = None
    if "data" not in RANK.fault_omitted_parts:
        data = {
            "epoch": job.stream.epoch,
            "offset": job.stream.offset,
            "batch_size": parts.batch_size(job),
        }
    return {
        "rank": rank,
        "error": None,
        "files": _describe_files(folder, rank, written.sums),
        "loss": job.records[-1].loss if job.records else None,
        "data": data,
        "params": [[n, list(p.shape)] for n, p in job.module.named_parameters()],
    }


def _by_error(failed: list[dict]) -> list[str]:
    """One line per distinct error; DCP's name the failing ranks themselves."""
    texts: dict[str, list[int]] = {}
    for r in failed:
        texts.setdefault(r["error"], []).append(r["rank"])
    lines = []
    for text, ranks in texts.items():
        if text.startswith("rank ") or ranks == [None]:
            lines.append(text)
        else:
            lines.append(f"{label_ranks(ranks)}: {text}")
    return lines


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


def _commit(
    root: Path,
    folder: Path,
    job,
    reports: list[dict],
    tag: str | None,
    replicated: bool,
    rename: bool,
) -> tuple[str | None, str | None]:
    """(final path, or with ``rename`` False the finished partial folder's, None), or
    (None, why) with the partial folder removed."""
    try:
        files = [f for r in reports for f in r["files"]]
        for f in files:  # every rank wrote into this very folder
            if (folder / f["name"]).stat().st_size != f["size"]:
                raise CheckpointError(
                    f"{folder / f['name']} changed size since rank {f['rank']} wrote it"
                )
        manifest = _manifest(job, reports, tag, replicated, files)
        write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(folder)
        if not rename:
            return str(folder), None
        return str(commit_folder(root, folder, job.step_count)), None
    except Exception as e:
        shutil.rmtree(folder, ignore_errors=True)
        return None, f"{type(e).__name__}: {e}"


def _manifest(job, reports: list[dict], tag, replicated: bool, files: list[dict]) -> dict:
    losses = [r["loss"] for r in reports if r["loss"] is not None]
    return {
        "format": FORMAT,
        "step": job.step_count,
        "created": time.time(),
        "world_size": len(reports),
        "loss": sum(losses) / len(losses) if losses else None,
        "tag": tag,
        "replicated": replicated,  # False: model and optimizer saved per rank
        "model": _model_entry(job, reports),
        "files": files,
        "ranks": {str(r["rank"]): {"data": r["data"]} for r in reports},
    }


def _model_entry(job, reports: list[dict]) -> dict:
    """The model's parameter names and shapes; per rank when ranks hold different ones
    (pipeline stages), so each rank's load checks its own."""
    entry = {"name": type(job.module).__name__, "params": reports[0]["params"]}
    if any(r["params"] != reports[0]["params"] for r in reports):
        entry["params_by_rank"] = {str(r["rank"]): r["params"] for r in reports}
    return entry

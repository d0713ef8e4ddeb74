"""dtlab's checkpoint folders on disk: names, manifest, checksums, and the catalogue.

Shared by the ranks (which write and verify) and the notebook (which lists); it needs
neither torch nor a cluster. A checkpoint is one folder under the checkpoint root::

    step-0000040/                 complete: renamed into place only after every rank wrote
        manifest.json             step, loss, world size, model, every file with its
                                  size, XXH3-64 checksum and writer rank, the data position
        .metadata, __R_0.distcp   model and optimizer tensors (torch.distributed.checkpoint)
        rank-R.pt                 RNGs, data position, scheduler, scaler, optimizer groups:
                                  tensors and plain data, read with weights_only=True
    .partial-step-0000050-TOKEN/  a save that has not finished (or never will): never loaded

The XXH3-64 checksum finds truncation and corruption at ~10 GB/s (CRC-32 runs at 3, SHA-256
at 1.4 here); it is no defence against tampering: loading never unpickles arbitrary objects
instead.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

FORMAT = 1
MANIFEST = "manifest.json"
PARTIAL_PREFIX = ".partial-"
_FINAL = re.compile(r"^step-(\d{7})(?:-(\d+))?$")
_PARTIAL = re.compile(r"^\.partial-step-(\d{7})-")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be loaded; the message names the
    checkpoint, the file and the rank, and what to do."""


def partial_name(step: int, token: str) -> str:
    return f"{PARTIAL_PREFIX}step-{step:07d}-{token}"


def final_name(root: Path, step: int) -> str:
    """``step-0000040``, or ``step-0000040-2`` when that step was saved before (a replay)."""
    name, n = f"step-{step:07d}", 1
    while (root / name).exists():
        n += 1
        name = f"step-{step:07d}-{n}"
    return name


def checksum_text(value: int) -> str:
    return f"{value:016x}"


def file_checksum(path: str | os.PathLike) -> str:
    """The XXH3-64 of a file's bytes, as 16 hex digits."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return checksum_text(hasher.intdigest())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or new file in ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` is either complete or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dtlab checkpoint manifest of format {FORMAT}")
    return manifest


def file_problem(folder: Path, entry: dict, *, checksum: bool = True) -> str | None:
    """What is wrong with one file the manifest lists (None: it is as written)."""
    path = folder / entry["name"]
    writer = f"rank {entry['rank']}'s file {path}"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{writer} is missing"
    if size != entry["size"]:
        return f"{writer} has {size} bytes, the manifest says {entry['size']} (truncated?)"
    if checksum:
        found = file_checksum(path)
        if found != entry["xxh3"]:
            return f"{writer} has checksum {found}, the manifest says {entry['xxh3']} (corrupted)"
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    """One entry of the catalogue (``dt.checkpoints()``)."""

    path: Path
    step: int
    status: str  # "complete", "corrupt" (fails its manifest), "partial" (never finished)
    created: float
    loss: float | None = None
    size_bytes: int = 0
    world_size: int | None = None
    ranks: tuple[int, ...] = ()  # ranks that wrote files into it
    tag: str | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "complete"


def describe(folder: Path, *, verify: bool = False) -> CheckpointInfo | None:
    """The catalogue entry of ``folder`` (None: not a checkpoint folder). ``verify`` reads
    every file for its checksum; otherwise sizes only."""
    partial = _PARTIAL.match(folder.name)
    if partial:
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        return CheckpointInfo(folder, int(partial.group(1)), "partial",
                              folder.stat().st_mtime, size_bytes=size,
                              problem="the save never finished (a rank died?)")  # fmt: skip
    final = _FINAL.match(folder.name)
    if not final:
        return None
    try:
        manifest = read_manifest(folder)
    except CheckpointError as e:
        return CheckpointInfo(folder, int(final.group(1)), "corrupt", folder.stat().st_mtime,
                              problem=str(e))  # fmt: skip
    files = manifest["files"]
    problems = [p for p in (file_problem(folder, e, checksum=verify) for e in files) if p]
    return CheckpointInfo(
        folder,
        manifest["step"],
        "corrupt" if problems else "complete",
        manifest["created"],
        loss=manifest.get("loss"),
        size_bytes=sum(e["size"] for e in files),
        world_size=manifest["world_size"],
        ranks=tuple(sorted({e["rank"] for e in files})),
        tag=manifest.get("tag"),
        problem="; ".join(problems) or None,
    )


def catalogue(root: str | os.PathLike, *, verify: bool = False) -> list[CheckpointInfo]:
    """Every checkpoint under ``root``, oldest step first (then oldest first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (describe(p, verify=verify) for p in root.iterdir() if p.is_dir())
    return sorted((c for c in found if c is not None), key=lambda c: (c.step, c.created))

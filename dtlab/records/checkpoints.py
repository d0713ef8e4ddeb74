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
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

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


def commit(root: Path, folder: Path, step: int) -> Path:
    """Rename a finished partial folder (its manifest written) into place as the
    checkpoint of ``step``, durably; -> its final path. Until this rename nothing of the
    save is visible: a failure before it leaves the earlier checkpoints as they were."""
    final = root / final_name(root, step)
    folder.rename(final)
    try:
        fsync_dir(root)
    except OSError:
        pass  # renamed already: the checkpoint exists; only its durability is less sure
    return final


def remove_partial(root: Path, token: str) -> list[Path]:
    """Remove what a save with ``token`` left unfinished (its .partial-* folder)."""
    gone = []
    for folder in root.glob(f"{PARTIAL_PREFIX}step-*-{token}"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def checksum_text(value: int) -> str:
    return f"{value:016x}"


def file_checksum(path: str | os.PathLike, *, limit: int | None = None) -> str:
    """The XXH3-64 of a file's bytes, as 16 hex digits. With ``limit``: a regular file
    only, opened without following a link, read no further than ``limit`` + 1 bytes (a
    file that grew since is then a mismatch, never an endless read)."""
    hasher = xxhash.xxh3_64()
    if limit is None:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                hasher.update(chunk)
        return checksum_text(hasher.intdigest())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        left = limit + 1
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            hasher.update(chunk)
            left -= len(chunk)
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


MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists files and shapes: far below this
# what dtlab writes into a checkpoint folder: one plain name, no path, no leading "."
# beyond DCP's ".metadata" (so never "..", "/etc/x", "a/../../b")
_FILE_NAME = re.compile(r"^(?:\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,200})$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``, checked whole: a manifest is untrusted input (anyone
    who can write the checkpoint root can write one). CheckpointError says what is wrong."""
    path = folder / MANIFEST
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CheckpointError(f"{path} is not a regular file (a link, device or FIFO): refused")
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is over {MAX_MANIFEST_BYTES >> 20} MiB: refused")
        manifest = json.loads(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: not a complete checkpoint") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): the checkpoint is corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dtlab checkpoint manifest of format {FORMAT}")
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{path}: {problem}: the checkpoint is corrupt (or was edited)")
    return manifest


def _is_int(value, low: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a parsed manifest's schema (None: every field dtlab reads is
    there, of its type, and every file it names is a plain name inside the folder)."""
    if not _is_int(manifest.get("step")):
        return f"'step' is {manifest.get('step')!r}, not a step number"
    if not _is_number(manifest.get("created")):
        return f"'created' is {manifest.get('created')!r}, not a time"
    world = manifest.get("world_size")
    if not _is_int(world, 1):
        return f"'world_size' is {world!r}, not a number of ranks"
    if manifest.get("loss") is not None and not _is_number(manifest["loss"]):
        return f"'loss' is {manifest['loss']!r}, not a number"
    if manifest.get("tag") is not None and not isinstance(manifest["tag"], str):
        return f"'tag' is {manifest['tag']!r}, not text"
    model = manifest.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("params"), list):
        return "'model' does not list the model's parameters"
    ranks = manifest.get("ranks")
    if not isinstance(ranks, dict) or not isinstance(ranks.get("0"), dict):
        return "'ranks' does not hold rank 0's data position"
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return f"'files' is {files!r}, not a list of files"
    for entry in files:
        problem = _entry_problem(entry, world)
        if problem:
            return problem
    return None


def _entry_problem(entry, world_size: int) -> str | None:
    if not isinstance(entry, dict):
        return f"a file entry is {entry!r}, not a file"
    name = entry.get("name")
    if not isinstance(name, str) or not _FILE_NAME.match(name):
        return (
            f"file name {name!r} is not a plain name inside the checkpoint folder "
            "(a path, '..' or an odd character): refused"
        )
    if not _is_int(entry.get("size")):
        return f"file {name}: size {entry.get('size')!r} is not a byte count"
    if not isinstance(entry.get("xxh3"), str) or not _HEX16.match(entry["xxh3"]):
        return f"file {name}: checksum {entry.get('xxh3')!r} is not 16 hex digits"
    if not _is_int(entry.get("rank")) or entry["rank"] >= world_size:
        return f"file {name}: writer rank {entry.get('rank')!r} is not one of {world_size}"
    return None


def file_problem(folder: Path, entry: dict, *, checksum: bool = True) -> str | None:
    """What is wrong with one file the manifest lists (None: it is as written). Only a
    regular file inside ``folder`` is ever opened, and never read past the size the
    manifest gives: a link, device or FIFO is refused, whatever its name."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not _FILE_NAME.match(name):  # read_manifest refuses it
        return f"{folder}: file name {name!r} is not a plain name inside the folder: refused"
    path = folder / name
    writer = f"rank {entry['rank']}'s file {path}"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{writer} is missing"
    except OSError as e:
        return f"{writer} cannot be read ({e})"
    if not stat.S_ISREG(info.st_mode):
        return f"{writer} is not a regular file (a link, device or FIFO): refused"
    if info.st_size != entry["size"]:
        return f"{writer} has {info.st_size} bytes, the manifest says {entry['size']} (truncated?)"
    if checksum:
        try:
            found = file_checksum(path, limit=entry["size"])
        except OSError as e:
            return f"{writer} cannot be read ({e})"
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
        held = (p.lstat() for p in folder.iterdir())  # links are not followed
        size = sum(st.st_size for st in held if stat.S_ISREG(st.st_mode))
        return CheckpointInfo(
            folder,
            int(partial.group(1)),
            "partial",
            folder.stat().st_mtime,
            size_bytes=size,
            problem="the save never finished (a rank died?)",
        )
    final = _FINAL.match(folder.name)
    if not final:
        return None
    if folder.is_symlink():
        return CheckpointInfo(
            folder,
            int(final.group(1)),
            "corrupt",
            0.0,
            problem=f"{folder} is a link, not a folder dtlab wrote: refused",
        )
    try:
        manifest = read_manifest(folder)
    except CheckpointError as e:
        return CheckpointInfo(
            folder, int(final.group(1)), "corrupt", folder.stat().st_mtime, problem=str(e)
        )
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

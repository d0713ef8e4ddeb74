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

Every file of a checkpoint is read through ``open_confined``: a plain name in the folder,
no link followed, no FIFO waited on, a regular file of the size the manifest lists, never
read past it (the notebook's listing, the ranks' checks and DCP's reads alike).

The XXH3-64 checksum finds truncation and corruption at ~10 GB/s (CRC-32 runs at 3, SHA-256
at 1.4 here); it is no defence against tampering: loading never unpickles arbitrary objects
instead.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeGuard

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


def is_file_name(name: object) -> bool:
    """A name dtlab writes into a checkpoint folder (a plain name: no path, no '..')."""
    return isinstance(name, str) and (name == MANIFEST or bool(_FILE_NAME.match(name)))


def final_step(name: str) -> int | None:
    """The step of a complete checkpoint's folder name (None: not one)."""
    found = _FINAL.match(name)
    return int(found.group(1)) if found else None


def next_final_name(taken: set[str], step: int) -> str:
    """``step-0000040``, or ``step-0000040-2`` when ``taken`` holds that name already."""
    name, n = f"step-{step:07d}", 1
    while name in taken:
        n += 1
        name = f"step-{step:07d}-{n}"
    return name


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
    path = Path(path)
    with open_confined(path.parent, path.name) as f:
        left = limit + 1  # a file that grew after it was opened reads as a mismatch
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


CHOOSE_ANOTHER = "choose another checkpoint (dt.checkpoints() lists them)"


def not_regular(path: Path, mode: int) -> str:
    """What a file that is not a regular file is, in words (for a refusal)."""
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(path)  # where it points: read from the link, not opened
        except OSError:
            target = "?"
        where = os.path.normpath(os.path.join(path.parent, target))
        outside = os.path.dirname(where) != os.path.normpath(path.parent)
        return (
            f"not a regular file but a link to {target}"
            + (", outside the checkpoint folder" if outside else "")
            + " (links are never followed)"
        )
    kinds = [
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ]
    kind = next((word for test, word in kinds if test(mode)), "no regular file")
    return f"not a regular file but {kind} (only regular files are read)"


class _Bounded(io.RawIOBase):
    """A file descriptor read no further than ``limit`` bytes (what the listing gave):
    a file that grows after it was checked never reads on without end."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__()
        self.fd, self.limit = fd, limit

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END:  # the end is the listed end, whatever the file holds
            offset, whence = self.limit + offset, os.SEEK_SET
        return os.lseek(self.fd, offset, whence)

    def readinto(self, buffer) -> int:
        left = self.limit - self.tell()
        if left <= 0:
            return 0
        view = memoryview(buffer).cast("B")
        return os.readv(self.fd, [view[: min(len(view), left)]])

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


def open_confined(
    folder: str | os.PathLike, name: str, *, size: int | None = None, most: int | None = None
) -> BinaryIO:
    """Open ``name``, a plain name directly in ``folder``, for reading, confined: the
    folder and the file are opened without following a link and without blocking (a
    FIFO is refused, never waited on); only a regular file is read; with ``size`` it
    must have exactly that many bytes, with ``most`` at most that many, and it is never
    read past them. CheckpointError names the file, what is wrong and what to do;
    FileNotFoundError when it is not there."""
    folder = Path(folder)
    path = folder / str(name)
    if not isinstance(name, str) or not (_FILE_NAME.match(name) or name == MANIFEST):
        raise CheckpointError(
            f"{path}: {name!r} is not a plain name inside the checkpoint folder "
            f"(a path, '..' or an odd character): refused"
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        where = os.open(folder, flags | os.O_DIRECTORY)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CheckpointError(
                f"{folder} is a link or not a folder, not a checkpoint dtlab wrote: refused"
            ) from None
        raise
    try:
        fd = os.open(name, flags, dir_fd=where)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise type(e)(e.errno, e.strerror, str(path)) from None
        raise CheckpointError(f"{path} is {not_regular(path, stat.S_IFLNK)}: refused") from None
    finally:
        os.close(where)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is {not_regular(path, info.st_mode)}: refused")
        if size is not None and info.st_size != size:
            said = "larger than listed" if info.st_size > size else "smaller than listed"
            raise CheckpointError(
                f"{path} has {info.st_size} bytes, the manifest says {size} ({said}): refused"
            )
        if most is not None and info.st_size > most:
            raise CheckpointError(
                f"{path} has {info.st_size} bytes, more than the {most} expected: refused"
            )
        os.set_blocking(fd, True)
        limit = (
            info.st_size
            if size is None and most is None
            else min(x for x in (size, most) if x is not None)
        )
        return io.BufferedReader(_Bounded(fd, limit), 1 << 20)
    except BaseException:
        os.close(fd)
        raise


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
        with open_confined(folder, MANIFEST, most=MAX_MANIFEST_BYTES) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        manifest = json.loads(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST}: not a complete checkpoint") from None
    except CheckpointError as e:
        raise CheckpointError(f"{e}: the checkpoint is corrupt") from None
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
        return f"{writer} is {not_regular(path, info.st_mode)}: refused"
    if info.st_size != entry["size"]:
        return (
            f"{writer} has {info.st_size} bytes, the manifest says {entry['size']} "
            f"({'larger than listed' if info.st_size > entry['size'] else 'truncated?'})"
        )
    if checksum:
        try:
            found = file_checksum(path, limit=entry["size"])
        except CheckpointError as e:
            return f"rank {entry['rank']}'s file {e}"
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
    # in object storage: its URL (``s3://bucket/prefix/step-0000040``); ``path`` is then
    # the local folder it is fetched into (verified) before the ranks load it
    url: str | None = None
    # with a mirror (``dt.checkpoint_mirror``): "local", "mirrored" (in the bucket only, or
    # the local copy is damaged) or "both"; and how its copy to the bucket stands
    copies: str | None = None
    mirror: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "complete"

    @property
    def where(self) -> str:
        """Where it is: its URL in object storage, else its folder."""
        return self.url or str(self.path)


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

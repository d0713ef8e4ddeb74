"""DeepSpeed's own checkpoints copied to object storage, and fetched back
(``dt.mirror.watch_deepspeed(save_dir)``; :mod:`dtlab.control.mirror` runs the copies).

DeepSpeed writes ``engine.save_checkpoint(save_dir)`` locally: a folder per tag
(``global_step40/``: the module states, each rank's optimizer partition) and ``latest``,
the tag of the last complete save, written once every rank has written its part. A tag
is complete once ``latest`` names it or was written after it (its files are no newer than
``latest``). Each complete tag is copied to ``<mirror>/deepspeed/<tag>/``: its files
(plain names only, each hashed before and checked after it is sent), then a
``manifest.json`` of dtlab's (format ``dtlab-deepspeed-copy/1``: tag, step, files with
size and checksum) last, then ``deepspeed/latest``. As for dtlab's own checkpoints, a
copy is complete only once its manifest is there; the bucket is untrusted input (keys
under the prefix, plain names, the manifest read bounded and its schema checked, sizes
and checksums checked as each object is fetched). :func:`restore` fetches a tag back into
the save folder, checked, and points ``latest`` at it: the script's own
``engine.load_checkpoint(save_dir)`` then resumes from it, as after any restart.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

import xxhash

from dtlab.control.object_store import Bucket, each_file
from dtlab.records.checkpoints import (
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    checksum_text,
    is_file_name,
    open_confined,
)

FOLDER = "deepspeed"  # under the mirror's prefix
FORMAT = "dtlab-deepspeed-copy/1"
LATEST = "latest"
MAX_LATEST_BYTES = 1024
_STEP = re.compile(r"global_step(\d+)$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,200}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_CHUNK = 8 << 20


def step_of(tag: str) -> int:
    """The global step DeepSpeed's default tag names (``global_step40``), else 0."""
    found = _STEP.match(tag)
    return int(found.group(1)) if found else 0


def read_latest(save_dir: Path) -> str | None:
    """The tag ``save_dir/latest`` names (None: no complete save yet)."""
    try:
        with open_confined(save_dir, LATEST, most=MAX_LATEST_BYTES) as f:
            tag = f.read(MAX_LATEST_BYTES + 1).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return None
    return tag if _TAG.match(tag) else None


def complete_tags(save_dir: Path) -> list[tuple[str, int, int]]:
    """(tag, step, bytes) of every complete save in ``save_dir``, oldest step first. A tag
    folder that is a link, holds a link or a subfolder, or is still being written (files
    newer than ``latest``) is left out."""
    latest = read_latest(save_dir)
    if latest is None:
        return []
    written = (save_dir / LATEST).stat().st_mtime
    found = []
    for folder in save_dir.iterdir():
        if folder.is_symlink() or not folder.is_dir() or not _TAG.match(folder.name):
            continue
        files = list(folder.iterdir())
        if not files or any(f.is_symlink() or not f.is_file() for f in files):
            continue
        if folder.name != latest and max(f.stat().st_mtime for f in files) > written:
            continue  # a save under way: its ``latest`` comes after every rank's part
        found.append((folder.name, step_of(folder.name), sum(f.stat().st_size for f in files)))
    return sorted(found, key=lambda t: (t[1], t[0]))


def _hashed(folder: Path, name: str, size: int) -> str:
    hasher = xxhash.xxh3_64()
    with open_confined(folder, name, size=size) as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return checksum_text(hasher.intdigest())


def upload(bucket: Bucket, save_dir: Path, tag: str, progress=None) -> CheckpointInfo:
    """Copy the complete save ``save_dir/tag`` to ``<bucket>/deepspeed/<tag>/``, manifest
    last, then ``deepspeed/latest`` if it is the save folder's latest. A failure removes
    what was sent and raises; the local save is left as it was."""
    folder = save_dir / tag
    names = sorted(p.name for p in folder.iterdir())
    odd = [n for n in names if not is_file_name(n) or n == MANIFEST]
    if odd:
        raise CheckpointError(f"{folder} holds {odd[0]!r}, a name dtlab does not copy")
    files = []
    for name in names:
        size = (folder / name).stat().st_size
        files.append({"name": name, "size": size, "xxh3": _hashed(folder, name, size), "rank": 0})
    manifest = {
        "format": FORMAT,
        "tag": tag,
        "step": step_of(tag),
        "created": max((folder / n).stat().st_mtime for n in names),
        "files": [{k: e[k] for k in ("name", "size", "xxh3")} for e in files],
    }
    raw = json.dumps(manifest, indent=1).encode()
    bucket.put_folder(folder, files, f"{FOLDER}/{tag}", raw, progress)
    if read_latest(save_dir) == tag:
        key = f"{bucket.key}/{FOLDER}/{LATEST}"
        bucket.call("writing latest to", bucket.fs.pipe_file, key, tag.encode())
    return _info(bucket, tag, manifest, "complete")


def _info(
    bucket: Bucket, tag: str, manifest: dict | None, status: str, problem: str | None = None
) -> CheckpointInfo:
    files = (manifest or {}).get("files", [])
    return CheckpointInfo(
        bucket.fetched / FOLDER / tag,
        int((manifest or {}).get("step", step_of(tag))),
        status,
        float((manifest or {}).get("created", 0.0)),
        size_bytes=sum(e["size"] for e in files),
        tag=tag,
        problem=problem,
        url=f"{bucket.url}/{FOLDER}/{tag}",
    )


def _manifest(bucket: Bucket, tag: str, listed: int) -> dict:
    url = f"{bucket.url}/{FOLDER}/{tag}/{MANIFEST}"
    manifest = bucket.manifest_json(f"{FOLDER}/{tag}", listed, "copy")
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT
        and manifest.get("tag") == tag
        and isinstance(manifest.get("step"), int)
        and isinstance(manifest.get("created"), (int, float))
        and isinstance(manifest.get("files"), list)
        and manifest["files"]
        and all(
            isinstance(e, dict)
            and is_file_name(e.get("name"))
            and e.get("name") != MANIFEST
            and isinstance(e.get("size"), int)
            and not isinstance(e.get("size"), bool)
            and e["size"] >= 0
            and isinstance(e.get("xxh3"), str)
            and _HEX16.match(e["xxh3"])
            for e in manifest["files"]
        )
    )
    if not ok:
        raise CheckpointError(f"{url} is not a manifest of a DeepSpeed copy ({FORMAT}): refused")
    return manifest


def catalogue(bucket: Bucket) -> list[CheckpointInfo]:
    """Every DeepSpeed copy under ``<bucket>/deepspeed/``: complete, partial (no manifest)
    or corrupt (with why), oldest step first."""
    objects = bucket.listing().get(FOLDER, {})
    by_tag: dict[str, dict[str, int]] = {}
    for name, size in objects.items():
        tag, _, inside = name.partition("/")
        if inside:
            by_tag.setdefault(tag, {})[inside] = size
    found = []
    for tag, listed in by_tag.items():
        if not _TAG.match(tag) or any(not is_file_name(n) for n in listed):
            found.append(_info(bucket, tag, None, "corrupt", "an object with an odd name"))
            continue
        if MANIFEST not in listed:
            found.append(_info(bucket, tag, None, "partial", "the copy never finished"))
            continue
        try:
            manifest = _manifest(bucket, tag, listed[MANIFEST])
        except CheckpointError as e:
            found.append(_info(bucket, tag, None, "corrupt", str(e)))
            continue
        wrong = [e["name"] for e in manifest["files"] if listed.get(e["name"]) != e["size"]]
        status, problem = ("corrupt", f"{wrong[0]} missing or of another size") if wrong else (
            "complete", None)  # fmt: skip
        found.append(_info(bucket, tag, manifest, status, problem))
    return sorted(found, key=lambda c: (c.step, c.tag or ""))


def latest_tag(bucket: Bucket) -> str | None:
    """The tag ``<bucket>/deepspeed/latest`` names (None: none copied yet)."""
    listed = bucket.listing().get(FOLDER, {}).get(LATEST)
    if listed is None:
        return None
    if listed > MAX_LATEST_BYTES:
        raise CheckpointError(f"{bucket.url}/{FOLDER}/{LATEST} is too big to be a tag: refused")
    key = f"{bucket.key}/{FOLDER}/{LATEST}"
    tag = bucket.read_bounded(key, listed, f"{bucket.url}/{FOLDER}/{LATEST}").decode(
        "utf-8", "replace"
    )
    return tag.strip() if _TAG.match(tag.strip()) else None


def restore(bucket: Bucket, save_dir: Path, tag: str = "latest") -> Path:
    """Fetch the copy of ``tag`` (``latest``: the last one copied) into ``save_dir/tag``,
    every object checked (size, checksum) before the folder is renamed into place, and
    point ``save_dir/latest`` at it; -> the folder. Refused if ``save_dir/tag`` exists."""
    if tag == LATEST:
        named = latest_tag(bucket)
        if named is None:
            raise CheckpointError(f"no DeepSpeed copy in {bucket.url}/{FOLDER} to restore")
        tag = named
    if not _TAG.match(tag):
        raise CheckpointError(f"{tag!r} is not a DeepSpeed tag")
    copies = {c.tag: c for c in catalogue(bucket)}
    copy = copies.get(tag)
    if copy is None or not copy.ok:
        why = "not there" if copy is None else f"{copy.status}: {copy.problem}"
        raise CheckpointError(f"the copy of {tag} in {bucket.url}/{FOLDER} is {why}")
    final = save_dir / tag
    if final.exists():
        raise CheckpointError(
            f"{final} exists: remove it first to restore the copy of {tag} from {bucket}"
        )
    objects = bucket.listing().get(FOLDER, {})
    manifest = _manifest(bucket, tag, objects[f"{tag}/{MANIFEST}"])
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp = save_dir / f".partial-{tag}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        entries = [{**e, "rank": 0} for e in manifest["files"]]
        folder = f"{FOLDER}/{tag}"
        each_file(lambda e, stop: bucket.fetch_file(folder, e, tmp / e["name"], stop), entries)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = save_dir / f".latest-{secrets.token_hex(4)}"
    pointer.write_text(tag)
    os.replace(pointer, save_dir / LATEST)
    return final

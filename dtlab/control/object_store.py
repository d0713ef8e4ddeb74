"""Checkpoint roots in S3-compatible object storage (``dt.checkpoint_root = "s3://b/p"``).

The ranks write a checkpoint as they always do, into a local ``.partial-*`` folder (the
staging folder, under the runs folder); the notebook then uploads it, file by file, each
one hashed as it is sent and its object's size checked once it is stored, and writes its
``manifest.json`` last. An object-storage checkpoint is complete only once its manifest
is there: a failed upload removes what it sent, and one killed midway leaves objects
without a manifest, listed as partial with their size, never loaded.

A bucket is untrusted input, as a folder is: every key listed must lie under the prefix,
every checkpoint's object a plain name directly in its folder, the manifest is read
bounded and checked whole, every object must have the size the manifest lists, and a load
first fetches the checkpoint into a local folder reading no object past its listed size
and checking every checksum, before any rank opens (unpickles) anything.

Endpoint and credentials are the AWS SDK's: ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (an S3-compatible server: MinIO, Ceph, moto...),
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``
(``~/.aws/credentials``), instance roles. A secret is never printed: every message that
leaves this module has the secret key and session token cut out.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import xxhash

from dtlab.control.errors import DtlabError
from dtlab.records.checkpoints import (
    FORMAT,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    PARTIAL_PREFIX,
    CheckpointError,
    CheckpointInfo,
    checksum_text,
    file_problem,
    final_step,
    is_file_name,
    manifest_problem,
    next_final_name,
    open_confined,
    read_manifest,
)

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,200}$")
_CHUNK = 8 << 20
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
SECRET_ENVS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
ATTEMPTS = 4  # tries of a request by the SDK, with backoff (throttling, a dropped connection)
RETRIES = 3  # ... and each of those tried again by s3fs (throttling, a dropped connection)
STREAMS = 4  # a checkpoint's files sent (or fetched) at once, each on a thread


class ObjectStoreError(DtlabError):
    """Object storage refused or could not be reached; the message says what to do and
    never holds a secret."""


def is_url(root: object) -> bool:
    return isinstance(root, str) and root.startswith(SCHEME)


def scrub(text: str) -> str:
    """``text`` with any secret of the environment cut out."""
    for name in SECRET_ENVS:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def endpoint() -> str | None:
    return next((os.environ[n] for n in ENDPOINT_ENVS if os.environ.get(n)), None)


class _Stopped(Exception):
    """Another file of the same upload or fetch failed: this one stops too."""


def each_file(fn: Callable[[dict, threading.Event], None], entries: Sequence[dict]) -> None:
    """``fn(entry, stop)`` for every entry, ``STREAMS`` at a time; the first failure sets
    ``stop`` (the others end at their next chunk) and is raised, as is an interrupt."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=STREAMS, thread_name_prefix="dtlab-transfer")
    futures = []
    try:
        futures = [pool.submit(fn, entry, stop) for entry in entries]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
    except BaseException:
        stop.set()
        for f in futures:
            f.cancel()
        raise
    finally:
        pool.shutdown(wait=True)  # each worker ends at its next chunk once stopped


class Bucket:
    """A checkpoint root in object storage: ``s3://bucket/prefix``; ``work`` is the
    local folder where saves are staged and loads fetched (shared with the ranks)."""

    def __init__(self, url: str, work: Path) -> None:
        if not is_url(url):
            raise ObjectStoreError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        prefix = prefix.strip("/")
        parts = prefix.split("/") if prefix else []
        if not _BUCKET.match(bucket) or not all(_PREFIX_PART.match(p) for p in parts):
            raise ObjectStoreError(
                f"{url!r} is not s3://BUCKET/PREFIX with a bucket name and plain prefix "
                "parts (no '..', no empty part, no odd character)"
            )
        self.bucket, self.prefix = bucket, prefix
        self.url = f"{SCHEME}{bucket}" + (f"/{prefix}" if prefix else "")
        self.key = f"{bucket}/{prefix}" if prefix else bucket  # s3fs's path of the root
        self.work = work / bucket / (prefix or "_")
        self._fs: Any = None

    def __str__(self) -> str:
        return self.url

    # --- the connection ---------------------------------------------------------------
    @property
    def fs(self) -> Any:
        if self._fs is None:
            try:
                import s3fs
            except ImportError:
                raise ObjectStoreError(
                    "a checkpoint root in object storage needs s3fs: pip install 'dtlab[s3]'"
                ) from None
            url = endpoint()
            self._fs = s3fs.S3FileSystem(
                client_kwargs={"endpoint_url": url} if url else {},
                config_kwargs={
                    "connect_timeout": CONNECT_TIMEOUT_S,
                    "read_timeout": READ_TIMEOUT_S,
                    "retries": {"total_max_attempts": ATTEMPTS, "mode": "standard"},
                },
                skip_instance_cache=True,
                use_listings_cache=False,
            )
            self._fs.retries = RETRIES  # s3fs's own tries around each SDK call (its default 5)
        return self._fs

    def said(self, e: BaseException, doing: str) -> ObjectStoreError:
        """``e`` from the storage, as an error that says what to do (no secret in it)."""
        where = f"{self.url} (endpoint {endpoint() or 'AWS default'})"
        text = scrub(f"{type(e).__name__}: {e}")
        low = text.lower()
        if isinstance(e, PermissionError) or any(
            w in low for w in ("accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch")
        ):
            hint = (
                "the credentials were refused or may not do this: check AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's policy"
            )
        elif "nosuchbucket" in low or (isinstance(e, FileNotFoundError) and "bucket" in low):
            hint = f"bucket {self.bucket!r} does not exist there: create it or fix the URL"
        elif any(
            w in low
            for w in ("slowdown", "reduce your request rate", "throttl", "service unavailable")
        ):  # a throttled HEAD has no body to say SlowDown: its 503 says Service Unavailable
            hint = (
                f"the storage is throttling requests (or overloaded): each was tried up to "
                f"{ATTEMPTS * RETRIES} "
                "times with growing waits; try again later, or send fewer at once "
                "(fewer saves, object_store.STREAMS)"
            )
        elif isinstance(e, (ConnectionError, TimeoutError)) or any(
            w in low for w in ("connect", "timeout", "timed out", "endpoint", "unreachable")
        ):
            hint = (
                "the server cannot be reached: check AWS_ENDPOINT_URL (or "
                "AWS_ENDPOINT_URL_S3) and the network"
            )
        else:
            hint = "the storage refused it"
        return ObjectStoreError(f"{doing} {where} failed: {hint} ({text})")

    def call(self, doing: str, fn: Callable, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except (CheckpointError, ObjectStoreError):
            raise
        except Exception as e:
            raise self.said(e, doing) from None

    # --- save -------------------------------------------------------------------------
    def staging(self) -> Path:
        """The local folder the ranks write a save into before it is uploaded."""
        (self.work / "saves").mkdir(parents=True, exist_ok=True)
        return self.work / "saves"

    @property
    def fetched(self) -> Path:
        """The local folder a checkpoint is fetched into (checked) for the ranks to load."""
        return self.work / "fetched"

    @property
    def kept(self) -> Path:
        """Where a save whose upload failed is kept, complete, as a local checkpoint."""
        return self.work / "kept"

    def upload(
        self,
        folder: Path,
        step: int,
        *,
        name: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> CheckpointInfo:
        """Upload a finished local checkpoint folder (its manifest written) as the
        checkpoint of ``step`` (under ``name``, a free one by default): every file hashed
        as it is sent and its object's size checked, the manifest last; ``progress(n)``
        after each n bytes sent. Any failure removes what was sent (what cannot be
        removed lists as partial) and raises; ``folder`` is left as it was."""
        manifest = read_manifest(folder)
        files = manifest["files"]
        for entry in files:
            problem = file_problem(folder, entry, checksum=False)
            if problem:
                raise CheckpointError(f"{problem}: not uploaded")
        if name is None:
            name = next_final_name(set(self._folders()), step)
        with open_confined(folder, MANIFEST, most=MAX_MANIFEST_BYTES) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        self.put_folder(folder, files, name, raw, progress)
        return CheckpointInfo(
            self.fetched / name,
            manifest["step"],
            "complete",
            manifest["created"],
            loss=manifest.get("loss"),
            size_bytes=sum(e["size"] for e in files),
            world_size=manifest["world_size"],
            ranks=tuple(sorted({e["rank"] for e in files})),
            tag=manifest.get("tag"),
            url=f"{self.url}/{name}",
        )

    def put_folder(
        self,
        folder: Path,
        files: list[dict],
        name: str,
        manifest: bytes,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``files`` (manifest entries) of the local ``folder`` to ``<prefix>/<name>/``,
        ``STREAMS`` at a time, then ``manifest`` as its manifest.json, last. Any failure
        removes what was sent (what cannot be removed lists as partial) and raises."""
        dest = f"{self.key}/{name}"
        try:
            each_file(
                lambda e, stop: self.put_file(folder, e, f"{dest}/{e['name']}", progress, stop),
                files,
            )
            self.call("writing the manifest to", self.fs.pipe_file, f"{dest}/{MANIFEST}", manifest)
        except BaseException:
            try:
                self.fs.rm(dest, recursive=True)
            except Exception:
                pass  # left without a manifest: it lists as partial, never loads
            raise

    def put_file(
        self,
        folder: Path,
        entry: dict,
        key: str,
        progress: Callable[[int], None] | None,
        stop: threading.Event,
    ) -> None:
        hasher = xxhash.xxh3_64()
        with open_confined(folder, entry["name"], size=entry["size"]) as src:
            out = self.call("uploading to", self.fs.open, key, "wb")
            try:
                while chunk := src.read(_CHUNK):
                    if stop.is_set():
                        raise _Stopped()
                    hasher.update(chunk)
                    self.call("uploading to", out.write, chunk)
                    if progress is not None:
                        progress(len(chunk))
                self.call("uploading to", out.close)
            except BaseException:
                try:
                    out.discard()  # a multipart upload begun: aborted, not left to bill
                except Exception:
                    pass
                out.closed = True  # discarded: not sent again when it is collected
                raise
        if checksum_text(hasher.intdigest()) != entry["xxh3"]:
            raise CheckpointError(
                f"{folder / entry['name']} changed while it was uploaded (its checksum is "
                "not the manifest's): not uploaded"
            )
        size = self.call("checking an upload to", self.fs.info, key).get("size")
        if size != entry["size"]:
            raise CheckpointError(
                f"{SCHEME}{key} holds {size} bytes after the upload, not {entry['size']}: "
                "the storage lost part of it; not uploaded"
            )

    def remove(self, info: CheckpointInfo) -> None:
        name = (info.url or "").rsplit("/", 1)[-1]
        if final_step(name) is not None:
            try:
                self.fs.rm(f"{self.key}/{name}", recursive=True)
            except FileNotFoundError:
                pass

    # --- list -------------------------------------------------------------------------
    def listing(self) -> dict[str, dict[str, int]]:
        """{checkpoint folder: {object name: size}} under the prefix, every key checked:
        a key outside the prefix is a listing that lies (refused whole); an object not
        a plain name directly in its folder is kept, under a name that says so."""
        found = self.call("listing", self.fs.find, self.key, detail=True, withdirs=False)
        folders: dict[str, dict[str, int]] = {}
        for key, info in found.items():
            if not isinstance(key, str) or not key.startswith(self.key + "/"):
                raise ObjectStoreError(
                    f"listing {self.url} gave the key {key!r}, outside the prefix: the "
                    "server's listing is not to be trusted; nothing was read"
                )
            size = info.get("size") if isinstance(info, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ObjectStoreError(
                    f"listing {self.url} gave {key!r} the size {size!r}: the server's "
                    "listing is not to be trusted; nothing was read"
                )
            folder, _, name = key[len(self.key) + 1 :].partition("/")
            folders.setdefault(folder, {})[name] = size
        return folders

    def _folders(self) -> list[str]:
        return list(self.listing())

    def catalogue(self, *, verify: bool = False) -> list[CheckpointInfo]:
        """Every checkpoint under the prefix, oldest step first, as ``catalogue`` lists
        a folder: complete, partial (no manifest: an upload that never finished, with the
        size it left) or corrupt (with why). ``verify`` reads every object's checksum."""
        found = []
        for folder, objects in self.listing().items():
            step = final_step(folder)
            if step is None:
                continue
            found.append(self._describe(folder, step, objects, verify=verify))
        return sorted(found, key=lambda c: (c.step, c.created))

    def _describe(
        self, folder: str, step: int, objects: dict[str, int], *, verify: bool
    ) -> CheckpointInfo:
        url, local = f"{self.url}/{folder}", self.fetched / folder
        odd = sorted(n for n in objects if not is_file_name(n))
        if odd:
            return CheckpointInfo(
                local,
                step,
                "corrupt",
                0.0,
                url=url,
                problem=f"{url} holds {odd[0]!r}, not a plain name inside the checkpoint "
                "(a path, '..' or an odd character): refused",
            )
        if MANIFEST not in objects:
            return CheckpointInfo(
                local,
                step,
                "partial",
                0.0,
                url=url,
                size_bytes=sum(objects.values()),
                problem="the upload never finished (no manifest): never loaded",
            )
        try:
            manifest = self._manifest(folder, objects[MANIFEST])
        except CheckpointError as e:
            return CheckpointInfo(local, step, "corrupt", 0.0, url=url, problem=str(e))
        files = manifest["files"]
        problems = []
        for entry in files:
            listed = objects.get(entry["name"])
            if listed is None:
                problems.append(f"rank {entry['rank']}'s object {url}/{entry['name']} is missing")
            elif listed != entry["size"]:
                problems.append(
                    f"rank {entry['rank']}'s object {url}/{entry['name']} has {listed} bytes, "
                    f"the manifest says {entry['size']}"
                )
            elif verify:
                try:
                    self.fetch_file(folder, entry, None)
                except CheckpointError as e:
                    problems.append(str(e))
        return CheckpointInfo(
            local,
            manifest["step"],
            "corrupt" if problems else "complete",
            manifest["created"],
            loss=manifest.get("loss"),
            size_bytes=sum(e["size"] for e in files),
            world_size=manifest["world_size"],
            ranks=tuple(sorted({e["rank"] for e in files})),
            tag=manifest.get("tag"),
            problem="; ".join(problems) or None,
            url=url,
        )

    def manifest_json(self, folder: str, listed: int, what: str = "checkpoint") -> Any:
        """``<folder>/manifest.json`` parsed, read no further than its ``listed`` size
        (at most MAX_MANIFEST_BYTES); CheckpointError says what is wrong."""
        url = f"{self.url}/{folder}/{MANIFEST}"
        if listed > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{url} has {listed} bytes, more than a manifest: refused")
        raw = self.read_bounded(f"{self.key}/{folder}/{MANIFEST}", listed, url)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{url} is not JSON ({e}): the {what} is corrupt") from None

    def _manifest(self, folder: str, listed: int) -> dict:
        url = f"{self.url}/{folder}/{MANIFEST}"
        manifest = self.manifest_json(folder, listed)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{url} is not a dtlab checkpoint manifest of format {FORMAT}")
        problem = manifest_problem(manifest)
        if problem:
            raise CheckpointError(f"{url}: {problem}: the checkpoint is corrupt (or was edited)")
        return manifest

    def read_bounded(self, key: str, size: int, url: str) -> bytes:
        """An object's bytes, reading no more than ``size`` + 1: one that holds more or
        fewer bytes than listed is refused."""
        raw = self.call("reading", self.fs.cat_file, key, start=0, end=size + 1)
        if len(raw) != size:
            raise CheckpointError(
                f"{url} holds {'more' if len(raw) > size else 'fewer'} bytes than the "
                f"{size} listed: the listing lies; refused"
            )
        return raw

    # --- load -------------------------------------------------------------------------
    def fetch(self, info: CheckpointInfo) -> Path:
        """Fetch a complete checkpoint into a fresh local folder, every object read no
        further than its listed size and checked against the manifest's size and
        checksum before the folder is renamed into place; -> the folder. Nothing of
        the bucket is opened by a rank before this returns."""
        folder = (info.url or "").rsplit("/", 1)[-1]
        step = final_step(folder)
        if step is None:
            raise CheckpointError(f"{info.where} is not a checkpoint of this bucket")
        objects = self.listing().get(folder, {})
        checked = self._describe(folder, step, objects, verify=False)
        if not checked.ok:
            raise CheckpointError(f"checkpoint {checked.where} refused: {checked.problem}")
        manifest = self._manifest(folder, objects[MANIFEST])
        self.fetched.mkdir(parents=True, exist_ok=True)
        tmp = self.fetched / f"{PARTIAL_PREFIX}fetch-{folder}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            each_file(lambda e, stop: self.fetch_file(folder, e, tmp / e["name"], stop),
                  manifest["files"])  # fmt: skip
            raw = self.read_bounded(
                f"{self.key}/{folder}/{MANIFEST}", objects[MANIFEST], "manifest"
            )
            (tmp / MANIFEST).write_bytes(raw)
            final = self.fetched / folder
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def fetch_file(
        self, folder: str, entry: dict, into: Path | None, stop: threading.Event | None = None
    ) -> None:
        url = f"{self.url}/{folder}/{entry['name']}"
        hasher = xxhash.xxh3_64()
        size, got = entry["size"], 0
        src = self.call("reading", self.fs.open, f"{self.key}/{folder}/{entry['name']}", "rb")
        out = open(into, "xb") if into is not None else None
        try:
            while got <= size:
                if stop is not None and stop.is_set():
                    raise _Stopped()
                chunk = self.call("reading", src.read, min(_CHUNK, size + 1 - got))
                if not chunk:
                    break
                got += len(chunk)
                hasher.update(chunk)
                if out is not None:
                    out.write(chunk)
        finally:
            src.close()
            if out is not None:
                out.close()
        if got != size:
            raise CheckpointError(
                f"rank {entry['rank']}'s object {url} holds {'more' if got > size else 'fewer'}"
                f" bytes than the {size} the manifest lists: refused"
            )
        found = checksum_text(hasher.intdigest())
        if found != entry["xxh3"]:
            raise CheckpointError(
                f"rank {entry['rank']}'s object {url} has checksum {found}, the manifest "
                f"says {entry['xxh3']} (corrupted): refused"
            )

    def forget_fetched(self, path: Path) -> None:
        """Remove a fetched copy once the ranks have loaded it."""
        if path.parent == self.fetched and final_step(path.name) is not None:
            shutil.rmtree(path, ignore_errors=True)

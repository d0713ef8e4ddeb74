"""A second copy of every checkpoint in object storage (``dt.checkpoint_mirror = "s3://..."``).

Checkpoints are saved into the local root as always; a thread of the notebook then copies
each complete one to the bucket (:meth:`Bucket.upload`: every file hashed as it is sent,
sizes checked, manifest last), under the same folder name, one at a time, while the job
steps on. It takes what ``dt.checkpoint()`` hands it at once, and looks at the local root
every ``SCAN_S`` for what periodic saves (``checkpoint_every``) wrote meanwhile.

:meth:`Mirror.status` says for each checkpoint whether it is queued, uploading (bytes
sent of its size), mirrored, or failed (and why: the local copy is never touched, a failed
upload leaves nothing listed as complete in the bucket, and it is tried again at the
first look ``RETRY_S`` later). Listing, loading and
resume checks read the bucket's catalogue beside the local one (control/checkpointing.py):
each checkpoint is ``local``, ``mirrored`` or ``both``, and one whose local copy is gone or
damaged loads from the bucket.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dtlab.control import deepspeed_copies
from dtlab.control.object_store import Bucket, ObjectStoreError
from dtlab.records.checkpoints import CheckpointError, CheckpointInfo, describe

SCAN_S = 2.0  # how often the local root is looked at for periodic saves
RETRY_S = 30.0  # a copy that failed is tried again at the first look this long after


@dataclass(frozen=True)
class Upload:
    """One checkpoint's copy to the bucket."""

    name: str  # its folder's name, locally and in the bucket
    step: int
    state: str  # "queued", "uploading", "mirrored", "failed"
    size_bytes: int
    sent_bytes: int = 0
    error: str | None = None
    seconds: float | None = None  # how long the upload took, once mirrored
    failed_at: float | None = None  # time.monotonic() of the last failure


class Mirror:
    """Copies each complete checkpoint under ``root`` to ``bucket`` on a thread of its own."""

    def __init__(self, bucket: Bucket, root: Path, scan_s: float = SCAN_S):
        self.bucket, self.root, self.scan_s = bucket, root, scan_s
        self._uploads: dict[str, Upload] = {}
        self._wanted: list[str] = []  # names to upload, oldest first
        self._cond = threading.Condition()
        self._closed = False
        self._in_bucket: set[str] | None = None  # complete there when the mirror began
        self.deepspeed_dir: Path | None = None  # a DeepSpeed save folder watched too
        self.scan_error: str | None = None  # why the thread's last look failed, if it did
        self._thread = threading.Thread(target=self._work, name="dtlab-mirror", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for u in self.status():
            counts[u.state] = counts.get(u.state, 0) + 1
        said = ", ".join(f"{n} {state}" for state, n in counts.items()) or "nothing yet"
        return f"<dtlab Mirror of {self.root} to {self.bucket}: {said}>"

    # --- what the notebook asks --------------------------------------------------------
    def add(self, folder: Path) -> None:
        """Copy the checkpoint ``folder`` (just saved under the root) next."""
        info = describe(folder)
        if info is None or not info.ok:
            return
        with self._cond:
            self._want(folder.name, info.step, info.size_bytes)
            self._cond.notify_all()

    def status(self) -> list[Upload]:
        """Every checkpoint this mirror copied or will, oldest step first."""
        with self._cond:
            return sorted(self._uploads.values(), key=lambda u: (u.step, u.name))

    def mirrored(self) -> set[str]:
        """Names of the checkpoints this mirror copied (the bucket may hold more)."""
        with self._cond:
            return {n for n, u in self._uploads.items() if u.state == "mirrored"}

    def wait(self, timeout: float = 600.0) -> list[Upload]:
        """Block until nothing is queued or uploading (at most ``timeout`` s; TimeoutError
        then, saying what is left); -> :meth:`status`."""
        self.scan()
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(u.state in ("queued", "uploading") for u in self._uploads.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = [u.name for u in self._uploads.values() if u.state != "mirrored"]
                    raise TimeoutError(
                        f"the mirror to {self.bucket} did not finish within {timeout:g} s: "
                        f"{', '.join(busy)} not mirrored yet (it goes on in the background)"
                    )
                self._cond.wait(min(left, 0.5))
        return self.status()

    def scan(self) -> None:
        """Queue every complete checkpoint under the root not mirrored yet (and every
        complete save of the watched DeepSpeed folder)."""
        with self._cond:  # what is queued, under way or copied is not read again
            known = {n for n, u in self._uploads.items() if u.state != "failed"}
        found = []
        if self.root.is_dir():
            for folder in sorted(self.root.iterdir()):
                skip = folder.name in known or not folder.is_dir()
                info = None if skip else describe(folder)
                if info is not None and info.ok:
                    found.append((folder.name, info.step, info.size_bytes))
        if self.deepspeed_dir is not None and self.deepspeed_dir.is_dir():
            found += [
                (f"{deepspeed_copies.FOLDER}/{tag}", step, size)
                for tag, step, size in deepspeed_copies.complete_tags(self.deepspeed_dir)
            ]
        with self._cond:
            for name, step, size in found:
                self._want(name, step, size)
            self._cond.notify_all()

    # --- DeepSpeed's own checkpoints -----------------------------------------------------
    def watch_deepspeed(self, save_dir: str | os.PathLike) -> None:
        """Also copy every complete save of ``engine.save_checkpoint(save_dir)`` (each tag
        folder, then ``latest``) to ``<bucket>/deepspeed/`` (:mod:`deepspeed_copies`)."""
        self.deepspeed_dir = Path(save_dir).absolute()
        self.scan()

    def deepspeed_copies(self) -> list[CheckpointInfo]:
        """The DeepSpeed saves copied to the bucket: complete, partial or corrupt."""
        return deepspeed_copies.catalogue(self.bucket)

    def restore_deepspeed(self, save_dir: str | os.PathLike, tag: str = "latest") -> Path:
        """Fetch a copied DeepSpeed save (``latest``: the last one copied) back into
        ``save_dir``, checked, and point ``save_dir/latest`` at it: the script's own
        ``engine.load_checkpoint(save_dir)`` resumes from it; -> its folder."""
        return deepspeed_copies.restore(self.bucket, Path(save_dir).absolute(), tag)

    def close(self) -> None:
        """Stop after the upload under way (what is queued stays local only)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # --- the thread ----------------------------------------------------------------------
    def _want(self, name: str, step: int, size: int) -> None:
        known = self._uploads.get(name)
        if known is not None and known.state != "failed":
            return  # queued, under way or done
        if known is not None and time.monotonic() - (known.failed_at or 0.0) < RETRY_S:
            return  # failed a moment ago: tried again later
        self._uploads[name] = Upload(name, step, "queued", size)
        self._wanted.append(name)

    def _work(self) -> None:
        next_scan = 0.0
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    if time.monotonic() >= next_scan:
                        break
                    self._cond.wait(max(0.0, next_scan - time.monotonic()))
                if self._closed:
                    return
                name = self._wanted.pop(0) if self._wanted else None
            if name is None:
                next_scan = time.monotonic() + self.scan_s
                try:
                    self.scan()
                    self.scan_error = None
                except (OSError, CheckpointError) as e:  # looked at again next time
                    self.scan_error = str(e)  # (a hostile `latest`, the root gone)
                continue
            self._upload(name)

    def _upload(self, name: str) -> None:
        began = time.monotonic()
        try:
            if self._in_bucket is None:
                self._in_bucket = {c.url.rsplit("/", 1)[-1] for c in self.bucket.catalogue()
                                   if c.ok and c.url}  # fmt: skip
                self._in_bucket |= {
                    f"{deepspeed_copies.FOLDER}/{c.tag}"
                    for c in deepspeed_copies.catalogue(self.bucket)
                    if c.ok
                }
            if name in self._in_bucket:  # a mirror before this one copied it
                self._set(name, state="mirrored", sent_bytes=self._uploads[name].size_bytes)
                return
            self._set(name, state="uploading")
            if name.startswith(f"{deepspeed_copies.FOLDER}/"):
                assert self.deepspeed_dir is not None
                tag = name.split("/", 1)[1]
                deepspeed_copies.upload(self.bucket, self.deepspeed_dir, tag, self._counter(name))
                self._in_bucket.add(name)
                self._set(name, state="mirrored", seconds=time.monotonic() - began)
                return
            info = describe(self.root / name)
            if info is None or not info.ok:
                problem = info.problem if info is not None else "it is gone"
                raise CheckpointError(f"{self.root / name} cannot be mirrored: {problem}")

            self.bucket.upload(self.root / name, info.step, name=name, progress=self._counter(name))
            self._in_bucket.add(name)
            self._set(name, state="mirrored", seconds=time.monotonic() - began)
        except (CheckpointError, ObjectStoreError, OSError) as e:
            self._set(name, state="failed", error=str(e), failed_at=time.monotonic())
        except Exception as e:  # noqa: BLE001 - the thread must go on; said in the status
            error = f"{type(e).__name__}: {e}"
            self._set(name, state="failed", error=error, failed_at=time.monotonic())

    def _counter(self, name: str):
        """``progress(n)`` for the upload of ``name``: its bytes sent so far."""

        def sent(n: int) -> None:
            with self._cond:
                u = self._uploads[name]
                self._uploads[name] = replace(u, sent_bytes=u.sent_bytes + n)

        return sent

    def _set(self, name: str, **changes) -> None:
        with self._cond:
            self._uploads[name] = replace(self._uploads[name], **changes)
            self._cond.notify_all()

"""What writes a live Trace's steps into its run folder, in the notebook.

The folder's format (header, journal, sealed journals, Parquet parts) and its reader are
:mod:`dtlab.records.run_folder`; this is the writer, and the thread that writes the parts.
A Trace is handed one when it is made::

    Trace(jobs, sink=FolderWriter(new_run_folder()), meta=...)
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dtlab.records import run_folder as disk
from dtlab.records.packed import Frame, join
from dtlab.records.step_files import StepFiles


class FolderWriter:
    """The records a live Trace puts in its run folder, frame by frame as they came: the
    frames since the last part (``add``) go to the journal at every ``flush`` (the end of
    a run), and once there are ``PART_ROWS`` rows of them, to a Parquet part written on a
    thread of its own. A :class:`dtlab.records.run_folder.FolderSink`."""

    def __init__(self, folder: str | os.PathLike):
        self._folder = Path(folder)
        self.files = StepFiles(folder)
        self._pending: list[Frame] = []  # records not yet in a part, frame by frame
        self._pending_rows = 0
        self._journaled = 0  # how many of them the journal holds
        self._part: Future | None = None  # the Parquet part being written, if one is
        self._good: int | None = None  # the journal length after its last whole entry
        self.failing = False  # the last write failed (warned once; retried at each flush)

    @property
    def folder(self) -> Path:
        return self._folder

    def add(self, frame: Frame) -> None:
        self._pending.append(frame)
        self._pending_rows += frame.rows

    @property
    def all_on_disk(self) -> bool:
        """Does the folder hold every frame added (the journal at least)?"""
        return self._journaled == len(self._pending)

    def flush(self) -> None:
        """Append the frames added since the last flush to the journal; once there are
        PART_ROWS rows of them, start writing them as a part. A write that fails (a full
        disk) leaves the journal as it was before it, keeps the frames in memory, warns
        once and is tried again at the next flush: it never raises."""
        if not self._pending:
            return
        if not self._journal():
            return
        if self._pending_rows >= disk.PART_ROWS:
            self._write_part()

    def close(self) -> None:
        """Write what is left as a part (no journal stays behind), and wait for it; what
        cannot be written is said (warned), not raised, so a new job can start."""
        if self._pending and self._journal():
            self._write_part()
        self.sync()
        if not self.all_on_disk:
            warnings.warn(
                f"dtlab: run folder {self._folder}: "
                f"{len(self._pending) - self._journaled} batches of step records could "
                f"not be written (free: {_free(self._folder)}); they are lost with this trace",
                RuntimeWarning,
                stacklevel=2,
            )

    def sync(self) -> None:
        """Wait until the part being written (if one is) is in the run folder; a part that
        could not be written is warned about (its rows stay in its sealed journal, which a
        later load reads)."""
        part, self._part = self._part, None
        if part is not None:
            try:
                part.result()
            except OSError as e:
                self._failed(e, "a Parquet part (its rows stay in its sealed journal)")

    def _failed(self, error: OSError, what: str) -> None:
        if not self.failing:
            warnings.warn(
                f"dtlab: run folder {self._folder}: could not write {what}: {error}; "
                f"free: {_free(self._folder)}. Steps go on, their records kept in memory; "
                "writing is tried again after every run.",
                RuntimeWarning,
                stacklevel=3,
            )
        self.failing = True

    def _journal(self) -> bool:
        """Append the frames not in the journal yet (as they came); on a failed write the
        journal is cut back to its last whole entry (no torn entry for the next append to
        land after), the frames stay pending, and False is returned."""
        path = self.files.folder / disk.JOURNAL
        try:
            self.files.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self._failed(e, f"{path}")
            return False
        try:
            good = os.fstat(fd).st_size if self._good is None else self._good
            self._good = good
            try:
                for frame in self._pending[self._journaled :]:
                    entry = disk.journal_entry(frame.data)
                    left = memoryview(entry)
                    while left:
                        left = left[os.write(fd, left) :]
                    good += len(entry)
                    self._good = good
                    self._journaled += 1
            except OSError as e:
                try:
                    os.ftruncate(fd, good)
                except OSError:
                    self._good = None  # unknown: measured again at the next try
                self._failed(e, f"{path}")
                return False
        finally:
            os.close(fd)
        if self.failing:
            self.failing = False
            warnings.warn(
                f"dtlab: run folder {self._folder}: writing again (every record kept is on disk)",
                RuntimeWarning,
                stacklevel=3,
            )
        return True

    def _write_part(self) -> None:
        """The journal's rows become a Parquet part, written (and merged) on a thread of
        its own, so the run that fills a part does not wait for its compression. The
        journal is sealed first (renamed: its rows stay on disk until the part holds them),
        and one part is written at a time."""
        assert self.all_on_disk
        self.sync()
        sealed = self.files.folder / disk.SEALED.format(time.time_ns())
        try:
            os.replace(self.files.folder / disk.JOURNAL, sealed)
        except OSError as e:
            self._failed(e, f"{sealed}")
            return
        pending, self._pending, self._journaled, self._pending_rows = self._pending, [], 0, 0
        self._good = 0  # a new journal
        self._part = _parts().submit(_write_sealed, self.files, pending, sealed)


def _free(folder: Path) -> str:
    """The free space where ``folder`` is, in words."""
    for at in (folder, *folder.parents):
        try:
            return f"{shutil.disk_usage(at).free / 2**20:.1f} MiB"
        except OSError:
            continue
    return "unknown"


_PARTS: ThreadPoolExecutor | None = None


def _parts() -> ThreadPoolExecutor:
    """The thread that writes Parquet parts (one for every trace: parts are written one at
    a time; Python waits for it at exit, so a part handed to it is finished)."""
    global _PARTS
    if _PARTS is None:
        _PARTS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtlab-parts")
    return _PARTS


def _write_sealed(files: StepFiles, frames: list[Frame], sealed: Path) -> None:
    try:
        files.write(join(frames))
    except OSError:
        for tmp in files.folder.glob("*.parquet.tmp"):  # half a part: its rows are in `sealed`
            tmp.unlink(missing_ok=True)
        raise
    sealed.unlink(missing_ok=True)  # its rows are in the part

"""This rank's share of a job folder (:mod:`dtlab.records.job_folder`), written by the rank
itself: a job run through ``python -m dtlab.run`` has no notebook to send records to.

``RankFolder`` writes ``<job>/rank-<r>/`` in the run folder format
(:mod:`dtlab.records.run_folder`): the header at the first step, then each step's record
(its summary, as the stepping channel sends it) appended to ``steps/journal.bin`` as the
step ends: one small write (~30 us), so the page cache holds every step a rank made
whatever happens to it next (an exception, SIGTERM, an abort, kill -9). ``Watchdog``'s
thread seals the journal into a Parquet part once it holds ``PART_ROWS`` rows.

An append that fails (a full disk) is undone: the journal is truncated back to the last
whole entry, so what was written stays readable; the rows stay in memory and the
watchdog tries again every ``flush_s`` (one warning on stderr says so, naming the folder,
and one more once writing works again).

``Watchdog``: that daemon thread; it also writes, when the rank has made no step for
``timeout_s`` seconds (0: never), ``hang.json`` (with the script's stack and each process
group's last collectives from torch's Flight Recorder, which the doctor's hang verdict
reads) and every thread's Python stack (``faulthandler``) into the rank's folder; a later
step marks it ``resumed``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from dtlab.records import JobInfo, StepRecord, step_record_to_dict
from dtlab.records import job_folder as jf
from dtlab.records import run_folder as disk
from dtlab.records.packed import join, pack, read_frame
from dtlab.records.step_files import StepFiles

FLUSH_S = 1.0  # how often a refused append is tried again, and a Parquet part made
# steps whose whole record (per-parameter norms and fingerprints) is kept in details.jsonl,
# for the doctor to name the parameter where ranks first differ (step summaries elsewhere)
DETAIL_STEPS = 8
MAX_HELD_ROWS = 1_000_000  # rows kept in memory while the disk refuses them (then the oldest go)


class RankFolder:
    """``<job>/rank-<rank>/``: this rank's header, step rows, outcome and hang reports."""

    def __init__(self, folder: str | os.PathLike, rank: int, flush_s: float = FLUSH_S):
        self.folder = Path(folder)
        self.rank = rank
        self.flush_s = flush_s
        self.files = StepFiles(self.folder)
        self.journal = self.files.folder / disk.JOURNAL
        self._held: list[StepRecord] = []  # rows not in the journal yet
        self._details: list[StepRecord] = []  # whole records of the first steps, not written
        self._journal_rows = 0
        self._good = 0  # bytes of the journal known whole
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()  # the rows held, the journal (main thread, watchdog)
        self._part_lock = threading.Lock()  # one Parquet part written at a time
        self._failing: str | None = None  # the last write error, while writes fail
        self.dropped = 0  # rows given up while the disk refused them
        self.opened = False

    # --- the header ---------------------------------------------------------------------
    def open(self, info: JobInfo, meta: Mapping, created: float) -> None:
        """Start the rank's run folder: its ``trace.json`` (written whole or not at all)."""
        self.files.folder.mkdir(parents=True, exist_ok=True)
        self.write_header(info, meta, created)
        self.opened = True

    def write_header(self, info: JobInfo, meta: Mapping, created: float) -> None:
        tmp = self.folder / f".header-{os.getpid()}"
        disk.write_header(tmp, {self.rank: info}, meta, created)
        os.replace(tmp / "trace.json", self.folder / "trace.json")
        tmp.rmdir()

    # --- step rows ----------------------------------------------------------------------
    def add(self, rec: StepRecord) -> None:
        """A step's record, appended to the journal at once (one small write, ~30 us), so
        a rank killed by any signal leaves every step it made; while the disk refuses
        writes, the watchdog tries again every ``flush_s``."""
        summary = rec.summary()
        with self._lock:
            self._held.append(summary)
            if rec.step <= DETAIL_STEPS and rec.detailed:
                self._details.append(rec)
            if self._failing is None and self.opened:
                self._append()

    def flush_if_due(self) -> None:
        """The watchdog's: rows the disk refused, and a Parquet part once the journal holds
        PART_ROWS rows, once ``flush_s`` passed since the last time."""
        due = self._held or self._journal_rows >= disk.PART_ROWS
        if due and time.monotonic() - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self, timeout: float = -1) -> bool:
        """Append the rows held to the journal (a part once it holds PART_ROWS rows);
        -> whether every row is on disk. Never raises for a write that fails (said once).
        ``timeout`` (a signal handler, which may have interrupted a flush of its own
        thread): how long to wait for a flush under way before giving up."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            self._last_flush = time.monotonic()
            if not self.opened:
                return not self._held
            if not self._append():
                return False
            sealed = self._seal() if self._journal_rows >= disk.PART_ROWS else None
        finally:
            self._lock.release()
        if sealed is not None:  # read back and written with the steps going on
            with self._part_lock:
                self._write_part(sealed)
        return True

    def _append(self) -> bool:
        """The rows held, as one journal entry (under the lock); -> whether it was written."""
        if not self._held:
            return True
        entry = disk.journal_entry(pack(self.rank, self._held).to_bytes())
        try:
            with open(self.journal, "ab") as out:
                out.write(entry)
        except OSError as e:
            self._undo(e)
            return False
        self._good += len(entry)
        self._journal_rows += len(self._held)
        self._held = []
        if self._failing is not None:
            _say(f"writing {self.journal} works again; no step record was lost")
            self._failing = None
        if self._details:
            self._write_details()
        return True

    def _write_details(self) -> None:
        """The whole records of the first steps, one JSON line each (a torn last line is
        skipped by the reader; a failed write is cut back and tried again next time)."""
        path = self.folder / jf.DETAILS_FILE
        before = path.stat().st_size if path.exists() else 0
        text = "".join(
            json.dumps(step_record_to_dict(self.rank, rec)) + "\n" for rec in self._details
        )
        try:
            with open(path, "a") as out:
                out.write(text)
            self._details = []
        except OSError:
            try:
                os.truncate(path, before)
            except OSError:
                pass

    def _undo(self, error: OSError) -> None:
        """The append failed: cut the journal back to its last whole entry, keep the rows."""
        try:
            if self.journal.exists():
                os.truncate(self.journal, self._good)
        except OSError:
            pass  # the reader stops at a torn last entry anyway
        if len(self._held) > MAX_HELD_ROWS:
            gone = len(self._held) - MAX_HELD_ROWS
            self._held, self.dropped = self._held[gone:], self.dropped + gone
        if self._failing is None:
            free = _free_space(self.folder)
            _say(
                f"could not write step records to {self.journal} ({error}; {free}): the "
                "job goes on, the records are kept in memory and written once it works"
            )
        self._failing = str(error)

    def _seal(self) -> Path | None:
        """The journal renamed (under the lock): its rows stay on disk, and readers read
        them, until a Parquet part holds them; the next step starts a new journal."""
        sealed = self.files.folder / disk.SEALED.format(time.time_ns())
        try:
            os.replace(self.journal, sealed)
        except OSError as e:
            _say(f"could not seal {self.journal} for a Parquet part ({e}); it grows on")
            return None
        self._journal_rows, self._good = 0, 0
        return sealed

    def _write_part(self, sealed: Path) -> None:
        """A sealed journal's rows as a Parquet part, then the sealed journal removed."""
        try:  # read back from disk: a rank holds no more than a flush's rows in memory
            entries = disk.journal_entries(sealed)
            self.files.write(join([read_frame(data, self.rank) for _, data in entries]))
            sealed.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - its rows stay readable in the sealed journal
            _say(
                f"could not write a Parquet part in {self.files.folder} ({e!r}); its rows "
                f"stay in {sealed.name}, which readers read"
            )

    # --- the end ------------------------------------------------------------------------
    def write_outcome(self, outcome: Mapping) -> None:
        """``outcome.json``: how the script ended on this rank."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            jf.write_json(self.folder / jf.OUTCOME_FILE, {"rank": self.rank, **outcome})
        except OSError as e:
            _say(f"could not write {self.folder / jf.OUTCOME_FILE}: {e}")


class Watchdog:
    """The thread that tries ``writer``'s refused rows again every ``flush_s`` (and makes
    its Parquet parts), and writes a hang report when this rank makes no step for
    ``timeout_s`` seconds (0: never)."""

    def __init__(self, writer: RankFolder, timeout_s: float):
        self.writer = writer
        self.folder, self.rank, self.timeout_s = writer.folder, writer.rank, timeout_s
        self.step = 0
        self.at = time.monotonic()
        self.fired_at: float | None = None  # epoch seconds of the last step, when fired
        self.fired_step = 0  # the step it fired after
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dtlab-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float = 0.0) -> None:
        self._stop.set()
        if wait_s and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def beat(self, step: int) -> None:
        """A step was made (one float and an int stored; the thread reads them)."""
        self.step, self.at = step, time.monotonic()
        if self.fired_at is not None:
            self._resumed(step)

    def _watch(self) -> None:
        period = min(self.writer.flush_s, self.timeout_s / 4 if self.timeout_s else 1.0)
        while not self._stop.wait(max(0.05, period)):
            try:
                self.writer.flush_if_due()
            except Exception as e:  # noqa: BLE001 - never ends the job; said, then off
                _say(f"rank {self.rank} stopped writing its records: {e!r}")
                return
            idle = time.monotonic() - self.at
            if self.timeout_s and idle >= self.timeout_s and self.fired_at is None:
                self._fire(time.time() - idle)

    def _fire(self, since: float) -> None:
        with self._lock:
            self.fired_at = since
            step = self.fired_step = self.step
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                with open(self.folder / jf.STACKS_FILE, "w") as out:
                    out.write(
                        f"rank {self.rank}: no step for {self.timeout_s:g} s after step {step}; "
                        f"every thread's Python stack at {time.strftime('%H:%M:%S')}:\n"
                    )
                    out.flush()
                    faulthandler.dump_traceback(file=out, all_threads=True)
                self._write(step, since, None)
            except OSError as e:
                _say(f"could not write a hang report in {self.folder}: {e}")

    def _resumed(self, step: int) -> None:
        with self._lock:
            since, self.fired_at = self.fired_at, None
            if since is None:
                return
            try:
                self._write(self.fired_step, since, step)
            except OSError:
                pass

    def _write(self, step: int, since: float, resumed: int | None) -> None:
        report = {"step": step, "since": since, "timeout_s": self.timeout_s, "resumed": resumed}
        if resumed is None:  # where the script is, and its last collectives (the verdict's)
            report.update(_where_now())
        jf.write_json(self.folder / jf.HANG_FILE, report)


def _where_now() -> dict:
    """The main thread's stack and each process group's last collectives from torch's
    Flight Recorder (empty where the backend keeps none), as the sidecar tells a notebook."""
    from dtlab.agent.sidecar import report

    try:
        found = report(threading.main_thread().ident or 0)
    except Exception as e:  # noqa: BLE001 - the stacks file is written; say why not this
        return {"error": f"{type(e).__name__}: {e}"}
    return {"stack": found["stack"], "collectives": found["collectives"]}


def _free_space(folder: Path) -> str:
    for place in (folder, *folder.parents):
        try:
            st = os.statvfs(place)
        except OSError:
            continue
        return f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free there"
    return "free space unknown"


def _say(text: str) -> None:
    try:
        print(f"dtlab.run: {text}", file=sys.__stderr__ or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass

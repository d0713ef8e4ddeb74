"""A notebook connected to a job it did not launch: ``torchrun ... -m dtlab.run train.py``.

``dtlab.connect(run_dir)`` reads the job folder, connects an ipyparallel client to the
controller the job started (its connection file in ``<run_dir>/ipython/security``,
owner-only, refused otherwise), finds each rank's engine and claims the job for this
notebook: a :class:`dtlab.control.connected_job.ConnectedJob`, which does the rest. A
second notebook is refused while one is connected. A job that has ended (every rank wrote
how it ended, or does while this notebook connects) opens read-only.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from dtlab.agent import api
from dtlab.analysis.ranks import label_ranks
from dtlab.control.connected_job import (
    LEASE_S,
    PAUSE_TIMEOUT_S,
    POLL_S,
    ConnectedJob,
    ConnectError,
    outcome_of,
)
from dtlab.control.errors import DtlabError
from dtlab.records import job_folder as jf

__all__ = [
    "LEASE_S",
    "PAUSE_TIMEOUT_S",
    "ConnectError",
    "ConnectedJob",
    "connect",
    "current_or_none",
    "forget",
]

PROFILE = "ipython"
CLIENT_FILE = "security/ipcontroller-job-client.json"
CONNECT_TIMEOUT_S = 30.0
ENDING_WAIT_S = 10.0  # for every rank's outcome, once one rank's says the job is ending
HOW_TO_START = (
    "start the job with `torchrun --nproc-per-node N -m dtlab.run train.py ARGS` (or "
    "`deepspeed --module dtlab.run train.py ARGS`) to connect to it"
)


_current: ConnectedJob | None = None  # the job this notebook connected to last


def current_or_none() -> ConnectedJob | None:
    return None if _current is None or _current.closed else _current


def forget() -> None:
    """No job is the connected one any more (a read-only view of an ended job closed)."""
    global _current
    if _current is not None and not _current.read_only:
        _current.disconnect()
    _current = None


def connect(
    run_dir: str | os.PathLike,
    *,
    timeout: float = CONNECT_TIMEOUT_S,
    lease_s: float = LEASE_S,
    kind: type[ConnectedJob] | None = None,
) -> ConnectedJob:
    """Connect this notebook to the running job whose folder is ``run_dir`` (read-only
    when the job has ended). ``kind``: the class to make (views' adds the dashboard)."""
    global _current
    folder = Path(run_dir).expanduser().absolute()
    job = _read_job(folder)
    made = kind or ConnectedJob
    ended = made(folder, job.world_size, None, {}, read_only=True)
    if _ended(folder, job.world_size):
        _current = ended
        return ended
    client = None
    try:
        client = _client(folder, timeout)
        engines = _engines(client, job.world_size, timeout, folder)
        connected = made(folder, job.world_size, client, engines, lease_s=lease_s)
        connected._claim()
    except BaseException as e:
        if client is not None:
            client.close()
        if not isinstance(e, DtlabError) or not _ending(folder, job.world_size):
            raise
        _current = ended  # it ended while this notebook connected: read-only
        return ended
    _current = connected
    return connected


def _read_job(folder: Path):
    if not folder.is_dir():
        raise ConnectError(f"{folder}: no such folder (give the job folder dtlab.run printed)")
    if not jf.is_job_folder(folder):
        what = "a notebook's run folder" if (folder / "trace.json").exists() else "not a job folder"
        raise ConnectError(f"{folder}: {what}, no {jf.JOB_FILE} of a torchrun job; {HOW_TO_START}")
    try:
        return jf.read_job(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConnectError(f"{folder}: cannot read the job folder ({e})") from None


def _ended(folder: Path, world_size: int) -> bool:
    return all(outcome_of(folder, r).exists() for r in range(world_size))


def _ending(folder: Path, world_size: int, wait_s: float = ENDING_WAIT_S) -> bool:
    """The controller did not answer because the job is ending: a rank has written how it
    ended (rank 0 does before it stops the controller); -> whether every rank has, within
    ``wait_s``."""
    if not any(outcome_of(folder, r).exists() for r in range(world_size)):
        return False
    deadline = time.monotonic() + wait_s
    while not _ended(folder, world_size):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S * 5)
    return True


def _client(folder: Path, timeout: float):
    import ipyparallel as ipp

    path = folder / PROFILE / CLIENT_FILE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ConnectError(
            f"{folder}: the job has no controller to connect to (no {PROFILE}/{CLIENT_FILE}): "
            "it was started with --no-connect, or has not made its first step yet (the "
            "controller starts then: wait and connect again)"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise ConnectError(f"{path}: not a regular file; it is not read")
    if info.st_uid != os.getuid():
        raise ConnectError(f"{path} belongs to uid {info.st_uid}, not you: it is not read")
    if info.st_mode & 0o077:
        raise ConnectError(
            f"{path} is readable by others (mode {stat.filemode(info.st_mode)}): whoever reads "
            f"it can run code in the job. `chmod 600 {path}` and connect again"
        )
    try:
        return ipp.Client(str(path), timeout=timeout)
    except (TimeoutError, OSError) as e:
        raise ConnectError(
            f"the job's controller ({path}) does not answer within {timeout:g} s ({e}): the "
            "job has ended or its rank 0 is gone; `dtlab doctor` reads its folder"
        ) from None


def _engines(client, world_size: int, timeout: float, folder: Path) -> dict[int, int]:
    """rank -> engine id, once every rank's engine has registered."""
    deadline = time.monotonic() + timeout
    found: dict[int, int] = {}
    asked: set[int] = set()
    while len(found) < world_size:
        for eid in client.ids:
            if eid not in asked:
                asked.add(eid)
                try:  # bounded: an engine whose rank ends meanwhile never answers
                    asked_now = client[eid].apply_async(api.job_where)
                    where = asked_now.get(timeout=max(1.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise ConnectError(
                        f"engine {eid} of the job in {folder} did not answer within "
                        f"{timeout:g} s: its rank is ending, hung or gone; `dtlab doctor` "
                        "reads what the folder holds"
                    ) from None
                found[where.rank] = eid
        if len(found) >= world_size:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(found))
            raise ConnectError(
                f"{label_ranks(missing)} of the job in {folder} did not register within "
                f"{timeout:g} s (a rank that died or could not start its engine says so in "
                "its log); `dtlab doctor` reads what the folder holds"
            )
        time.sleep(0.05)
    return found

"""Checkpoint files are opened one confined, bounded way (issue 39, item 3): a regular file
directly in its folder, opened without following a link and without blocking, of the size
the manifest lists and never read past it. A load of a folder that the listing finds
corrupt is refused before any rank opens a file of it, with one error naming the file,
what is wrong and what to do; the ranks' own reading (the manifest, ``rank-R.pt``, DCP's
``.metadata`` and ``__R_*.distcp``) opens files the same way, so a FIFO never blocks and a
link never leads out of the folder. Each case ends within 10 s; an outside file a link
points at keeps its (past) access time: it was never opened.

One rank in this process for the unit tests, two live ranks for ``dt.load_checkpoint``."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dtlab.agent import api, restore
from dtlab.records.checkpoints import CheckpointError, catalogue, open_confined
from tests.test_hostile_checkpoints import no_job_left, saved  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.timeout(120),
]
PAST = 1_000_000  # an access time no read leaves behind
SAID = {
    "fifo": "not a regular file but a FIFO",
    "link outside": "link to .*outside.bin, outside the checkpoint folder",
    "larger": r"the manifest says \d+ \(larger than listed\)",
    "directory": "not a regular file but a directory",
}


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside every checkpoint folder: not a pickle, last read long ago."""
    path = tmp_path / "outside.bin"
    path.write_bytes(b"x" * 64)
    os.utime(path, (PAST, PAST))
    return path


def spoil(folder: Path, name: str, kind: str, outside: Path) -> Path:
    """Make ``folder/name`` (a file the manifest lists, with its true size and checksum)
    a FIFO, a link to ``outside``, larger than listed, or a directory."""
    path = folder / name
    if kind == "larger":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
        return path
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # opened for reading, it would wait for a writer forever
    elif kind == "link outside":
        os.symlink(outside, path)
    else:
        path.mkdir()
    return path


def never_read(outside: Path) -> None:
    assert os.stat(outside).st_atime == PAST, "the file outside the folder was opened"


def within(seconds: float, fn):
    """``fn()``'s result or exception, failing the test if it takes over ``seconds`` (a
    FIFO opened for reading would block it: a writer is then opened to let it go)."""
    box: dict = {}

    def go():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            box["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"still running after {seconds} s (blocked on a FIFO?)")
    if "error" in box:
        raise box["error"]
    assert time.monotonic() - t0 < seconds
    return box["value"]


# --- the confined open itself -----------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", list(SAID))
def test_the_confined_open_refuses_what_is_not_the_listed_regular_file(tmp_path, outside, kind):
    folder = tmp_path / "step-0000001"
    folder.mkdir()
    (folder / "part").write_bytes(b"a" * 100)
    spoil(folder, "part", kind, outside)
    with pytest.raises(CheckpointError, match=rf"{folder}/part .*{SAID[kind]}.*refused"):
        open_confined(folder, "part", size=100)
    never_read(outside)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "a/b", "..", ""])
def test_the_confined_open_takes_plain_names_inside_the_folder_only(tmp_path, outside, name):
    folder = tmp_path / "step-0000001"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="not a plain name inside the checkpoint folder"):
        open_confined(folder, name)
    never_read(outside)


@pytest.mark.timeout(10)
def test_the_confined_open_refuses_a_folder_that_is_a_link(tmp_path, outside):
    real = tmp_path / "real"
    real.mkdir()
    (real / "part").write_bytes(b"a")
    (tmp_path / "step-0000001").symlink_to(real)
    with pytest.raises(CheckpointError, match="is a link or not a folder"):
        open_confined(tmp_path / "step-0000001", "part")


@pytest.mark.timeout(10)
def test_the_confined_open_reads_the_listed_bytes_and_never_past_them(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "part").write_bytes(b"0123456789")
    with open_confined(folder, "part", size=10) as f:
        with open(folder / "part", "ab") as grow:  # grows after it was checked
            grow.write(b"!" * 4096)
        assert f.read() == b"0123456789"
        assert f.seek(0, os.SEEK_END) == 10 and f.read() == b""
        f.seek(3)
        assert f.read(2) == b"34"
    with pytest.raises(CheckpointError, match="more than the 5 expected"):
        open_confined(folder, "part", most=5)
    with pytest.raises(FileNotFoundError, match="missing"):
        open_confined(folder, "missing")


# --- one rank in this process: the listing, and the rank's own reading --------------------

FILES = [".metadata", "__0_0.distcp", "rank-0.pt"]


@pytest.mark.parametrize("kind", list(SAID))
@pytest.mark.parametrize("name", FILES)
def test_a_spoiled_file_is_listed_corrupt_and_refused_by_the_rank(saved, outside, name, kind):  # noqa: F811
    root, (bad, good) = saved
    spoil(bad, name, kind, outside)
    listed = within(10, lambda: {c.path: c for c in catalogue(root, verify=True)})
    assert listed[bad].status == "corrupt" and name in listed[bad].problem
    with pytest.raises(CheckpointError, match=SAID[kind]):
        within(10, lambda: restore.load(str(bad)))
    never_read(outside)
    assert within(30, lambda: restore.load(str(good)))["step"] == 2


@pytest.mark.parametrize("kind", list(SAID))
@pytest.mark.parametrize("name", FILES)
def test_the_ranks_reading_is_confined_even_where_a_check_missed_it(
    saved,  # noqa: F811
    outside,
    monkeypatch,
    name,
    kind,
):
    """As if the file were swapped after it was checked: the opener itself refuses."""
    root, (bad, good) = saved
    spoil(bad, name, kind, outside)
    monkeypatch.setattr(restore, "file_problem", lambda *a, **k: None)
    job = restore.jobs.current()
    before = [p.detach().clone() for p in job.params]
    with pytest.raises(CheckpointError, match=SAID[kind]):
        within(10, lambda: restore.load(str(bad)))
    never_read(outside)
    assert all(torch.equal(a, p) for a, p in zip(before, job.params, strict=True))


def test_dcp_opens_only_files_the_manifest_lists(saved, outside):  # noqa: F811
    root, (bad, _) = saved
    manifest = restore.read_manifest(bad)
    reader = restore.confined_reader(bad, manifest)
    for path in [bad / "unlisted.distcp", outside, bad.parent / "x" / "__0_0.distcp"]:
        with pytest.raises(CheckpointError, match="does not list"):
            with reader.fs.create_stream(path, "rb"):
                pass
    with pytest.raises(CheckpointError, match="does not list"):
        with reader.fs.create_stream(bad / "__0_0.distcp", "wb"):
            pass
    never_read(outside)
    assert reader.read_metadata().storage_data  # the real one reads


# --- live ranks -----------------------------------------------------------------------------


@pytest.fixture
def dt(live2, tmp_path):
    from dtlab import demo

    live2.checkpoint_root = tmp_path / "checkpoints"
    demo.attach(live2, num_samples=256)
    live2.step(2)
    return live2


def rank_steps(session) -> set[int]:
    from dtlab.agent.job import current

    return set(session.run(lambda: current().step_count).values())


LIVE = [
    (".metadata", "fifo"),
    (".metadata", "link outside"),
    ("__1_0.distcp", "fifo"),
    ("__1_0.distcp", "link outside"),
    ("__1_0.distcp", "larger"),
    ("__1_0.distcp", "directory"),
    ("rank-1.pt", "fifo"),
]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_load_checkpoint_of_a_spoiled_folder_is_refused_unopened_on_live_ranks(dt, outside):
    from dtlab.control.checkpointing import CheckpointFailed
    from dtlab.control.errors import RankError

    good = dt.checkpoint()
    for name, kind in LIVE:
        dt.step(1)
        bad = dt.checkpoint()
        at = dt.trace.last_step
        spoil(bad.path, name, kind, outside)
        listed = {c.path: c for c in dt.checkpoints(verify=True)}[bad.path]
        assert listed.status == "corrupt" and name in listed.problem
        with pytest.raises(CheckpointFailed) as refused:
            within(10, lambda: dt.load_checkpoint(bad.step))  # noqa: B023 (called now)
        said = str(refused.value)
        assert name in said and __import__("re").search(SAID[kind], said), said
        assert "Nothing was loaded" in said and "dt.checkpoints()" in said
        never_read(outside)
        # the ranks asked directly (the notebook's check skipped): refused as well, unopened
        with pytest.raises(RankError, match=SAID[kind]):
            within(10, lambda: dt.run(api.load, str(bad.path), timeout=20))  # noqa: B023
        never_read(outside)
        assert rank_steps(dt) == {at}
    dt.load_checkpoint(good.step)
    assert rank_steps(dt) == {good.step}


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_dcp_folder_without_a_manifest_is_refused_before_its_files_are_opened(dt, outside):
    """A torch.distributed.checkpoint folder dtlab did not write (no manifest), its
    .metadata a FIFO and its part a link outside: refused, nothing of it opened."""
    import torch.distributed.checkpoint as dcp

    from dtlab.control.checkpointing import CheckpointFailed

    folder = dt.checkpoint_root / "step-0000009"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(folder), no_dist=True)
    (part,) = folder.glob("__*_*.distcp")
    spoil(folder, ".metadata", "fifo", outside)
    spoil(folder, part.name, "link outside", outside)
    with pytest.raises(CheckpointFailed, match="no manifest.json: not a complete checkpoint"):
        within(10, lambda: dt.load_checkpoint(str(folder)))
    never_read(outside)

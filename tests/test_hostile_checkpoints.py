"""Checkpoints are untrusted input. A malformed or hostile manifest marks its one folder
corrupt, with the reason, and every other checkpoint stays listed and loadable; nothing
outside the checkpoint's own folder is ever opened (absolute names, '..', links, devices,
FIFOs); no verification reads without bound. One rank in this process (no cluster); a
fuzz test mutates real manifests at random (a fixed seed here; DTLAB_FUZZ_CASES=N for a
longer run)."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from dtlab.agent import checkpoint, restore
from dtlab.agent import job as jobs
from dtlab.agent.attach import attach
from dtlab.agent.state import RANK
from dtlab.records.checkpoints import MANIFEST, CheckpointError, catalogue, checksum_text
from dtlab.records.checkpoints import file_checksum as checksum

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.timeout(120),
]


@pytest.fixture(autouse=True)
def no_job_left():
    yield
    RANK.reset()


@pytest.fixture
def saved(tmp_path):
    """A root with two good checkpoints (steps 1 and 2) of a one-rank job."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(8)]
    attach(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    )
    root = tmp_path / "checkpoints"
    paths = []
    for _ in range(2):
        jobs.current().step()
        paths.append(Path(checkpoint.save(str(root), "t")["path"]))
    return root, paths


def rewrite(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def still_usable(root: Path, good: Path) -> None:
    """The good checkpoint is listed complete, verifies, and loads."""
    listed = {c.path: c for c in catalogue(root, verify=True)}
    assert listed[good].status == "complete", listed[good].problem
    assert restore.load(str(good))["step"] == int(good.name.split("-")[1])


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda m: m.pop("files"), "'files' is None"),
        (lambda m: m.update(files=None), "'files' is None"),
        (lambda m: m.update(step="two"), "'step' is 'two'"),
        (lambda m: m.update(world_size=0), "'world_size' is 0"),
        (lambda m: m["files"].append("x"), "a file entry is 'x'"),
        (lambda m: m["files"][0].update(size="big"), "size 'big'"),
        (lambda m: m["files"][0].update(rank=7), "writer rank 7"),
        (lambda m: m.pop("ranks"), "'ranks' does not hold"),
    ],
)
def test_a_malformed_manifest_marks_its_folder_and_nothing_else(saved, change, said):
    root, (bad, good) = saved
    rewrite(bad, change)
    listed = {c.path: c for c in catalogue(root)}
    assert listed[bad].status == "corrupt" and said in listed[bad].problem
    with pytest.raises(CheckpointError, match="the checkpoint is corrupt"):
        restore.load(str(bad))
    still_usable(root, good)


def point_at(folder: Path, target: str, *, size: int, digest: str) -> None:
    def change(manifest):
        manifest["files"][0].update(name=target, size=size, xxh3=digest)

    rewrite(folder, change)


@pytest.mark.parametrize(
    "target", ["/etc/hostname", "../../../../etc/hostname", "sub/../../x", "/dev/zero", ".."]
)
def test_names_outside_the_folder_are_refused_whatever_their_size_and_checksum(saved, target):
    root, (bad, good) = saved
    real = Path("/etc/hostname")
    size, digest = (real.stat().st_size, checksum(real)) if real.exists() else (0, "0" * 16)
    point_at(bad, target, size=size, digest=digest)
    t0 = time.monotonic()
    listed = {c.path: c for c in catalogue(root, verify=True)}
    assert time.monotonic() - t0 < 10  # never an endless read
    assert listed[bad].status == "corrupt"
    assert "not a plain name inside the checkpoint folder" in listed[bad].problem
    with pytest.raises(CheckpointError, match="refused"):
        restore.load(str(bad))
    still_usable(root, good)


@pytest.mark.parametrize("kind", ["link to a file outside", "link to /dev/zero", "fifo"])
def test_a_listed_file_that_is_not_a_regular_file_is_refused_unread(saved, kind):
    root, (bad, good) = saved
    victim = bad / "rank-0.pt"  # the manifest still lists its true size and checksum
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)  # opening it for reading would wait for a writer forever
    else:
        outside = bad.parent.parent / "outside.pt"
        shutil.copy(good / "rank-0.pt", outside)
        os.symlink("/dev/zero" if "zero" in kind else outside, victim)
    t0 = time.monotonic()
    listed = {c.path: c for c in catalogue(root, verify=True)}
    assert time.monotonic() - t0 < 10
    assert listed[bad].status == "corrupt" and "not a regular file" in listed[bad].problem
    with pytest.raises(CheckpointError, match="not a regular file"):
        restore.load(str(bad))
    still_usable(root, good)


def test_a_checkpoint_folder_that_is_a_link_is_refused(saved, tmp_path):
    root, (bad, good) = saved
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(bad), elsewhere)
    os.symlink(elsewhere, bad)
    listed = {c.path: c for c in catalogue(root)}
    assert listed[bad].status == "corrupt" and "is a link" in listed[bad].problem
    still_usable(root, good)


def test_a_file_grown_past_its_size_is_never_read_to_its_end(saved):
    root, (bad, _) = saved
    path = bad / "rank-0.pt"
    expected = checksum(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    assert checksum(path, limit=path.stat().st_size - 4096) != expected  # read to limit + 1


# --- fuzz ------------------------------------------------------------------------------------


def _mutations(rng: random.Random, manifest: dict, folder: Path):
    """One random edit of a manifest (or of a listed file on disk)."""
    entry = rng.choice(manifest["files"])
    odd = rng.choice([None, -1, 2**70, "x", [], {}, 1.5, True, "../x", "/etc/passwd"])
    choices = [
        lambda: manifest.pop(rng.choice(list(manifest))),
        lambda: manifest.update({rng.choice(list(manifest)): odd}),
        lambda: entry.pop(rng.choice(list(entry))),
        lambda: entry.update({rng.choice(list(entry)): odd}),
        lambda: entry.update(
            name=rng.choice(
                ["../" + entry["name"], "/" + entry["name"], "a/" + entry["name"], ".", "", "\0"]
            )
        ),
        lambda: entry.update(size=entry["size"] + rng.choice([-1, 1, 4096])),
        lambda: entry.update(xxh3=checksum_text(rng.getrandbits(64))),
        lambda: _truncate(_own_file(folder, entry["name"]), rng),
        lambda: _relink(_own_file(folder, entry["name"])),
        lambda: manifest["files"].append(copy.deepcopy(entry)),
    ]
    rng.choice(choices)()


def _own_file(folder: Path, name) -> Path:
    """A regular file directly in ``folder`` (an earlier edit may have renamed the entry
    to a path outside it, or made the file a link: the test never touches those)."""
    path = folder / str(name)
    if path.parent != folder or path.is_symlink() or not path.is_file():
        raise ValueError(f"{name!r} is not a file of the copy")
    return path


def _truncate(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(len(data))] if data else b"")


def _relink(path: Path) -> None:
    path.unlink()
    os.symlink("/dev/zero", path)


def test_fuzzed_manifests_end_in_a_refusal_or_a_correct_load(saved, tmp_path):
    root, (template, good) = saved
    cases = int(os.environ.get("DTLAB_FUZZ_CASES", "100"))
    rng = random.Random(1234)
    reference = restore.load(str(good))["step"]
    for case in range(cases):
        folder = root / f"step-{3 + case:07d}"
        shutil.copytree(template, folder)
        manifest = json.loads((folder / MANIFEST).read_text())
        for _ in range(rng.randint(1, 3)):
            try:
                _mutations(rng, manifest, folder)
            except (AttributeError, IndexError, KeyError, ValueError, TypeError, OSError):
                pass  # this edit did not apply: the others still make the case
        (folder / MANIFEST).write_text(json.dumps(manifest))
        t0 = time.monotonic()
        listed = {c.path: c for c in catalogue(root, verify=True)}
        try:
            loaded = restore.load(str(folder))
        except CheckpointError:
            assert listed[folder].status == "corrupt" or listed[folder].ok
        else:  # it loaded: then it is as written, and the catalogue said so
            assert listed[folder].ok and loaded["step"] == 1
        assert time.monotonic() - t0 < 10, f"case {case} took too long"
        assert listed[good].ok, listed[good].problem
        shutil.rmtree(folder)
    assert restore.load(str(good))["step"] == reference


def test_a_hostile_dcp_metadata_is_refused_before_anything_is_loaded(saved):
    """A .metadata that would run code (with a size and checksum to match) is refused
    before the load begins, and the error says the job was left as it was."""
    import pickle

    root, (bad, good) = saved
    (bad / ".metadata").write_bytes(pickle.dumps(os.getpid))  # a callable, unpickled = run

    def relist(manifest):
        for entry in manifest["files"]:
            if entry["name"] == ".metadata":
                entry.update(
                    size=(bad / ".metadata").stat().st_size, xxh3=checksum(bad / ".metadata")
                )

    rewrite(bad, relist)
    job = jobs.current()
    before = [p.detach().clone() for p in job.params]
    with pytest.raises(CheckpointError, match="was refused .*nothing was loaded, the job is as"):
        restore.load(str(bad))
    assert all(torch.equal(a, p) for a, p in zip(before, job.params, strict=True))
    still_usable(root, good)

"""Checkpoints of the attached job, as the notebook drives them (``dt.checkpointing``).

``dt.checkpoint()`` / ``%dt_checkpoint`` save now, ``dt.checkpoint_every(k)`` during runs,
``dt.checkpoints()`` lists them (a partial or corrupt one is marked, never loaded),
``dt.load_checkpoint(step)`` rewinds the job. Ranks write and read their own parts
(:mod:`dtlab.agent.checkpoint`, :mod:`dtlab.agent.restore`); the notebook only names the
folder, lists the catalogue (:mod:`dtlab.records.checkpoints`) and reports.

The checkpoint root is ``$DTLAB_CHECKPOINT_DIR``, else ``<runs dir>/checkpoints``; with
ranks on several hosts it must be a filesystem every host and the notebook share. A root
``s3://bucket/prefix`` is object storage (:mod:`dtlab.control.object_store`): the ranks
save into a local staging folder under the runs folder, the notebook uploads it (manifest
last) and fetches a checkpoint back, verified, before the ranks load it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dtlab.agent import api
from dtlab.control.errors import DtlabError, OptionError, RankError
from dtlab.control.mirror import Mirror
from dtlab.control.object_store import Bucket, ObjectStoreError, is_url
from dtlab.control.stepper import Stepper
from dtlab.control.world import World
from dtlab.records.checkpoints import (
    CHOOSE_ANOTHER,
    CheckpointError,
    CheckpointInfo,
    catalogue,
    commit,
    describe,
    remove_partial,
)
from dtlab.records.run_folder import RUNS_DIR_ENV

CHECKPOINT_DIR_ENV = "DTLAB_CHECKPOINT_DIR"
CHECKPOINT_TIMEOUT_S = 900.0  # a save is collective: a dead rank must not hold it forever


class CheckpointFailed(DtlabError):
    """A checkpoint was not written, or was refused; the job is as it was."""


# --- on the ranks ---------------------------------------------------------------------
class Checkpointing:
    """Checkpoints of the attached job, and how to build the job again on fresh engines
    (``dt.checkpointing``; ``dt.checkpoint`` is ``dt.checkpointing.checkpoint``)."""

    def __init__(self, world: World, stepper: Stepper) -> None:
        self.world = world
        self.stepper = stepper
        # how to build the job again on fresh engines: (setup, args, kwargs)
        self.job_setup: tuple[Callable | str, tuple, dict] | None = None
        self.autosave_every: int | None = None
        self._checkpoint_root: Path | Bucket | None = None
        self._env_bucket: Bucket | None = None
        self.mirror: Mirror | None = None  # copies every local checkpoint to a bucket

    # --- where ------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path | Bucket:
        """A local folder, or a :class:`Bucket` (``s3://bucket/prefix``)."""
        if self._checkpoint_root is not None:
            return self._checkpoint_root
        env = os.environ.get(CHECKPOINT_DIR_ENV)
        if env and is_url(env):
            if self._env_bucket is None or self._env_bucket.url != env.rstrip("/"):
                self._env_bucket = self._bucket(env)  # one connection, not one per call
            return self._env_bucket
        base = Path(env) if env else Path(os.environ.get(RUNS_DIR_ENV) or "runs") / "checkpoints"
        return base.absolute()

    @checkpoint_root.setter
    def checkpoint_root(self, path: str | os.PathLike) -> None:
        self._checkpoint_root = self._bucket(path) if is_url(path) else Path(path).absolute()
        if self.mirror is not None:  # it mirrors the new root from now on
            self.checkpoint_mirror = self.mirror.bucket.url

    @property
    def checkpoint_mirror(self) -> str | None:
        """``s3://bucket/prefix`` that every checkpoint saved under the (local) root is
        copied to in the background (None: none). ``dt.mirror.status()`` says how far."""
        return None if self.mirror is None else self.mirror.bucket.url

    @checkpoint_mirror.setter
    def checkpoint_mirror(self, url: str | None) -> None:
        if url is not None and not is_url(url):
            raise OptionError(f"a mirror is object storage, s3://bucket/prefix; got {url!r}")
        root = self.checkpoint_root
        if url is not None and isinstance(root, Bucket):
            raise OptionError(
                f"the checkpoint root is already a bucket ({root}): a mirror copies a local "
                "root; set dt.checkpoint_root to a folder first"
            )
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None
        if url is not None:
            assert isinstance(root, Path)
            self.mirror = Mirror(self._bucket(url), root)
            self.mirror.scan()  # what the root holds already

    @staticmethod
    def _bucket(url) -> Bucket:
        work = Path(os.environ.get(RUNS_DIR_ENV) or "runs").absolute() / "checkpoint-staging"
        try:
            return Bucket(str(url), work)
        except ObjectStoreError as e:
            raise OptionError(str(e)) from None

    # --- save ---------------------------------------------------------------------------
    def checkpoint(
        self, tag: str | None = None, *, to: str | os.PathLike | None = None
    ) -> CheckpointInfo:
        """Save the job's full state now, on every rank; the checkpoint exists only when
        every rank wrote its part (else CheckpointFailed, earlier ones untouched). ``to``:
        this save's root (a folder or ``s3://bucket/prefix``) instead of the root's."""
        self.stepper.sync_job()  # a job must be attached; also starts the trace
        where: Path | Bucket
        if to is None:
            where = self.checkpoint_root
        else:
            where = self._bucket(to) if is_url(to) else Path(to).absolute()
        root = where.staging() if isinstance(where, Bucket) else where
        token = secrets.token_hex(4)
        try:  # the ranks write a finished .partial-* folder; only this commits it
            saved = self._on_ranks(api.save, str(root), token, tag, False, what="save")
        except BaseException:  # a rank failed or died at any point: nothing new is kept
            remove_partial(root, token)
            raise
        if isinstance(where, Bucket):
            return self._upload(where, Path(saved[0]["path"]), saved[0]["step"])
        final = commit(root, Path(saved[0]["path"]), saved[0]["step"])
        info = describe(final)
        assert info is not None  # commit gave it a checkpoint's name
        if self.mirror is not None and to is None:
            self.mirror.add(final)  # copied in the background; the job steps on
        return info

    def _upload(self, bucket: Bucket, staged: Path, step: int) -> CheckpointInfo:
        try:
            info = bucket.upload(staged, step)
        except BaseException as e:  # kept, complete, as a local checkpoint: not lost
            bucket.kept.mkdir(parents=True, exist_ok=True)
            kept = commit(bucket.kept, staged, step)
            if not isinstance(e, (CheckpointError, ObjectStoreError)):
                raise
            raise CheckpointFailed(
                f"checkpoint of step {step} not saved to {bucket}: {e}. Nothing of it lists "
                f"as complete there; the job is as it was. It is kept on this machine: "
                f"dt.load_checkpoint('{kept}') loads it"
            ) from None
        shutil.rmtree(staged, ignore_errors=True)
        return info

    def checkpoint_every(self, steps: int | None) -> None:
        """Save every ``steps`` steps during runs (None or 0: stop). A failed save stops
        the run with its error; the job stays as it was after the step."""
        if steps is not None and steps < 0:
            raise OptionError(f"steps must be positive (or 0/None to stop), got {steps}")
        if steps and isinstance(self.checkpoint_root, Bucket):
            raise OptionError(
                f"periodic saves go to a local folder: the root is {self.checkpoint_root}; "
                "set dt.checkpoint_root to a folder for checkpoint_every (saves to a bucket "
                "are taken with dt.checkpoint())"
            )
        self.world.run(api.set_autosave, str(self.checkpoint_root), steps or None)
        self.autosave_every = steps or None  # re-applied where dtlab rebuilds the job

    def apply_autosave(self, on: bool) -> None:
        """Periodic saves off during a replay (its steps are not the job's), back after."""
        if self.autosave_every and not isinstance(self.checkpoint_root, Bucket):
            self.world.run(
                api.set_autosave, str(self.checkpoint_root), self.autosave_every if on else None
            )

    def checkpoints(self, *, verify: bool = False) -> list[CheckpointInfo]:
        """Every checkpoint under the root, oldest step first. ``verify`` reads each file
        for its checksum (else sizes only)."""
        root = self.checkpoint_root
        if isinstance(root, Bucket):
            try:
                return root.catalogue(verify=verify)
            except ObjectStoreError as e:
                raise CheckpointFailed(str(e)) from None
        local = catalogue(root, verify=verify)
        return local if self.mirror is None else self._with_mirror(local, verify)

    def _with_mirror(self, local: list[CheckpointInfo], verify: bool) -> list[CheckpointInfo]:
        """The local catalogue and the mirror's, by folder name: each entry ``local``,
        ``mirrored`` or ``both``; a local copy that is gone or damaged gives way to a
        complete one in the bucket (what a load then fetches)."""
        assert self.mirror is not None
        states = {u.name: u for u in self.mirror.status()}
        try:
            remote = {c.url.rsplit("/", 1)[-1]: c for c in self.mirror.bucket.catalogue(
                verify=verify) if c.url}  # fmt: skip
        except ObjectStoreError as e:
            warnings.warn(f"dtlab: the mirror cannot be listed: {e}", stacklevel=3)
            remote = {}
        merged = []
        for info in local:
            name, there = info.path.name, remote.pop(info.path.name, None)
            upload = states.get(name)
            said = _mirror_state(upload)
            if there is not None and there.ok and not info.ok:
                merged.append(replace(there, copies="mirrored", mirror=f"local copy {info.status}"))
            elif there is not None and there.ok:
                merged.append(replace(info, copies="both", mirror="mirrored"))
            else:
                merged.append(replace(info, copies="local", mirror=said))
        merged += [replace(c, copies="mirrored", mirror="mirrored") for c in remote.values()]
        return sorted(merged, key=lambda c: (c.step, c.created))

    # --- load -------------------------------------------------------------------------
    def find_checkpoint(self, which: int | str | os.PathLike = "latest") -> CheckpointInfo:
        """A checkpoint by step (the newest of that step), ``"latest"`` (the last complete
        one written), or path."""
        found = self.checkpoints()
        if which == "latest":
            done = [c for c in found if c.ok]
            if not done:
                raise CheckpointFailed(
                    f"no checkpoint under {self.checkpoint_root} yet: take one with %dt_checkpoint"
                )
            return max(done, key=lambda c: c.created)  # the last written, whatever its step
        if isinstance(which, int):
            same = [c for c in found if c.step == which and c.status != "partial"]
            if not same:
                steps = sorted({c.step for c in found if c.ok})
                raise CheckpointFailed(
                    f"no checkpoint of step {which}; complete ones: steps {steps or 'none'}"
                )
            return max(same, key=lambda c: c.created)
        said = str(which).rstrip("/")
        if is_url(said):  # in the root's bucket, or one a save was sent to (to=)
            bucket = self._bucket_of(said)
            if bucket is not self.checkpoint_root:
                try:
                    found = bucket.catalogue()
                except ObjectStoreError as e:
                    raise CheckpointFailed(str(e)) from None
            listed = [c for c in found if c.url == said]
            if not listed:
                raise CheckpointFailed(f"{said} is not a checkpoint in {bucket}")
            return listed[0]
        if isinstance(self.checkpoint_root, Bucket):  # the folder it is fetched into
            listed = [c for c in found if said == str(c.path)]
            if listed:
                return listed[0]
        info = describe(Path(which))
        if info is None:
            raise CheckpointFailed(f"{which} is not a dtlab checkpoint folder")
        return info

    def load_checkpoint(self, which: int | str | os.PathLike = "latest") -> dict:
        """Rewind the job to a checkpoint on every rank (a new trace starts there).
        A partial, corrupt or foreign checkpoint is refused and the job is unchanged."""
        info = self.find_checkpoint(which)
        result = self.load_into_job(info)
        self.stepper.new_trace(resumed_from=str(info.path), step=info.step)
        return result

    def load_into_job(self, info: CheckpointInfo) -> dict:
        if info.status == "partial":
            raise CheckpointFailed(
                f"{info.where} is partial ({info.problem}): {self._previous_good(info)}"
            )
        if info.url is not None:
            root = self._bucket_of(info.url)
            try:  # fetched and checked (sizes, checksums) before any rank opens a file
                fetched = root.fetch(info)
            except (CheckpointError, ObjectStoreError) as e:
                raise CheckpointFailed(
                    f"{e}. Nothing was loaded, the job is unchanged; {CHOOSE_ANOTHER}: "
                    f"{self._previous_good(info)}"
                ) from None
            local = describe(fetched)
            assert local is not None
            try:
                return self.load_into_job(local) | {"path": info.where}
            finally:
                root.forget_fetched(fetched)
        # the folder checked here as dt.checkpoints() lists it (the manifest read confined
        # and bounded, every listed file's kind and size, never opened) before any rank is
        # asked: a corrupt one is refused unopened. Checksums are the ranks' (each verifies
        # its own share as it loads): reading every file here too would read it all twice
        checked = describe(info.path) if info.ok else info
        if checked is None or not checked.ok:
            problem = checked.problem if checked is not None else "not a checkpoint folder"
            raise CheckpointFailed(
                f"checkpoint {info.path} refused: {problem}. Nothing was loaded, the job is "
                f"unchanged; {CHOOSE_ANOTHER}: {self._previous_good(info)}"
            )
        self.stepper.sync_job()
        try:
            loaded = self._on_ranks(api.load, str(info.path), what="load")
        except CheckpointFailed as e:
            raise CheckpointFailed(f"{e}. {self._previous_good(info)}") from None
        missing: dict[str, list[int]] = {}
        for rank, said in sorted(loaded.items()):
            for part in said["missing"]:
                missing.setdefault(part, []).append(rank)
        return loaded[0] | {"path": str(info.path), "ranks": loaded, "missing": missing}

    def _previous_good(self, bad: CheckpointInfo) -> str:
        good = [
            c
            for c in self.checkpoints()
            if c.ok and c.where != bad.where and (c.step, c.created) < (bad.step, bad.created)
        ]
        if not good:
            return "there is no earlier complete checkpoint"
        step = good[-1].step
        return f"the previous complete one is step {step}: dt.load_checkpoint({step})"

    def _on_ranks(self, fn: Callable, *args, what: str) -> dict:
        try:
            return self.world.run(fn, *args, timeout=CHECKPOINT_TIMEOUT_S)
        except RankError as e:
            said = list(dict.fromkeys(f.evalue for f in e.failures.values()))
            if said and all(f.ename == "CheckpointError" for f in e.failures.values()):
                raise CheckpointFailed(" / ".join(said)) from None
            raise

    # --- building the job on fresh engines ---------------------------------------------
    def set_job_setup(self, setup: Callable | str, *args, **kwargs) -> None:
        """How to build and attach the job on every rank (a function called with ``args``
        and ``kwargs`` on each rank, or the source of a %%dt cell); used where dtlab needs
        the job on fresh engines (``dt.resume_check``, ``dt.restart``). ``%dt_demo`` sets
        it for the demo job. A pipeline's setup that takes ``plan=`` is given the plan the
        job runs after ``dt.repartition``."""
        if not (callable(setup) or isinstance(setup, str)):
            raise TypeError("setup must be a function run on every rank, or %%dt cell source")
        self.job_setup = (setup, args, kwargs)

    def forget_job_setup(self) -> None:
        """The job on the ranks now is not the one ``set_job_setup`` builds (a script
        attached its own)."""
        self.job_setup = None

    def rebuild_with_plan(self, bounds: list[int]) -> None:
        """Fresh engines (a restart, a resume check) rebuild a pipeline with the plan it
        runs now, so that its checkpoints load: a setup that takes ``plan=`` is given it."""
        if self.job_setup is not None and "plan" in self.job_setup[2]:
            setup, args, kwargs = self.job_setup
            self.job_setup = (setup, args, {**kwargs, "plan": list(bounds)})

    def refuse_unbuildable_job(self) -> None:
        """A job dtlab cannot rebuild on fresh engines (a script job) is refused with why,
        before anything looks for checkpoints. A rank that cannot be asked (dead) says
        nothing here: what follows reports it."""
        if self.job_setup is not None:
            return
        try:
            problem = self.world.run(api.checkpoint_problem, ranks=[0], timeout=10)[0]
        except DtlabError:
            return
        if problem:
            raise DtlabError(problem)

    def set_up_job(self) -> None:
        if self.job_setup is None:
            self.refuse_unbuildable_job()  # a script job: why, not how to set one up
            raise DtlabError(
                "dtlab does not know how to build your job on fresh engines: call "
                "dt.set_job_setup(fn) with a function that attaches it on every rank "
                "(or pass fresh=False to check on the live engines)"
            )
        setup, args, kwargs = self.job_setup
        if isinstance(setup, str):
            self.world.execute(setup)
        else:
            self.world.run(api.set_up, setup, args, kwargs)

    def _bucket_of(self, url: str) -> Bucket:
        """The bucket root a checkpoint's URL lies in (the root's, the mirror's, or a
        ``to=`` one)."""
        for root in (self.checkpoint_root, self.mirror.bucket if self.mirror else None):
            if isinstance(root, Bucket) and url.startswith(root.url + "/"):
                return root
        return self._bucket(url.rsplit("/", 1)[0])

    def remove_checkpoint(self, info: CheckpointInfo) -> None:
        if info.url is not None:
            self._bucket_of(info.url).remove(info)
        else:
            shutil.rmtree(info.path, ignore_errors=True)


def _mirror_state(upload) -> str:
    """How a local checkpoint's copy to the mirror stands, in a few words."""
    if upload is None:
        return "not mirrored"
    if upload.state == "uploading":
        return f"uploading, {upload.sent_bytes / 2**20:.1f} of {upload.size_bytes / 2**20:.1f} MiB"
    if upload.state == "failed":
        return f"mirror failed: {upload.error}"
    return upload.state

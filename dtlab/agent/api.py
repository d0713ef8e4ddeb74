"""What the notebook may ask of a rank: every function that control/ runs on the engines.

ipyparallel ships a function by reference (its module and its name), so an engine imports
the module that defines it. Defining them all here keeps notebook-side code (control/,
views/) out of the ranks, and makes this docstring the list of the requests a rank serves.
Each function imports the agent code it uses when it is called: the notebook imports this
module only to name the functions, and must not load torch for that.

Lifetime (control/lifecycle.py)
    describe_engine, open_store, join, check_group
Jobs (demo.py, control/training.py, control/checkpointing.py)
    attach_demo, attach_demo_pipeline, set_up, describe_job, rank_now
Stepping and records (control/stepper.py, control/replays.py)
    serve, record_at, fetch, records_between, stash_records
Checkpoints (control/checkpointing.py)
    save, load, set_autosave, checkpoint_problem
Pipelines (control/partitions.py)
    stage_report, profile_blocks, move_blocks
Scripts (control/scripts.py)
    start_script, script_status, stop_script, deepspeed_save, deepspeed_load_next
Hangs and communication (control/hangs.py, control/comm_bench.py)
    start_sidecar, bandwidth_sweep
A job started by ``torchrun -m dtlab.run`` (control/connect.py; on the engine's thread)
    job_where, job_claim, job_hold_at, job_renew, job_release, job_run_code, job_stacks

The stepping channel (``serve``) and the sidecar carry further requests of their own; their
messages are typed in :mod:`dtlab.records.wire`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# --- lifetime ----------------------------------------------------------------------------


def describe_engine():
    """EngineFacts of this engine process (host, devices, pid), before it has a rank."""
    from dtlab.agent.identity import describe_engine as describe

    return describe()


def open_store(port: int, world_size: int, timeout_s: float, bind: str) -> int:
    """Rank 0: open the rendezvous store; -> the port it listens on."""
    from dtlab.agent.rendezvous import open_store as open_

    return open_(port, world_size, timeout_s, bind)


def join(plan):
    """Make this engine the rank ``plan`` says (process group, namespace); -> RankInfo."""
    from dtlab.agent.rendezvous import join as join_

    return join_(plan)


def check_group() -> int:
    """All-reduce of the rank ids: proves the group of a reused engine still works."""
    from dtlab.agent.rendezvous import check_group as check

    return check()


# --- jobs --------------------------------------------------------------------------------


def attach_demo(ddp: bool, record: bool, lr: float, config: dict):
    from dtlab.agent.demo_job import attach_demo as attach

    return attach(ddp=ddp, record=record, lr=lr, **config)


def attach_demo_pipeline(record: bool, lr: float, config: dict, **options):
    from dtlab.agent.demo_job import attach_demo_pipeline as attach

    return attach(record=record, lr=lr, **options, **config)


def set_up(setup: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a job's set-up function (rebuilding it on fresh engines)."""
    return setup(*args, **kwargs)


def describe_job():
    """(how many jobs were attached so far, JobInfo of the current one)."""
    from dtlab.agent.job import attach_count, current

    return attach_count(), current().info


def rank_now():
    """(RankInfo as of now, InitialState of the attached job or None, its JobInfo as of
    now: a script job's says which observations were switched off since it began)."""
    from dtlab.agent.job import current
    from dtlab.agent.rendezvous import describe_now

    job = current()
    return describe_now(), job.initial, job.info_now()


# --- stepping and records ----------------------------------------------------------------


def serve(
    address: str, key: str, rank: int, relay: int | None = None, upstream: str | None = None
) -> int:
    """Connect the stepping channel and serve it (through ``relay``'s host relay, if one,
    which sends up to ``upstream``, a group relay, if one)."""
    from dtlab.agent.stepping import serve as serve_

    return serve_(address, key, rank, relay, upstream)


def open_group_relay(address: str, key: str, rank: int) -> str:
    """Start this rank's relay as a group relay; the address other hosts' relays use."""
    from dtlab.agent.stepping import open_group_relay as open_

    return open_(address, key, rank)


def record_at(step: int):
    """(the full record of ``step`` or None, the steps this rank still keeps)."""
    from dtlab.agent.job import current

    job = current()
    return job.record_at(step), job.kept_steps()


def fetch(name: str, what: str):
    """A parameter or its gradient as a numpy array (None when it has none)."""
    import torch

    from dtlab.agent.job import current

    tensor = current().tensor(name, what)
    if tensor is not None and tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return None if tensor is None else tensor.numpy()


def records_between(first: int, last: int) -> list:
    """The full records of steps first..last the rank's buffer still holds."""
    from dtlab.agent.job import current

    return [r for r in current().records if first <= r.step <= last]


def stash_records(on: bool) -> None:
    """Put the rank's step records aside (on) or back (off): a replay's records must not
    mix with them."""
    from dtlab.agent.job import current

    current().stash_records(on)


# --- checkpoints -------------------------------------------------------------------------


def save(root: str, token: str, tag: str | None, commit: bool = True) -> dict:
    """Write this rank's part of a checkpoint; ``commit=False``: leave the finished folder
    for the notebook to rename once every rank has returned."""
    from dtlab.agent.checkpoint import save as save_

    return save_(root, token, tag=tag, commit=commit)


def load(path: str) -> dict:
    from dtlab.agent.restore import load as load_

    return load_(path)


def set_autosave(root: str | None, every: int | None) -> None:
    from dtlab.agent.job import current

    current().autosave = (root, every) if every else None


def checkpoint_problem() -> str | None:
    """Why the attached job cannot be checkpointed or rebuilt (a script job), or None."""
    from dtlab.agent.job import checkpoint_problem as problem

    return problem()


# --- pipelines ---------------------------------------------------------------------------


def stage_report():
    from dtlab.agent.pipeline_job import current

    return current().report()


def profile_blocks(repeats: int) -> list:
    from dtlab.agent.pipeline_job import current

    return current().profile(repeats)


def move_blocks(blocks: tuple, bounds: tuple, timeout_s: float, move_id: str) -> dict:
    from dtlab.agent.repartition import repartition

    return repartition(blocks, bounds, timeout_s, move_id)


# --- scripts -----------------------------------------------------------------------------


def start_script(path: str, argv: list[str], cwd: str | None, record: bool) -> dict:
    from dtlab.agent.script import start

    return start(path, argv, cwd, record)


def script_status():
    from dtlab.agent.script import status

    return status()


def stop_script():
    from dtlab.agent.script import stop

    return stop()


def deepspeed_save(folder: str, tag: str) -> dict:
    from dtlab.agent.deepspeed_checkpoint import save

    return save(folder, tag)


def deepspeed_load_next(folder: str, tag: str) -> None:
    from dtlab.agent.deepspeed_checkpoint import load_when_initialized

    load_when_initialized(folder, tag)


# --- recovery and communication ------------------------------------------------------------


def start_sidecar(address: str, key: str, rank: int) -> None:
    from dtlab.agent.sidecar import start

    start(address, key, rank)


def bandwidth_sweep(sizes: list[int], iters: int, warmup: int, dtype: str):
    from dtlab.agent.bandwidth import sweep

    return sweep(sizes, iters=iters, warmup=warmup, dtype=dtype)


# --- a job started by torchrun -m dtlab.run (agent/batch_engine.py) -----------------------


def job_where():
    from dtlab.agent.batch_engine import where

    return where()


def job_claim(token: str, lease_s: float):
    from dtlab.agent.batch_engine import claim

    return claim(token, lease_s)


def job_hold_at(token: str, step: int | None, lease_s: float):
    from dtlab.agent.batch_engine import hold_at

    return hold_at(token, step, lease_s)


def job_renew(token: str, lease_s: float):
    from dtlab.agent.batch_engine import renew

    return renew(token, lease_s)


def job_release(token: str) -> None:
    from dtlab.agent.batch_engine import release

    release(token)


def job_run_code(token: str, code: str) -> tuple[str, str, str | None]:
    from dtlab.agent.batch_engine import run_code

    return run_code(token, code)


def job_pull(token: str, name: str):
    from dtlab.agent.batch_engine import pull

    return pull(token, name)


def job_push(token: str, values: dict) -> None:
    from dtlab.agent.batch_engine import push

    push(token, values)


def job_last_record():
    """This rank's StepRecord of its last step (None before its first)."""
    from dtlab.agent.batch_engine import last_record

    return last_record()


def job_stacks() -> str:
    """Every thread's Python stack on this rank, now (the script's while it runs)."""
    from dtlab.agent.batch_engine import stacks

    return stacks()

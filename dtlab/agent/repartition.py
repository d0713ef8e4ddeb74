"""Move pipeline blocks between the ranks of a running job, all or nothing.

Runs on every rank at once (the notebook calls :func:`repartition` on all). Stages:

1. prepare (local): each block leaving this rank is serialised with its parameters and
   optimizer state (per parameter, under its full name);
2. agree: every rank says whether it could; if one could not, nobody changes anything;
3. exchange: sizes by all_gather, then bytes point to point (only to the rank that will
   hold the block) on dtlab's gloo control group, waited on with a deadline;
4. build (local): the new stage (kept blocks are the same objects: no copy), a new
   optimizer with the old hyper-parameters and state, the scheduler's state;
5. agree again; then commit (local, cannot fail half-way): the job takes the new stage.

Until the commit every rank's job is exactly as it was, so a bad plan, a block that
cannot be serialised or a peer that dies mid-move leaves nothing half-moved.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import signal
import time

import torch
import torch.distributed as dist

from dtlab.agent.pipeline_job import PipelineJob, current
from dtlab.agent.pipeline_stage import StageModule
from dtlab.agent.state import RANK
from dtlab.records import Plan

MOVE_TIMEOUT_S = 120.0
POLL_S = 0.0005

STALLED = (
    "a rank died or hangs; nothing moved on this rank. Restart from the last "
    "checkpoint (%dt_restart --from-checkpoint)"
)


class MoveFailed(RuntimeError):
    """The move was abandoned before any rank changed; the job is as it was."""


def repartition(
    blocks: tuple[str, ...],
    bounds: tuple[int, ...],
    timeout_s: float = MOVE_TIMEOUT_S,
    move_id: str = "",
) -> dict:
    """Take the stage that ``Plan(blocks, bounds)`` gives this rank; returns what moved.

    One deadline covers every phase. Raises :class:`MoveFailed` (nothing changed here)
    naming what went wrong where."""
    job = current()
    new = Plan(tuple(blocks), tuple(bounds))
    if new.blocks != job.plan.blocks:
        raise MoveFailed("the plan's blocks are not this job's blocks; nothing moved")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group()
    started, deadline = time.perf_counter(), time.monotonic() + timeout_s
    moves = job.plan.moves_to(new)
    outgoing, problem = _prepare(job, moves, rank)
    decision = Decision(move_id or f"{time.time_ns()}", rank)
    try:
        _agree(problem, group, "prepare", deadline)
        incoming = _exchange(outgoing, moves, rank, world, group, deadline)
        try:
            built, problem = _build(job, new, incoming, rank), ""
        except Exception as e:  # noqa: BLE001 - reported to every rank before anyone commits
            built, problem = None, f"{type(e).__name__}: {e}"
        _agree(problem, group, "build", deadline)
    except BaseException:
        decision.abort()  # a peer still waiting must not commit on a late agreement
        raise
    if not decision.commit():  # another rank gave up first: nobody commits
        raise MoveFailed("a peer gave up at its deadline; nothing moved: every rank kept its stage")
    with _no_interrupt():
        job.rebind(*built)
    sent = sum(len(b) for b in outgoing.values())
    return {
        "moved": {n: list(m) for n, m in moves.items()},
        "bytes_sent": sent,
        "seconds": time.perf_counter() - started,
        "blocks": list(job.module.order),
    }


class Decision:
    """Commit or abort, settled once for all ranks in the job's store: the first rank to
    write wins (compare_set), and every rank obeys what is there. A rank that timed out
    writes "abort", so a peer whose late agreement still completes does not commit."""

    def __init__(self, move_id: str, rank: int) -> None:
        self.key = f"dtlab/repartition/{move_id}"
        self.rank = rank

    def _settle(self, vote: str) -> str:
        from torch.distributed.distributed_c10d import _get_default_store

        try:
            value = _get_default_store().compare_set(self.key, "", vote)
        except Exception:  # no store (one rank) or it is gone: this rank's own vote
            return vote
        return value.decode() if isinstance(value, bytes) else str(value)

    def commit(self) -> bool:
        return self._settle("commit") == "commit"

    def abort(self) -> None:
        self._settle("abort")


@contextlib.contextmanager
def _no_interrupt():
    """The commit swaps several attributes: a SIGINT half-way would leave a mixed job."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _group():
    from dtlab.agent.groups import control_group

    return control_group()


def _prepare(job: PipelineJob, moves: dict, rank: int) -> tuple[dict[int, bytes], str]:
    """{destination rank: bytes of the blocks it gets from me}, or a problem."""
    leaving: dict[int, list[str]] = {}
    for name, (old, new) in moves.items():
        if old == rank:
            leaving.setdefault(new, []).append(name)
    try:
        with job.hooks_off():
            return {dest: _pack(job, names) for dest, names in leaving.items()}, ""
    except Exception as e:  # noqa: BLE001
        names = sorted(n for group in leaving.values() for n in group)
        return {}, f"block(s) {names} cannot move: {type(e).__name__}: {e}"


def _pack(job: PipelineJob, names: list[str]) -> bytes:
    by_param = {id(p): n for n, p in job.module.named_parameters()}
    state = {by_param[id(p)]: s for p, s in job.optimizer.state.items() if id(p) in by_param}
    payload = {}
    for name in names:
        block = job.module.block(name)
        prefix = name + "."
        payload[name] = {
            "module": block,
            "optimizer": {k: v for k, v in state.items() if k.startswith(prefix)},
        }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _agree(problem: str, group, phase: str, deadline: float) -> None:
    """All ranks learn whether any rank has a problem; MoveFailed on all if so (the rank
    that had it says what; the notebook gathers every rank's message)."""
    flag = torch.tensor([int(bool(problem))], dtype=torch.int64)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _finish(work, deadline, phase)
    if problem:
        raise MoveFailed(f"{phase}: {problem}. Nothing moved: every rank kept its stage")
    if flag.item():
        raise MoveFailed(
            f"{phase} failed on another rank. Nothing moved: every rank kept its stage"
        )


def _finish(work, deadline: float, phase: str) -> None:
    """Wait with a deadline: a gloo collective with a dead peer may block until the group
    timeout (30 min by default, docs/design.md), and polling keeps SIGINT deliverable."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise MoveFailed(f"{phase}: peers did not answer in time; {STALLED}")
        time.sleep(POLL_S)
    work.wait()  # raises the collective's own error, if it had one


def _exchange(
    outgoing: dict[int, bytes], moves: dict, rank: int, world: int, group, deadline: float
) -> dict[int, bytes]:
    sizes = torch.zeros(world, dtype=torch.int64)
    for dest, data in outgoing.items():
        sizes[dest] = len(data)
    table = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
    _finish(dist.all_gather(table, sizes, group=group, async_op=True), deadline, "exchange")
    ops, incoming = [], {}
    for dest, data in outgoing.items():
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        ops.append(dist.P2POp(dist.isend, buf, _peer(dest, group), group=group))
    for src in range(world):
        size = int(table[src][rank])
        if size:
            incoming[src] = torch.empty(size, dtype=torch.uint8)
            ops.append(dist.P2POp(dist.irecv, incoming[src], _peer(src, group), group=group))
    if RANK.fault_repartition_die:  # dtlab.inject.die_in_repartition
        RANK.fault_repartition_die = False
        os.kill(os.getpid(), signal.SIGKILL)  # as a crash between prepare and commit
    for work in dist.batch_isend_irecv(ops) if ops else []:
        # gloo's send/recv works never report completion to polling: wait, with a limit
        left = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
        try:
            work.wait(left)
        except RuntimeError as e:
            raise MoveFailed(f"exchange: blocks did not arrive ({e}); {STALLED}") from None
    return {src: t.numpy().tobytes() for src, t in incoming.items()}


def _peer(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _build(job: PipelineJob, new: Plan, incoming: dict[int, bytes], rank: int):
    received = {}
    for data in incoming.values():
        # from this job's own ranks over its process group: the same trust as the job
        received.update(torch.load(io.BytesIO(data), weights_only=False, map_location=job.device))
    if RANK.fault_repartition_build:  # dtlab.inject.fail_repartition
        RANK.fault_repartition_build = False
        raise RuntimeError("injected failure while building the new stage")
    blocks = []
    for name in new.stage_blocks(rank):
        if name in received:
            blocks.append((name, received[name]["module"]))
        else:
            blocks.append((name, job.module.block(name)))
    stage = StageModule(blocks)
    optimizer = job.make_optimizer(stage.parameters())
    _carry_optimizer(job, stage, optimizer, received)
    scheduler = None
    if job.scheduler is not None:
        scheduler = job.make_scheduler(optimizer)
        scheduler.load_state_dict(job.scheduler.state_dict())
    _copy_hyperparameters(job.optimizer, optimizer)  # after the scheduler set its own LR
    return stage, new, optimizer, scheduler


def _carry_optimizer(job: PipelineJob, stage: StageModule, optimizer, received: dict) -> None:
    old = {
        n: job.optimizer.state[p]
        for n, p in job.module.named_parameters()
        if p in job.optimizer.state
    }
    for block in received.values():
        old.update(block["optimizer"])
    names = [n for n, _ in stage.named_parameters()]
    state = {i: old[n] for i, n in enumerate(names) if n in old}
    # through load_state_dict: it puts each state tensor where the optimizer wants it
    # (a fused or capturable AdamW's step on the device, a plain one's on the CPU)
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _copy_hyperparameters(old, new) -> None:
    if len(old.param_groups) != 1 or len(new.param_groups) != 1:
        raise ValueError(
            "a pipeline job's optimizer must have one parameter group to be re-partitioned "
            f"(it has {len(old.param_groups)})"
        )
    for key, value in old.param_groups[0].items():
        if key != "params":
            new.param_groups[0][key] = value

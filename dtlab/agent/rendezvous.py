"""Make this engine a torch.distributed rank, check the group, and leave it.

Stages, each run on the engines by control/lifecycle.py (through agent/api.py):
1. ``open_store`` on the engine that becomes rank 0: its TCPStore listens before anyone
   connects (with env:// a rank that connects before rank 0 listens backs off 0.3-0.7 s;
   a store already listening never did, docs/design.md);
2. ``join(plan)`` on every rank at once: environment, threads, device, process group,
   then an all_reduce of the rank ids that proves the group works;
3. ``check_group`` re-proves a live group; ``leave`` destroys it.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from dtlab.agent.identity import describe_rank
from dtlab.agent.state import RANK
from dtlab.agent.threads import thread_env, use_threads
from dtlab.records import RankInfo, RankPlan

# torch's Flight Recorder keeps the last collectives of each group, for the sidecar's hang
# reports; torch reads the size when a group is made
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_SIZE = "2000"  # entries per rank: ~0.2 MB, and room for hours of DDP buckets


def open_store(port: int, world_size: int, timeout_s: float, bind: str = "") -> int:
    """Listen for the rendezvous on this engine (rank 0); return the port (0 = any free).
    ``bind``: the address to listen on ("127.0.0.1" when every rank is on this host;
    "" for all interfaces, which ranks on other hosts need).

    The new store listens before the old group is left, so a port that is taken leaves the
    live group as it was.
    """
    old = RANK.store
    if old is not None and port and old.port == port:
        leave()  # the old store holds this very port
    store = _listen(port, world_size, timeout_s, bind)
    leave()
    RANK.store = store
    return store.port


def _listen(port: int, world_size: int, timeout_s: float, bind: str = ""):
    import torch.distributed as dist

    in_use = OSError(
        f"port {port} is already in use on {socket.gethostname()} (the host of rank 0); "
        "pick another with --port, or leave --port out to use a free one"
    )
    # TCPStore alone listens on every interface; a socket bound here and handed over
    # keeps a one-host job's rendezvous on loopback
    try:
        listening = _bound_socket(bind, port) if bind else None
    except OSError as e:
        raise (in_use if e.errno == errno.EADDRINUSE else e) from None
    try:
        store = dist.TCPStore(
            bind or socket.gethostname(),
            listening.getsockname()[1] if listening else port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listening.fileno() if listening else None,
        )
    except Exception as e:
        if listening is not None:
            listening.close()
        if "EADDRINUSE" in str(e) or "address already in use" in str(e):
            raise in_use from None
        raise
    if listening is not None:
        listening.detach()  # the store owns the descriptor now
    return store


def _bound_socket(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def torchrun_env(plan: RankPlan) -> dict[str, str]:
    """The variables torchrun gives a worker (``LocalElasticAgent._start_workers``), with
    the values it gives them for the same world: one role, "default", so the role's ranks
    are the world's; a launch is one run with no restart. A script reads them from the
    engine's environment as from its own process's (%dt_script, %%dt cells alike).

    ``TORCHELASTIC_USE_AGENT_STORE`` is "True", as torchrun's default (c10d) rendezvous
    says: the store at MASTER_ADDR:MASTER_PORT (rank 0's, here) is already up, so an
    ``env://`` rendezvous of the script's own connects to it instead of opening one on
    that port. Left out, on purpose: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (torchrun's "1"
    tears the process down on a NCCL error; the ranks' group is dtlab's, made before any
    script, and keeps torch's own default), and what only torchrun's own agent reads or
    names files in its log folder (``TORCHELASTIC_ERROR_FILE``,
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``). OMP_NUM_THREADS comes from ``thread_env``; on one
    host MASTER_ADDR is 127.0.0.1 where torchrun says localhost (the same loopback)."""
    return {
        "RANK": str(plan.rank),
        "GROUP_RANK": str(plan.group_rank),
        "ROLE_RANK": str(plan.rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(plan.local_rank),
        "LOCAL_WORLD_SIZE": str(plan.local_world_size),
        "WORLD_SIZE": str(plan.world_size),
        "GROUP_WORLD_SIZE": str(plan.group_world_size),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": plan.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
    }


def _export_env(plan: RankPlan) -> None:
    os.environ.update(plan.env)
    os.environ.update(torchrun_env(plan))
    # for processes the rank starts (DataLoader workers), as torchrun does
    os.environ.update(thread_env(plan.num_threads))


def join(plan: RankPlan) -> RankInfo:
    """Become rank ``plan.rank``: init the process group and prove it with an all_reduce."""
    import torch
    import torch.distributed as dist

    _export_env(plan)
    os.environ.setdefault(FR_BUFFER_ENV, FR_BUFFER_SIZE)
    use_threads(plan.num_threads)
    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = timedelta(seconds=plan.timeout_s)
    if plan.rank == 0:
        store = RANK.store
        if store is None:
            raise RuntimeError("rank 0 has no rendezvous store: open_store comes before join")
    else:
        store = dist.TCPStore(
            plan.master_addr, plan.master_port, plan.world_size, is_master=False, timeout=timeout
        )
    if plan.backend == "nccl":
        torch.cuda.set_device(plan.cuda_device)
        device = torch.device("cuda", plan.cuda_device)
        # gloo beside NCCL so CPU tensors (and dtlab's own small collectives) work too
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            store=store,
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=timeout,
            device_id=device,
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group(
            "gloo", store=store, rank=plan.rank, world_size=plan.world_size, timeout=timeout
        )
    RANK.store, RANK.plan, RANK.device = store, plan, device
    RANK.allreduce_sum = check_group()
    return describe_rank(plan, str(device), RANK.allreduce_sum)


def describe_now() -> RankInfo:
    """This rank as it is now (environment variables may have changed since the launch).
    No collective: it must answer even when the group is stuck."""
    return describe_rank(_joined(), str(RANK.device), RANK.allreduce_sum)


def check_group() -> int:
    """All-reduce the rank ids; the sum is world_size * (world_size - 1) / 2 when sound."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("this engine has no process group; run %dt_launch first")
    device = RANK.device if RANK.device is not None else torch.device("cpu")
    ids = torch.tensor([dist.get_rank()], dtype=torch.int64, device=device)
    dist.all_reduce(ids)
    return int(ids.item())


def _joined() -> RankPlan:
    if RANK.plan is None:
        raise RuntimeError("this engine has not joined a group; run %dt_launch first")
    return RANK.plan


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    device: str


def identity() -> Identity:
    """This process's rank, as joined by dtlab (computed once, in ``join``); a process
    grouped some other way (torchrun) answers from torch.distributed; else rank 0 of 1."""
    plan: RankPlan | None = RANK.plan
    if plan is not None:
        return Identity(plan.rank, plan.world_size, str(RANK.device))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Identity(dist.get_rank(), dist.get_world_size(), "cpu")
    return Identity(0, 1, "cpu")


def rank_namespace() -> dict:
    """Names every rank's notebook namespace gets: rank, world_size, device, torch, dist,
    and dtlab itself (for ``dtlab.attach`` and ``dtlab.inject`` in ``%%dt`` cells)."""
    import torch
    import torch.distributed as dist

    import dtlab

    plan = _joined()
    return {
        "rank": plan.rank,
        "world_size": plan.world_size,
        "local_rank": plan.local_rank,
        "local_world_size": plan.local_world_size,
        "device": RANK.device,
        "torch": torch,
        "dist": dist,
        "dtlab": dtlab,
    }


def leave() -> None:
    """Destroy the process group and drop the store (safe to call when there is none)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    RANK.clear_rendezvous()

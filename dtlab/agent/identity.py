"""Who this process is: facts before it has a rank, and its rank's self-description after.

Both run on each engine (collect step); the notebook combines them (control/rankmap.py,
analysis/consistency.py).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket

from dtlab.records import EngineFacts, RankInfo, RankPlan

# Variables that change what torch.distributed, CUDA and the CPU thread pools do; when
# they differ across ranks the job misbehaves in ways that look like "metaphysics".
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "KMP_")

# Position of this process among those its launcher started, most specific first: the
# fork server's index, then MPI, then Slurm (a notebook inside a Slurm allocation passes
# SLURM_PROCID=0 on to every local engine, so Slurm comes last).
_LAUNCH_INDEX_VARS = (
    "DTLAB_ENGINE_INDEX",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "SLURM_PROCID",
)


def _first_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_engine() -> EngineFacts:
    """Facts the notebook needs to assign ranks (runs on each engine)."""
    import torch

    return EngineFacts(
        host=socket.gethostname(),
        pid=os.getpid(),
        num_cpus=_num_cpus(),
        # device_count does not create a CUDA context, so it is safe before the rank exists
        num_cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        launch_index=_first_int(_LAUNCH_INDEX_VARS),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def relevant_env(environ=None) -> dict[str, str]:
    """The variables dtlab compares across ranks (NCCL_*, TORCH_*, ...). A value whose name
    looks secret never leaves the rank: it is sent as a hash, which still tells ranks
    that differ apart."""
    environ = os.environ if environ is None else environ
    return {
        k: redacted(v) if SECRET_NAME.search(k) else v
        for k, v in sorted(environ.items())
        if k.startswith(ENV_PREFIXES)
    }


def redacted(value: str) -> str:
    return f"<redacted, sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]}>"


def _nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):
        return None


def describe_rank(plan: RankPlan, device: str, allreduce_sum: int) -> RankInfo:
    """This rank's self-description; call after the process group is up."""
    import torch

    return RankInfo(
        rank=plan.rank,
        world_size=plan.world_size,
        local_rank=plan.local_rank,
        local_world_size=plan.local_world_size,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        backend=plan.backend,
        num_threads=torch.get_num_threads(),
        python_version=platform.python_version(),
        torch_version=str(torch.__version__),  # a TorchVersion would make the notebook import torch
        cuda_version=torch.version.cuda,
        nccl_version=_nccl_version(),
        allreduce_sum=allreduce_sum,
        env=relevant_env(),
    )

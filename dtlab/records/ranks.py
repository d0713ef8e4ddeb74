"""What an engine and a rank say about themselves, and what a ``%%dt`` cell gave back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineFacts:
    """What an engine says about itself before it has a rank (collected on each engine).

    ``launch_index`` is the position the launcher gave the process (fork index, MPI rank,
    SLURM_PROCID) when it gave one.
    """

    host: str
    pid: int
    num_cpus: int
    num_cuda_devices: int
    launch_index: int | None = None
    cuda_visible_devices: str | None = None


@dataclass(frozen=True)
class RankPlan:
    """Everything one engine needs to become a torch.distributed rank (made in control/)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str  # "gloo" or "nccl"
    cuda_device: int | None  # index of this rank's GPU as the process sees them (nccl only)
    num_threads: int
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    # torchrun's node numbering: this rank's host among the job's hosts (in the order of
    # their first rank), and how many hosts there are (GROUP_RANK, GROUP_WORLD_SIZE)
    group_rank: int = 0
    group_world_size: int = 1
    run_id: str = "none"  # one id per launch, the same on every rank (TORCHELASTIC_RUN_ID)


@dataclass(frozen=True)
class RankInfo:
    """A live rank as it describes itself after joining the process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str
    pid: int
    device: str
    backend: str
    num_threads: int
    python_version: str
    torch_version: str
    cuda_version: str | None
    nccl_version: str | None
    allreduce_sum: int
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CellOutput:
    """What one rank produced for a ``%%dt`` cell."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the cell's last expression
    error: RemoteFailure | None = None


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised on a rank, reduced to text."""

    ename: str
    evalue: str
    traceback: str = ""

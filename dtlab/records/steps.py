"""What a rank records each optimizer step, and how a run of steps ended.

Plain data (str, int, float, tuples): they pickle cheaply through ipyparallel and tests
build them by hand. A step record as JSON is what the stepping channel carries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the attached model, in module order (``named_parameters``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int


@dataclass(frozen=True)
class DeepSpeedInfo:
    """A DeepSpeed engine's settings as one rank read them: its ds_config and what DeepSpeed
    made of it (the doctor compares them across ranks and with the steps made)."""

    zero_stage: int
    micro_batch: int  # train_micro_batch_size_per_gpu
    accumulation: int  # gradient_accumulation_steps
    train_batch: int  # train_batch_size
    dp_world: int  # the data-parallel world size the engine uses
    precision: str  # "fp32", "fp16" or "bf16"
    config: str = ""  # the config as the engine holds it, as JSON with sorted keys


# mesh dimension names that are data-parallel (ranks that differ only along them train on
# different data), and names that are not (ranks along them share a batch: tensor,
# context, pipeline and expert parallelism); a name "dp..." is data-parallel too
DATA_DIM_NAMES = frozenset(
    ("dp", "ddp", "fsdp", "hsdp", "zero", "data", "batch", "replicate", "shard")
)
MODEL_DIM_NAMES = frozenset(("tp", "cp", "pp", "ep", "etp", "sp", "tensor", "context", "pipeline"))


def is_data_dim_name(name: str) -> bool:
    """Does a mesh dimension of this name split the data (dp, dp_shard, fsdp, ...)?"""
    name = name.lower()
    if name in MODEL_DIM_NAMES:
        return False
    return name in DATA_DIM_NAMES or name.startswith(("dp", "fsdp", "hsdp", "ddp"))


@dataclass(frozen=True)
class MeshInfo:
    """The device mesh a rank trains on, as that rank read it (``dtlab.agent.mesh``):
    which ranks should see the same data and which different data.

    Ranks that differ only along ``data_dims`` train on different data (data-parallel:
    DDP, FSDP's shard and replicate dimensions); ranks with the same coordinate along
    every data dimension (tensor- or context-parallel peers) share their batches.
    """

    dim_names: tuple[str, ...]  # one per dimension ("dim0"... where the mesh named none)
    shape: tuple[int, ...]
    coordinate: tuple[int, ...]  # this rank's index along each dimension
    data_dims: tuple[str, ...] = ()  # the data-parallel dimensions, in mesh order
    source: str = ""  # what it was read from: "fully_shard", "DTensor", ...

    @property
    def size(self) -> int:
        """Ranks in the mesh."""
        return math.prod(self.shape)

    @property
    def data_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate along the data-parallel dimensions (its data shard)."""
        return tuple(
            c for n, c in zip(self.dim_names, self.coordinate, strict=True) if n in self.data_dims
        )

    @property
    def data_degree(self) -> int:
        """How many different data shards the mesh trains on (dp_degree)."""
        return math.prod(
            s for n, s in zip(self.dim_names, self.shape, strict=True) if n in self.data_dims
        )

    @property
    def data_rank(self) -> int:
        """This rank's data shard as one number, 0 .. data_degree - 1 (dp_rank)."""
        rank = 0
        for name, size, at in zip(self.dim_names, self.shape, self.coordinate, strict=True):
            if name in self.data_dims:
                rank = rank * size + at
        return rank

    def describe(self) -> str:
        """E.g. "mesh dp=2 x tp=2 (data-parallel: dp)"."""
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        data = ", ".join(self.data_dims) or "none"
        return f"mesh {dims} (data-parallel: {data})"


@dataclass(frozen=True)
class JobInfo:
    """The attached job as one rank describes it (once, at ``dtlab.attach``)."""

    rank: int
    model: str  # class name of the model the user attached (inside DDP if wrapped)
    wrapper: str | None  # "DistributedDataParallel", or None for a bare model
    optimizer: str
    scheduler: str | None
    scaler: bool
    params: tuple[ParamInfo, ...]
    record: bool  # per-parameter statistics on by default?
    capacity: int  # how many step records the rank keeps
    buffers: tuple[str, ...] = ()  # buffer names in module order (BatchNorm statistics...)
    # how batches are drawn, as the rank saw it: "DataLoader, DistributedSampler",
    # "DataLoader, RandomSampler", "no DataLoader: generator", ... ("": not known)
    data: str = ""
    # DDP's find_unused_parameters (None: not DDP), judged against what backward reached
    find_unused_parameters: bool | None = None
    deepspeed: DeepSpeedInfo | None = None  # the job runs inside a DeepSpeed engine
    # a script job: dtlab's observations switched off after they failed, as
    # ((name, the step from which), ...): the checks they fed say "not checked"
    unobserved: tuple[tuple[str, int], ...] = ()
    # False: this rank calls backward() on no loss of its own (a pipeline stage before the
    # last, in a script's schedule): its recorded loss is nan by design, not a non-finite
    computes_loss: bool = True
    # the device mesh its parameters live on (DTensor, FSDP2, tensor parallel); None: no
    # mesh, or not read: every rank is its own data-parallel replica
    mesh: MeshInfo | None = None


@dataclass(frozen=True)
class InitialState:
    """Fingerprints of a rank's parameters and buffers just before its first step."""

    param_fingerprints: tuple[int, ...]
    buffer_names: tuple[str, ...] = ()
    buffer_fingerprints: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Bytes held at the end of a step. CUDA fields are None where there is no CUDA."""

    rss: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    dtlab_bytes: int = 0  # about what dtlab's own record buffer holds (part of rss)


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Seconds spent in each phase of one step (backward includes DDP's gradient sync)."""

    data: float
    forward: float
    backward: float
    optimizer: float
    record: float = 0.0  # dtlab's own per-step statistics

    @property
    def total(self) -> float:
        return self.data + self.forward + self.backward + self.optimizer + self.record


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one rank measured in one optimizer step (``step`` counts from 1).

    Per-parameter tuples follow ``JobInfo.params``; they stay on the rank (its bounded
    buffer) and are empty in the summaries the notebook receives (:meth:`summary`), or when
    recording is off. ``grad_norm``, ``grad_fingerprint``, ``param_fingerprint`` and
    ``num_nonfinite`` sum them up in one number each, so the notebook can tell whether
    ranks differ at a step and fetch the per-parameter record only then. Fingerprints
    change when any bit changes (different bits with equal fingerprints are possible but
    need a coincidence); 0 means not recorded.
    """

    step: int
    time: float  # wall clock (epoch seconds) at the end of the step
    loss: float
    lr: float | None
    scale: float | None  # GradScaler scale used for this step
    skipped: bool  # optimizer step skipped (GradScaler found inf/nan)
    times: StepTimes
    memory: StepMemory
    indices: tuple[int, ...] = ()  # sample indices this rank consumed
    epoch: int = 0  # passes over the data before this batch (0 during the first)
    epoch_starts: tuple[int, ...] = ()  # positions in ``indices`` where a new epoch began
    # the first module whose forward output was not finite: seen while modules were
    # watched, or found by re-running the micro-batch whose loss was not (agent/nonfinite)
    nonfinite_module: str | None = None
    nonfinite_found: str = ""  # how it was found, or why it could not be ("": no inf/nan)
    grad_norms: tuple[float, ...] = ()  # L2 norm per parameter (nan: no gradient)
    grad_fingerprints: tuple[int, ...] = ()  # 0: no gradient
    param_fingerprints: tuple[int, ...] = ()
    nonfinite: tuple[int, ...] = ()  # non-finite gradient elements per parameter
    missing_grads: tuple[int, ...] = ()  # indices of parameters with no gradient
    # indices of the parameters this rank's own backward did not reach (before DDP's
    # all-reduce fills them in); None: not watched
    unreached: tuple[int, ...] | None = None
    grad_norm: float | None = None  # L2 norm over every gradient (None: not recorded)
    grad_fingerprint: int = 0  # of all gradients together
    param_fingerprint: int = 0  # of all parameters together
    num_nonfinite: int = 0  # non-finite gradient elements in all
    buffer_fingerprints: tuple[int, ...] = ()  # per buffer, after the step (JobInfo.buffers)
    buffer_fingerprint: int = 0  # of all buffers together
    micro_batches: int = 1  # gradient accumulation: forward/backward passes in this step
    # of those, how many synchronised gradients under DDP (None: not known, or no DDP)
    synced_micro_batches: int | None = None
    # a script job: fingerprints of the tensors its model's outermost forward calls got,
    # in order (data checks compare ranks by them when no sample indices were recorded)
    input_fingerprints: tuple[int, ...] = ()
    comm_calls: int | None = None  # DDP gradient all-reduces in this step (when counted)
    comm_bytes: int | None = None
    # ((generator, fingerprint), ...) of every RNG as the step began (dtlab.agent.rng)
    rng: tuple[tuple[str, int], ...] = ()
    # while outputs are recorded: ((module, fingerprint of its output), ...) in the order
    # modules finished their forward (every micro-batch)
    module_outputs: tuple[tuple[str, int], ...] = ()
    # root-mean-square of the change this rank's optimizer step made to the parameter
    # elements it holds (its shard), over a fixed sample of them (dtlab.agent.update_size);
    # nan: not measured
    update_rms: float = math.nan

    @property
    def detailed(self) -> bool:
        """Does this record hold the per-parameter tuples?"""
        return bool(self.grad_fingerprints or self.param_fingerprints)

    def summary(self) -> StepRecord:
        """This record without the per-parameter tuples (what travels every step)."""
        return replace(
            self,
            grad_norms=(),
            grad_fingerprints=(),
            param_fingerprints=(),
            nonfinite=(),
            buffer_fingerprints=(),
            module_outputs=(),
        )


def combine_fingerprints(fingerprints: tuple[int, ...]) -> int:
    """One 64-bit fingerprint for many (ints hash alike in every process, unlike str)."""
    return hash(fingerprints) & ((1 << 64) - 1) if fingerprints else 0


@dataclass(frozen=True)
class Condition:
    """When ``%dt_run --until`` stops; checked on every rank after every step.

    ``kind`` is one of "step" (step >= value), "loss_above", "loss_below", "nonfinite"
    (loss or any gradient not finite), "diverged" (ranks' fingerprints differ).
    """

    kind: str
    value: float | None = None


@dataclass(frozen=True)
class RunResult:
    """How a ``%dt_step`` / ``%dt_run`` ended (made in control/ from the ranks' replies)."""

    first_step: int  # the step the run started after
    last_step: int  # every rank stopped after this step (unless a failure set them apart)
    stopped: str  # "steps" (all done), "until" (condition met), "pause", "timeout"
    seconds: float
    condition: Condition | None = None
    hit_ranks: tuple[int, ...] = ()  # ranks where the condition held at the last step

    @property
    def num_steps(self) -> int:
        return self.last_step - self.first_step


# field names, once (the classes have slots, so no __dict__ to copy; slots take each
# record in the notebook from ~2.7 KB to ~1.6 KB)
_RECORD_FIELDS = tuple(f.name for f in dataclass_fields(StepRecord))
_TIMES_FIELDS = tuple(f.name for f in dataclass_fields(StepTimes))
_MEMORY_FIELDS = tuple(f.name for f in dataclass_fields(StepMemory))


def step_record_to_dict(rank: int, record: StepRecord) -> dict:
    """``{"rank": r, **record}`` as plain data: one JSON line on the stepping channel.

    Built by hand: ``dataclasses.asdict`` deep-copies every tuple, ~10x slower, and this
    runs for every rank at every step.
    """
    data = {"rank": rank, **{name: getattr(record, name) for name in _RECORD_FIELDS}}
    data["times"] = {name: getattr(record.times, name) for name in _TIMES_FIELDS}
    data["memory"] = {name: getattr(record.memory, name) for name in _MEMORY_FIELDS}
    return data


def step_record_from_dict(data: dict) -> tuple[int, StepRecord]:
    """The inverse of :func:`step_record_to_dict` (lists from JSON become tuples)."""
    fields = dict(data)
    rank = fields.pop("rank")
    fields["times"] = StepTimes(**fields["times"])
    fields["memory"] = StepMemory(**fields["memory"])
    for name, value in fields.items():
        if isinstance(value, list):
            fields[name] = tuple(value)
    for pairs in ("rng", "module_outputs"):
        fields[pairs] = tuple((str(name), int(value)) for name, value in fields.get(pairs, ()))
    fields["update_rms"] = same_nan(fields.get("update_rms", math.nan))
    return rank, StepRecord(**fields)


def same_nan(value: float) -> float:
    """``value``, with any nan as ``math.nan`` itself: a record read back then equals the
    record it was made from (a tuple compares its items by identity first, and a nan equals
    only itself, not another nan)."""
    return math.nan if math.isnan(value) else value


def aligned_steps(
    records: Mapping[int, Sequence[StepRecord]],
) -> list[tuple[int, dict[int, StepRecord]]]:
    """``[(step, {rank: record})]`` for the steps every rank recorded, in step order."""
    if not records:
        return []
    by_rank = {rank: {rec.step: rec for rec in recs} for rank, recs in sorted(records.items())}
    common = set.intersection(*(set(steps) for steps in by_rank.values()))
    return [(step, {r: steps[step] for r, steps in by_rank.items()}) for step in sorted(common)]

"""Classic distributed-training faults, made on purpose on the attached job (rank side).

Call them on the rank(s) that should misbehave, from a ``%%dt --ranks R`` cell::

    %%dt --ranks 2
    dtlab.inject.perturb_param("blocks.0.attn.qkv.weight")

Each changes this rank's job in place, so ``%dt_doctor`` can be seen finding it. The data
faults (``share_shard``, ``skip_set_epoch``) act on the demo job's sampler.
"""

from __future__ import annotations

import os
import time

import torch

from dtlab.agent.job import current
from dtlab.agent.state import RANK


def perturb_param(name: str, amount: float = 1e-3) -> None:
    """Add ``amount`` to one parameter here only (an edit outside the optimizer)."""
    with torch.no_grad():
        _named(dict(current().module.named_parameters()), name, "parameter").add_(amount)


def reinit_weights(seed: int) -> None:
    """Re-initialise the weights from ``seed`` (per-rank seeding, a skipped broadcast);
    call before the first step."""
    torch.manual_seed(seed)
    for module in current().module.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def scale_lr(factor: float) -> None:
    """A different learning rate here, from the next step on."""
    job = current()
    if job.scheduler is not None and hasattr(job.scheduler, "base_lrs"):
        job.scheduler.base_lrs = [lr * factor for lr in job.scheduler.base_lrs]
    for group in job.optimizer.param_groups:
        group["lr"] *= factor


def nan_at(
    module: str, step: int, *, until: int | None = None, value: float = float("nan")
) -> None:
    """Make ``module``'s forward output NaN (or ``value``, e.g. inf) at ``step`` (counted
    from 1), or at every step from ``step`` to ``until``."""
    job = current()
    target = _named(dict(job.module.named_modules()), module, "module")
    last = step if until is None else until

    def poison(mod, inputs, output):
        if step <= job.step_count + 1 <= last:
            return output * value
        return output

    target.register_forward_hook(poison)


def unsync_buffers() -> None:
    """Stop DDP from broadcasting rank 0's buffers before each forward (BatchNorm
    statistics then follow each rank's own data); call it on every rank."""
    model = current().model
    if not hasattr(model, "broadcast_buffers"):
        raise RuntimeError("the attached model is not DistributedDataParallel: no broadcast")
    model.broadcast_buffers = False


def _own_loop(fault: str):
    """The attached job, if dtlab runs its loop (a loss_fn and data to wrap); else a clear
    error: a script's or a step function's loop is its own, so the fault goes there."""
    from dtlab.agent.job import Job

    job = current()
    if not isinstance(job, Job):
        raise RuntimeError(
            f"dtlab.inject.{fault} plants its fault in dtlab's own training loop (a job "
            "attached with dtlab.attach(model, optimizer, data, loss_fn), or %dt_demo); "
            f"the attached {type(job).__name__} runs a loop of its own: plant it there"
        )
    return job


def _wrap_loss(before, fault: str) -> None:
    job = _own_loop(fault)
    inner = job.loss_fn

    def wrapped(model, batch):
        before()
        return inner(model, batch)

    job.loss_fn = wrapped


def leak(mib_per_step: float) -> None:
    """Keep ``mib_per_step`` MiB of tensors alive every step (a growing list)."""
    kept = []
    numel = int(mib_per_step * 2**20 / 4)
    _wrap_loss(lambda: kept.append(torch.ones(numel)), "leak")


def hold(mib: float) -> None:
    """Keep ``mib`` MiB alive here while this job is attached (memory only this rank holds;
    attaching a job again lets it go)."""
    job = current()
    job.injected_memory = [*getattr(job, "injected_memory", []), torch.ones(int(mib * 2**20 / 4))]


def slow(seconds: float) -> None:
    """Spend ``seconds`` more in every forward here (a straggler)."""
    _wrap_loss(lambda: time.sleep(seconds), "slow")


def slow_data(seconds: float) -> None:
    """Make every batch take ``seconds`` longer to arrive here (a slow input pipeline)."""
    job = _own_loop("slow_data")
    inner = job._next_batch

    def slower():
        time.sleep(seconds)
        return inner()

    job._next_batch = slower


def fail_observation(name: str | None, step: int = 1) -> None:
    """Make dtlab's own observation ``name`` of a script (a key of
    ``dtlab.agent.step_observer.OBSERVATIONS``: "forward", "backward", "optimizer", "data
    loader", "scaler", "gradients", ...) raise from ``step`` on, here, to see dtlab switch
    it off and the script go on; call before ``%dt_script``. None: no observation fails."""
    from dtlab.agent.step_observer import OBSERVATIONS

    if name is None:
        RANK.fault_observations.clear()
        return
    if name not in OBSERVATIONS:
        raise ValueError(f"no observation {name!r}: one of {', '.join(OBSERVATIONS)}")
    RANK.fault_observations[name] = int(step)


def set_env(name: str, value: str) -> None:
    """Set an environment variable here only (a mismatched setting)."""
    os.environ[name] = value


def share_shard(rank: int) -> None:
    """Read rank ``rank``'s shard instead of this rank's own (overlapping samples), from
    the next pass over the data, or at once before the first step."""
    _demo_sampler().rank = rank


def skip_set_epoch() -> None:
    """Stop telling the sampler the epoch: every epoch comes in the same order."""
    _own_loop("skip_set_epoch").stream.on_epoch = None


def corrupt_once(module: str, step: int, *, amount: float = 1e-2) -> None:
    """Add ``amount`` to ``module``'s forward output at ``step`` only, once (a transient
    fault such as silent data corruption: a replay of that step does not meet it)."""
    job = current()
    target = _named(dict(job.module.named_modules()), module, "module")
    fired = []

    def corrupt(mod, inputs, output):
        if job.step_count + 1 == step and not fired:
            fired.append(step)
            return output + amount
        return output

    target.register_forward_hook(corrupt)


def jitter(module: str, *, amount: float = 1e-4) -> None:
    """Add noise from an unseeded generator to ``module``'s output in every forward (a
    non-deterministic kernel): no checkpoint can make two runs of a step agree."""
    target = _named(dict(current().module.named_modules()), module, "module")

    def noisy(mod, inputs, output):
        g = torch.Generator().manual_seed(time.perf_counter_ns())
        return output + amount * torch.randn(output.shape, generator=g)

    target.register_forward_hook(noisy)


def kill_at(step: int, sig: int = 9) -> None:
    """Kill this rank with ``sig`` (SIGKILL: as the OOM killer does) in the forward of
    ``step``, mid-step."""
    job = current()
    _wrap_loss(lambda: job.step_count + 1 == step and os.kill(os.getpid(), sig), "kill_at")


def raise_at(step: int, message: str = "injected failure") -> None:
    """Raise RuntimeError(message) in the forward of ``step`` here."""
    job = current()

    def fail():
        if job.step_count + 1 == step:
            raise RuntimeError(f"{message} (dtlab.inject.raise_at step {step})")

    _wrap_loss(fail, "raise_at")


def hang_at(step: int, how: str = "sleep") -> None:
    """Hang this rank at ``step``: ``"sleep"`` forever in its forward, or ``"skip_sync"``:
    leave out that step's DDP gradient all-reduce, which the other ranks then wait in."""
    if how not in ("sleep", "skip_sync"):
        raise ValueError(f"how must be 'sleep' or 'skip_sync', got {how!r}")
    job = _own_loop("hang_at")
    if how == "sleep":
        _wrap_loss(lambda: job.step_count + 1 == step and time.sleep(10**9), "hang_at")
        return
    if not hasattr(job.model, "no_sync"):
        raise RuntimeError("the attached model is not DistributedDataParallel: nothing to skip")
    inner = job.loss_fn

    def unsynced(model, batch):
        if job.step_count + 1 != step:
            return inner(model, batch)
        with model.no_sync():  # the backward runs inside: no all-reduce this step
            loss = inner(model, batch)
            loss.backward(retain_graph=True)
            model.zero_grad(set_to_none=False)
        return loss.detach().requires_grad_()

    job.loss_fn = unsynced


def checkpoint_without(*parts: str) -> None:
    """Leave ``parts`` out of this rank's checkpoints, as a hand-written save might forget
    them: any of "model", "optimizer", "scheduler", "scaler", "data", "python", "numpy",
    "torch", "cuda" (the last four are RNGs). No parts: save everything again."""
    from dtlab.agent import checkpoint

    unknown = set(parts) - set(checkpoint.PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; parts are {list(checkpoint.PARTS)}")
    RANK.fault_omitted_parts = set(parts)


def stall_save(seconds: float) -> None:
    """Wait ``seconds`` after writing this rank's files and before the checkpoint is
    committed (time to kill the rank mid-save); 0 stops it."""
    RANK.fault_before_commit = (lambda: time.sleep(seconds)) if seconds else None


def kill_in_save(when: str = "after_commit") -> None:
    """SIGKILL this rank inside its next checkpoint save: "before_commit" (its files
    written, before the ranks compare reports) or "after_commit" (the checkpoint's folder
    finished by rank 0, before the ranks' last agreement)."""
    import signal

    if when not in ("before_commit", "after_commit"):
        raise ValueError(f"when={when!r}: before_commit or after_commit")
    setattr(RANK, f"fault_{when}", lambda: os.kill(os.getpid(), signal.SIGKILL))


def limit_file_size(num_bytes: int | None) -> None:
    """Make every write past ``num_bytes`` in a file fail here with "File too large"
    (RLIMIT_FSIZE), as a disk that fills mid-save does; None lifts the limit."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = resource.RLIM_INFINITY if num_bytes is None else num_bytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


def fail_repartition() -> None:
    """The next live re-partition fails here while building the new stage (after the
    blocks arrived, before any rank commits)."""
    RANK.fault_repartition_build = True


def die_in_repartition() -> None:
    """This rank is killed (SIGKILL) in the next live re-partition, mid-exchange."""
    RANK.fault_repartition_die = True


def _named(found: dict, name: str, what: str):
    if name not in found:
        close = [n for n in found if name.split(".")[-1] in n][:5]
        raise KeyError(
            f"no {what} {name!r} in the attached model; some that exist: {close or list(found)[:5]}"
        )
    return found[name]


def _demo_sampler():
    if RANK.demo is None:
        raise RuntimeError("this fault acts on the demo job's sampler: run %dt_demo first")
    return RANK.demo.sampler

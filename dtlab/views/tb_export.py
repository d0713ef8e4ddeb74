"""The trace as TensorBoard event files, one run per rank (``dt.export_tensorboard()``), so
that existing TensorBoard dashboards see dtlab runs side by side:

    tensorboard --logdir runs/<timestamp>/tensorboard

Scalars per step: ``loss``, ``grad_norm``, ``lr``, ``loss_scale``, ``time/step_ms`` and
each phase (``time/data_ms`` ...), ``memory/rss_mib`` (or CUDA allocated). Written with
``torch.utils.tensorboard``, which needs the ``tensorboard`` package.
"""

from __future__ import annotations

from pathlib import Path

PHASES = ("data", "forward", "backward", "optimizer", "record")


def _scalars(rec) -> dict[str, float]:
    values = {
        "loss": rec.loss,
        "grad_norm": rec.grad_norm,
        "lr": rec.lr,
        "loss_scale": rec.scale,
        "time/step_ms": rec.times.total * 1e3,
    }
    for phase in PHASES:
        values[f"time/{phase}_ms"] = getattr(rec.times, phase) * 1e3
    cuda = rec.memory.cuda_allocated
    values["memory/mib"] = (cuda if cuda is not None else rec.memory.rss) / 2**20
    return {k: float(v) for k, v in values.items() if v is not None}


def export_tensorboard(trace, folder: str | Path) -> Path:
    """Write ``folder/rank<R>/events...`` for every rank of ``trace``; returns ``folder``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "TensorBoard export needs the tensorboard package: pip install tensorboard"
        ) from None
    folder = Path(folder)
    for rank, records in trace.records.items():
        writer = SummaryWriter(log_dir=str(folder / f"rank{rank}"))
        try:
            for rec in records:
                for tag, value in _scalars(rec).items():
                    writer.add_scalar(tag, value, rec.step, walltime=rec.time)
        finally:
            writer.close()
    return folder

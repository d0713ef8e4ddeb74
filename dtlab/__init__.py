"""dtlab: debug distributed PyTorch training interactively, from a notebook.

    %load_ext dtlab
    %dt_launch 8          # 8 torch.distributed ranks in ipyparallel engines, bound to `dt`

or, in Python::

    import dtlab
    with dtlab.launch(4) as dt:
        print(dt.run(lambda: 1 + 1))   # {0: 2, 1: 2, 2: 2, 3: 2}
        dtlab.demo.attach(dt)          # or dtlab.attach(model, opt, data, loss_fn) on ranks
        dt.step(10)                    # RunResult; the records are in dt.trace
        print(dt.doctor())             # findings, most severe first ([] when healthy)

On the ranks: ``dtlab.attach`` hands over a training job, ``dtlab.inject`` makes faults
on purpose. ``dtlab.Trace.load(folder)`` reads a run folder back.

Layers (docs/design.md): ``control`` (notebook side, the only user of
ipyparallel), ``agent`` (rank side, torch only), ``analysis`` (pure), ``views`` (IPython,
widgets). This module imports none of them until asked, so ``import dtlab`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dtlab.views.notebook import NotebookSession as Session


def launch(
    num_ranks: int,
    *,
    backend: str = "auto",
    launcher: str = "local",
    timeout: float = 120.0,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    port: int = 0,
    pg_timeout: float = 600.0,
    restart: bool = False,
    profile: str = "",
    launcher_config: Mapping[str, Mapping[str, object]] | None = None,
    hosts: str | Mapping[str, int] | None = None,
    listen: str = "",
    partition: str | None = None,
    sbatch_args: tuple[str, ...] = (),
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> Session:
    """Start ``num_ranks`` ranks (or reuse the live session) and return the Session.

    Same options as ``%dt_launch``; ``launcher_config`` passes traitlets settings to
    ipyparallel's launchers, e.g. ``{"SlurmEngineSetLauncher": {"queue": "gpu"}}``.
    ``hosts`` (ssh launcher): ``"node1:4,node2:4"`` or ``{"node1": 4, ...}``; ``listen``:
    the interface or address the notebook side listens on for ranks on other hosts;
    ``partition`` and ``sbatch_args`` (slurm launcher): ``#SBATCH`` lines of the engines' job.
    More local ranks than cores is warned about; more than 16 per core is refused unless
    ``force=True``.
    """
    import warnings

    from dtlab.control import lifecycle
    from dtlab.control.config import LaunchConfig, oversubscription
    from dtlab.control.launchers import parse_hosts, slurm_config, ssh_config
    from dtlab.views.notebook import NotebookSession
    from dtlab.views.progress import auto_progress

    launcher_config = dict(launcher_config or {})
    if hosts:
        engines = parse_hosts(hosts) if isinstance(hosts, str) else dict(hosts)
        launcher_config = {**ssh_config(engines), **launcher_config}
    if partition or sbatch_args:
        launcher_config = {**slurm_config(partition, tuple(sbatch_args)), **launcher_config}
    config = LaunchConfig(
        num_ranks=num_ranks,
        backend=backend,
        launcher=launcher,
        timeout_s=timeout,
        threads=threads,
        env=dict(env or {}),
        port=port,
        pg_timeout_s=pg_timeout,
        profile=profile,
        launcher_config=launcher_config,
        listen=listen,
        force=force,
    )
    if note := oversubscription(config):
        warnings.warn(f"{note}; the doctor says when timings are too noisy to judge", stacklevel=2)
    return lifecycle.launch(
        config, progress or auto_progress(), restart=restart, session_class=NotebookSession
    )


def session() -> Session:
    """The live session (what ``%dt_launch`` bound to ``dt``)."""
    from dtlab.control import lifecycle

    return lifecycle.current()


def attach(model, optimizer, data, loss_fn=None, **options):
    """Rank side: hand this rank's training job to dtlab (call it on every rank, e.g. in a
    ``%%dt`` cell): ``loss_fn(model, batch)``, or ``step=fn(batch)`` for a whole step of
    your own. See :func:`dtlab.agent.attach.attach` for the options."""
    from dtlab.agent.attach import attach as attach_on_rank

    return attach_on_rank(model, optimizer, data, loss_fn, **options)


def step_boundary() -> None:
    """In a script run by ``%dt_script``: a step boundary here (for loops with several
    optimizers, where the first one's steps would be the boundaries otherwise). Does
    nothing outside dtlab, so the script still runs under plain torchrun."""
    import sys

    script = sys.modules.get("dtlab.agent.script")  # imported only when a script runs
    if script is not None:
        script.step_boundary()


def __getattr__(name: str):
    if name == "Trace":  # lazily, so `import dtlab` stays cheap
        from dtlab.records.trace import Trace

        return Trace
    if name == "demo":  # the built-in demo job, attached from the notebook
        import dtlab.demo as demo

        return demo
    if name == "inject":  # rank side: faults made on purpose (dtlab.agent.inject)
        from dtlab.agent import inject

        return inject
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    from dtlab.views.magics import register

    register(ipython)

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
widgets). This module imports none of them until asked, so ``import dtlab`` stays cheap
(``dtlab.launch`` itself lives in views/notebook.py and is imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dtlab.views.notebook import NotebookSession as Session
    from dtlab.views.notebook import launch as launch


def session() -> Session:
    """The live session (what ``%dt_launch`` bound to ``dt``)."""
    from dtlab.control import lifecycle

    return lifecycle.current()


def attach(model, optimizer=None, data=None, loss_fn=None, **options):
    """Rank side: hand this rank's training job to dtlab (call it on every rank, e.g. in a
    ``%%dt`` cell): ``loss_fn(model, batch)``, or ``step=fn(batch)`` for a whole step of
    your own; a DeepSpeedEngine in place of the model, without an optimizer. See
    :func:`dtlab.agent.attach.attach` for the options."""
    from dtlab.agent.attach import attach as attach_on_rank

    return attach_on_rank(model, optimizer, data, loss_fn, **options)


def connect(run_dir, **options):
    """Connect this notebook to a running job started by ``torchrun ... -m dtlab.run``,
    from its job folder: pause it at a step, look inside, let it go on
    (:mod:`dtlab.control.connect`; read-only once the job has ended)."""
    from dtlab.views.notebook import connect as connect_to

    return connect_to(run_dir, **options)


def step_boundary() -> None:
    """In a script run by ``%dt_script``: a step boundary here (for loops with several
    optimizers, where the first one's steps would be the boundaries otherwise). Does
    nothing outside dtlab, so the script still runs under plain torchrun."""
    import sys

    script = sys.modules.get("dtlab.agent.script")  # imported only when a script runs
    if script is not None:
        script.step_boundary()


def __getattr__(name: str):
    if name == "launch":  # lazily: its keywords and docstring come from LaunchOptions' fields
        from dtlab.views.notebook import launch

        return launch
    if name == "Trace":  # lazily, so `import dtlab` stays cheap
        from dtlab.records.trace import Trace

        return Trace
    if name == "demo":  # the built-in demo job, attached from the notebook
        from dtlab.control import demo

        return demo
    if name == "inject":  # rank side: faults made on purpose (dtlab.agent.inject)
        from dtlab.agent import inject

        return inject
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "launch", "Trace", "demo", "inject"])


def load_ipython_extension(ipython) -> None:
    from dtlab.views.magics import register

    register(ipython)

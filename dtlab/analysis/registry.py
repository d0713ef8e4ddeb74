"""The doctor's checks, each registered where it is written.

A check is a pure function ``Evidence -> CheckResult`` in an ``analysis/checks_*.py``
module, registered with a decorator that says where it stands in the report and what it
compares::

    @check("memory", order=100)
    def check_memory(evidence: Evidence) -> CheckResult: ...

``compares`` tells the doctor when a check cannot look, so that it says "not checked"
with the reason instead of calling it: ``"ranks"`` needs two ranks or more; ``"replicas"``
compares data-parallel replicas (same parameters, different samples), which neither one
rank nor a pipeline (one stage per rank) has. ``observes`` names what a script job's
rank must have observed for the check to look (``dtlab.agent.step_observer.OBSERVATIONS``:
"backward" for losses, "gradients", "data loader"...): where one was switched off after
it failed, the doctor says "not checked". :func:`registered` imports every
``checks_*`` module of this package, so a new check is one new file here (plus, if it
needs a new measurement, one collector on the rank: docs/design.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from dtlab.records import CheckResult, Evidence

Check = Callable[[Evidence], CheckResult]
COMPARES = ("nothing", "ranks", "replicas")


@dataclass(frozen=True)
class RegisteredCheck:
    name: str  # as the report and doctor.json name it
    run: Check
    order: int  # where it stands in the report (smaller first)
    compares: str  # one of COMPARES
    # None: always; else the check is left out of the report when it returns False (a
    # check of something most jobs do not have, e.g. steps the trace's window left)
    applies: Callable[[Evidence], bool] | None = None
    observes: tuple[str, ...] = ()  # a script job's observations it reads


_REGISTRY: dict[str, RegisteredCheck] = {}


def check(
    name: str,
    *,
    order: int,
    compares: str = "nothing",
    applies: Callable[[Evidence], bool] | None = None,
    observes: tuple[str, ...] = (),
) -> Callable[[Check], Check]:
    """Register the decorated function as the doctor's check ``name`` (``applies``: when
    it is in the report at all)."""
    if compares not in COMPARES:
        raise ValueError(f"compares must be one of {', '.join(COMPARES)}, got {compares!r}")

    def register(fn: Check) -> Check:
        known = _REGISTRY.get(name)
        if known is not None and known.run.__qualname__ != fn.__qualname__:
            raise ValueError(f"two doctor checks are named {name!r}: {known.run} and {fn}")
        _REGISTRY[name] = RegisteredCheck(name, fn, order, compares, applies, tuple(observes))
        return fn

    return register


def registered() -> tuple[RegisteredCheck, ...]:
    """Every check of the ``checks_*`` modules, in report order."""
    package = __name__.rpartition(".")[0]
    path = importlib.import_module(package).__path__
    for info in pkgutil.iter_modules(path):
        if info.name.startswith("checks_"):
            importlib.import_module(f"{package}.{info.name}")
    return tuple(sorted(_REGISTRY.values(), key=lambda c: (c.order, c.name)))

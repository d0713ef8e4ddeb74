"""The layers of docs/design.md, kept by tests: which dtlab module may import which, no
import cycle, and rank-side or pure code that drags no notebook library (or ipyparallel)
into the processes that import it. Modules are found by walking the package, so a new
module is checked without editing this file. (What a live rank really imports is checked
in test_layers_live.py.)"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dtlab

NOTEBOOK_LIBS = ["IPython", "ipywidgets", "plotly", "ipyparallel", "zmq", "ipykernel"]
ROOT = Path(dtlab.__file__).parent


def modules() -> dict[str, Path]:
    found = {"dtlab": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="dtlab."):
        spec = info.module_finder.find_spec(info.name.rsplit(".", 1)[-1], None)
        found[info.name] = Path(spec.origin)
    return found


MODULES = modules()


# Modules at the package root that belong to a layer: the launch wrapper runs on the
# ranks under torchrun (agent side, no notebook library), the console script reads
# run folders and writes reports (a view).
ROOT_MODULES = {"dtlab.run": "agent", "dtlab.cli": "views", "dtlab.__main__": "views"}


def layer(name: str) -> str:
    if name in ROOT_MODULES:
        return ROOT_MODULES[name]
    parts = name.split(".")
    return (
        parts[1]
        if len(parts) > 2 or name.endswith(("agent", "analysis", "control", "views"))
        else name
    )


def imports_of(name: str, path: Path) -> set[str]:
    """dtlab modules ``name`` imports anywhere in its file (inside functions too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("dtlab") and target != name:
                found.add(target)
    return found


# The package root is left out of the graph: Python imports it before any module inside
# it, and its own imports (dtlab.launch, dtlab.attach, ...) are lazy entry points.
GRAPH = {
    name: {t for t in imports_of(name, path) if t != "dtlab"}
    for name, path in MODULES.items()
    if name != "dtlab"
}


def test_the_package_walk_finds_every_layer():
    layers = {layer(name) for name in GRAPH}
    assert {"agent", "analysis", "control", "views", "records"} <= layers
    assert "dtlab.agent.api" in GRAPH and "dtlab.views.notebook" in GRAPH


FORBIDDEN = {
    "records": {"agent", "analysis", "control", "views"},
    "analysis": {"agent", "control", "views"},
    "agent": {"control", "views"},
    "control": {"views"},
}


@pytest.mark.parametrize("source", sorted(FORBIDDEN))
def test_imports_go_one_way(source):
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if layer(name) == source
        for target in targets
        if layer(target) in FORBIDDEN[source]
    )
    assert wrong == []


# control/ in floors, each importing only the floors below it: the core reaches the ranks
# and knows no stepping or feature; stepping knows no feature; features know each other
# only through their constructors' typed parameters (imports, so a cycle shows) and never
# the session, which only builds them (docs/design.md, "Layers").
CONTROL_FLOORS = {
    "core": {
        "activity", "calls", "channel", "cluster", "config", "deepspeed_copies", "errors",
        "forkserver", "hangs", "launchers", "mirror", "network", "object_store", "options",
        "rankmap", "world",
    },
    "stepping": {"connection", "relays", "run_folder_writer", "runs", "stepper"},
    "features": {
        "checkpointing", "comm_bench", "partitions", "replays", "rescue", "scripts",
        "training",
    },
    "entry": {"connect", "connected_job", "demo", "lifecycle", "session"},
}  # fmt: skip
FLOOR_ORDER = list(CONTROL_FLOORS)


def floor(name: str) -> str | None:
    short = name.removeprefix("dtlab.control.")
    return next((f for f, names in CONTROL_FLOORS.items() if short in names), None)


def control_modules() -> list[str]:
    return sorted(n for n in GRAPH if n.startswith("dtlab.control.") and n != "dtlab.control")


def test_every_control_module_is_on_a_floor():
    assert [n for n in control_modules() if floor(n) is None] == []


def test_control_floors_import_only_the_floors_below():
    wrong = sorted(
        f"{name} ({floor(name)}) -> {target} ({floor(target)})"
        for name in control_modules()
        for target in GRAPH[name]
        if target.startswith("dtlab.control.")
        and FLOOR_ORDER.index(floor(target) or "entry") > FLOOR_ORDER.index(floor(name) or "")
    )
    assert wrong == []


def test_control_asks_the_rank_side_only_through_agent_api():
    wrong = sorted(
        f"{name} -> {target}"
        for name in control_modules()
        for target in GRAPH[name]
        if layer(target) == "agent" and target not in ("dtlab.agent", "dtlab.agent.api")
    )
    assert wrong == []


def _below_entry() -> list[tuple[str, ast.Module]]:
    return [
        (name, ast.parse(MODULES[name].read_text()))
        for name in control_modules()
        if floor(name) != "entry"
    ]


def test_control_below_the_session_never_reaches_through_one():
    """No ``self.session.x`` (an untyped service locator hides which part uses which)."""
    reaches = sorted(
        f"{name}:{node.lineno}"
        for name, tree in _below_entry()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "session"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )
    assert reaches == []


def test_control_collaborators_are_typed_in_constructors():
    """Each class's ``__init__`` says what it is given: its edges are visible to mypy."""
    untyped = sorted(
        f"{name}:{node.lineno} {arg.arg}"
        for name, tree in _below_entry()
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
        for arg in [*node.args.args[1:], *node.args.kwonlyargs]
        if arg.annotation is None
    )
    assert untyped == []


def test_records_start_no_thread():
    """records/ is plain data and pure codecs: a writer with a thread is notebook-side."""
    found = sorted(
        f"{name}:{node.lineno}"
        for name in GRAPH
        if layer(name) == "records"
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for target in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
        if target.split(".")[0] in ("threading", "concurrent", "multiprocessing", "asyncio")
    )
    assert found == []


def test_no_import_cycle_between_dtlab_modules():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


def modules_after(names) -> set[str]:
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({n!r})\n" for n in sorted(names))
    code += "print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return {m.split(".")[0] for m in out.stdout.split()}


@pytest.mark.parametrize("which", ["agent", "analysis", "records"])
def test_rank_side_and_pure_code_import_no_notebook_library(which):
    loaded = modules_after(name for name in GRAPH if layer(name) == which)
    assert not loaded & set(NOTEBOOK_LIBS), sorted(loaded & set(NOTEBOOK_LIBS))


def test_analysis_and_records_do_not_import_torch():
    pure = [name for name in GRAPH if layer(name) in ("analysis", "records")]
    assert "torch" not in modules_after(pure)


def test_import_dtlab_is_cheap():
    loaded = modules_after(["dtlab"])
    assert not loaded & {"torch", "ipyparallel", "IPython"}


def test_the_design_map_names_only_files_that_exist():
    """docs/design.md names modules as `control/world.py` or `dtlab/...`: each exists."""
    import re

    text = (ROOT.parent / "docs" / "design.md").read_text()
    named = set(re.findall(r"`((?:dtlab/)?(?:records|analysis|agent|control|views)/\w+\.py)", text))
    named |= set(re.findall(r"`((?:benchmarks|tests)/\w+\.py)", text))
    missing = sorted(n for n in named if not (ROOT / n).exists() and not (ROOT.parent / n).exists())
    assert len(named) > 40 and missing == []

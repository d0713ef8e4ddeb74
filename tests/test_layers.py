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


def layer(name: str) -> str:
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

"""The runbooks are kept without outputs: a notebook saved after a run (JupyterLab's
autosave does it) would commit one machine's outputs, pids and timings for everyone."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_runbooks():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_tracked_runbook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [
        index
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert dirty == [], (
        f"{path.name}: cells {dirty} hold outputs; clear them before committing "
        "(JupyterLab: Edit > Clear Outputs of All Cells, then save)"
    )

"""The layer boundaries of STYLE.md, kept by a test: rank-side and pure code must not drag
notebook libraries (or ipyparallel) into the processes that import them."""

import subprocess
import sys

import pytest

NOTEBOOK_LIBS = ["IPython", "ipywidgets", "plotly", "ipyparallel", "zmq", "ipykernel"]


def modules_after(import_line: str) -> set[str]:
    code = f"import sys\n{import_line}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return {m.split(".")[0] for m in out.stdout.split()}


@pytest.mark.parametrize(
    "line",
    [
        "import dtlab.analysis.ranks, dtlab.analysis.consistency, dtlab.analysis.grouping",
        "import dtlab.analysis.conditions, dtlab.analysis.divergence, dtlab.analysis.trends",
        "import dtlab.analysis.doctor, dtlab.analysis.evidence, dtlab.analysis.checks_data",
        "import dtlab.agent.identity, dtlab.agent.rendezvous",
        "import dtlab.agent.job, dtlab.agent.recorder, dtlab.agent.stepping, dtlab.agent.hooks",
        "import dtlab.agent.demo_job, dtlab.agent.demo_model, dtlab.agent.inject",
        "import dtlab.records, dtlab.trace, dtlab.checkpoint_format, dtlab.analysis.resume",
        "import dtlab.agent.checkpoint, dtlab.agent.restore, dtlab.agent.dcp_io, dtlab.agent.rng",
        "import dtlab.agent.sidecar, dtlab.agent.data_stream, dtlab.analysis.hangs",
        "import dtlab.agent.script, dtlab.agent.script_env, dtlab.agent.script_observe",
        "import dtlab.agent.threads",
    ],
)
def test_pure_and_rank_side_code_import_no_notebook_library(line):
    loaded = modules_after(line)
    assert not loaded & set(NOTEBOOK_LIBS), sorted(loaded & set(NOTEBOOK_LIBS))


def test_analysis_does_not_import_torch():
    loaded = modules_after(
        "import dtlab.analysis.consistency, dtlab.analysis.ranks, dtlab.analysis.conditions, "
        "dtlab.analysis.divergence, dtlab.analysis.trends, dtlab.analysis.doctor, dtlab.trace, "
        "dtlab.analysis.resume, dtlab.checkpoint_format, dtlab.analysis.hangs"
    )
    assert "torch" not in loaded


def test_import_dtlab_is_cheap():
    loaded = modules_after("import dtlab")
    assert not loaded & {"torch", "ipyparallel", "IPython"}

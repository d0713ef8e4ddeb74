"""``./dev demo`` shows what dtlab is for: its entry (``python -m dtlab.quickstart``, what
the script runs after setting up the venv) run as a newcomer runs it, in a process of its
own, on 8 ranks: the planted fault named by rank, step and cause, the report written, every
process gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from dtlab.quickstart import FAULT_PARAM

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
DEMO_TIMEOUT_S = 240  # about 10 s on 2 idle cores; bounds a failure on a busy machine


def _left_in(folder: Path) -> list[int]:
    """Processes still working in ``folder`` (the demo's ranks and controller run there)."""
    left = []
    for p in psutil.process_iter(["pid", "cwd"]):
        cwd = p.info["cwd"]
        if cwd and Path(cwd).is_relative_to(folder):
            left.append(p.info["pid"])
    return left


def test_the_demo_names_the_planted_fault_and_writes_the_report(tmp_path):
    runs = tmp_path / "runs"
    env = {**os.environ, "DTLAB_RUNS_DIR": str(runs)}
    done = subprocess.run(
        [sys.executable, "-m", "dtlab.quickstart"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    out = done.stdout
    assert done.returncode == 0, f"{out[-3000:]}\n{done.stderr[-3000:]}"
    assert "8 ranks ready" in out and "all_reduce of the rank ids = 28" in out
    assert f"planted: rank 5 edited {FAULT_PARAM} after step 3" in out
    # the doctor's verdict: the rank, the first step after the edit, the parameter, the cause
    named = re.search(
        r"as the doctor names it: rank (\S+), from step (\d+), parameter\s+(\S+)", out
    )
    assert named is not None, out
    assert named.groups() == ("5", "4", FAULT_PARAM), named.groups()
    assert "cause and fix: parameters were changed outside the optimizer step" in out, out
    assert "[error] parameters diverge from step 4: blocks.1.attn.qkv.weight" in out, out
    report = re.search(r"^report: (.+)$", out, re.MULTILINE)
    assert report is not None, out
    path = tmp_path / report.group(1)  # relative to where the demo ran, or absolute
    assert path.is_file() and path.is_relative_to(runs), path
    assert "blocks.1.attn.qkv.weight" in path.read_text()  # the finding is in the report
    assert "stopped 8 ranks" in out
    assert _left_in(tmp_path) == []

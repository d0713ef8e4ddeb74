"""Doctor check: the steps a long run's window left behind, read from their summaries.

A Trace keeps the last ``window`` steps of every rank in memory (records/trace.py); every
other check reads those. The steps before them left one summary row each
(records/summaries.py): whether the ranks' fingerprints agreed, how many had a non-finite
loss, the spread of step time and memory. Here those rows are read, so that a
problem that began before the window (weights that parted at step 37 of 100,000, a nan at
step 900) is named at the step it began, not at the first step still in memory. The check
is in the report only when the window has moved. Timing is left to the stragglers check on
the steps in memory: under DDP every rank's whole step waits for the slowest, so the
summaries' step times cannot tell who that is.
"""

from __future__ import annotations

import numpy as np

from dtlab.analysis.divergence import GRAD_FIX, PARAM_FIX
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding

TITLE = "Earlier steps (kept as one summary per step)"
NONFINITE_FIX = (
    "run again to just before that step with %dt_run --until nonfinite to find the first "
    "module that made it (the per-step record of a step this old is no longer kept)"
)
BUFFER_FIX = "broadcast buffers from rank 0 (DDP's broadcast_buffers=True) or sync them"
_FIXES = {"grad": GRAD_FIX, "param": PARAM_FIX, "buffer": BUFFER_FIX}
_WHAT = {"grad": "gradients", "param": "parameters", "buffer": "buffers"}


def _left(evidence: Evidence) -> bool:
    return evidence.history is not None and len(evidence.history) > 0


def _span(history: np.ndarray) -> str:
    return f"steps {int(history['step'][0]):,}-{int(history['step'][-1]):,}"


@check("earlier_steps", order=15, applies=_left)
def check_earlier_steps(evidence: Evidence) -> CheckResult:
    history = evidence.history
    looked = (
        f"one summary row per step for {_span(history)} (fingerprint agreement, non-finite "
        "losses); the steps after them are in memory, where the other checks read them"
    )
    findings: list[Finding] = []
    if not evidence.is_pipeline:  # stages hold different parameters: they differ by design
        for kind in ("grad", "param", "buffer"):
            differ = np.flatnonzero(history[f"{kind}_agree"] == 0)
            if len(differ):
                first = history[differ[0]]
                step, rank = int(first["step"]), int(first[f"{kind}_odd_rank"])
                findings.append(
                    Finding(
                        "divergence",
                        (rank,),
                        f"{_WHAT[kind]} first differed across ranks at step {step:,} (rank "
                        f"{rank} held a fingerprint fewest ranks held), and differed in "
                        f"{len(differ):,} of the {len(history):,} earlier steps",
                        step,
                        {"fingerprints": kind, "steps_differing": len(differ)},
                        _FIXES[kind],
                        "error",
                    )
                )
    bad = np.flatnonzero(history["nonfinite_loss_ranks"] > 0)
    if len(bad):
        first = history[bad[0]]
        step = int(first["step"])
        findings.append(
            Finding(
                "nonfinite",
                (),
                f"the loss was nan or inf on {int(first['nonfinite_loss_ranks'])} rank(s) at "
                f"step {step:,}, and in {len(bad):,} of the {len(history):,} earlier steps",
                step,
                {"steps_nonfinite": len(bad)},
                NONFINITE_FIX,
                "error",
            )
        )
    return CheckResult(
        "earlier_steps",
        TITLE,
        tuple(findings),
        looked,
        ""
        if findings
        else "every earlier step's fingerprints agreed on every rank that recorded them, "
        "and every loss was finite",
    )

"""``%dt_doctor``: a job that learns nothing. Every rank healthy by every other check, yet
the loss never moves: an LR of zero, gradients that are all zero (a loss that does not
depend on the parameters, such as cross-entropy over a single output class), parameters
that never change, a loss that is the same number at every step.

Pure: reads the step summaries (loss, LR, gradient norm, parameter fingerprint) of every
rank. A finding needs the symptom on every rank at every one of at least
``MIN_STEPS`` steps: one step of warm-up from an LR of 0, or one step whose gradients
happened to cancel, is not a job that learns nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from dtlab.analysis.evidence import shape_of
from dtlab.analysis.registry import check
from dtlab.records import CheckResult, Evidence, Finding
from dtlab.records.row import ROW

Rows = Mapping[int, np.ndarray]  # {rank: its rows (records.columns.ROW) in step order}
MIN_STEPS = 5
VANISHING_NORM = 1e-12  # a whole model's gradient norm this small updates nothing

ZERO_GRAD_FIX = (
    "the loss does not depend on the parameters: a loss over one output (cross-entropy of "
    "a single-logit classifier is always 0: use BCEWithLogitsLoss, or one output per "
    "class), a forward under torch.no_grad() or a .detach() before the loss, or labels "
    "taken from the model's own output"
)
LR_ZERO_FIX = (
    "the optimizer steps with lr=0: look at the LR given to the optimizer and at the "
    "scheduler (a warm-up that never rises, a LambdaLR that returns 0, an LR set by hand)"
)
FROZEN_FIX = (
    "the optimizer changes nothing: is it built over the model's parameters (not a copy's, "
    "nor the parameters of a model replaced after it was made), and is its LR above 0?"
)
CONSTANT_LOSS_FIX = (
    "the loss is the same number whatever the batch: look at how it is computed (a "
    "constant target, a reduction over an empty mask, a loss on a detached tensor)"
)


@check("learning", order=20, observes=("backward", "gradients", "parameters"))
def check_learning(evidence: Evidence) -> CheckResult:
    empty = np.zeros(0, dtype=ROW)
    records = {r: evidence.per_rank.get(r, empty) for r in evidence.records}
    records = {  # (copied only where a step was skipped)
        r: rows[~rows["skipped"]] if rows["skipped"].any() else rows for r, rows in records.items()
    }
    steps = min((len(rows) for rows in records.values()), default=0)
    looked = f"{shape_of(evidence.records)} of losses, LRs, gradient norms and parameter prints"
    if steps < MIN_STEPS:
        return CheckResult(
            "learning",
            "The job learns something",
            (),
            looked,
            f"not checked: needs {MIN_STEPS} steps that were not skipped on every rank, "
            f"has {steps}",
            checked=False,
            needs=f"run at least {MIN_STEPS} steps",
        )
    findings = _findings(records)
    why = (
        "on some rank at some step the LR was above 0, the gradients were not all zero, "
        "the parameters changed and the loss moved"
    )
    return CheckResult(
        "learning", "The job learns something", tuple(findings), looked, "" if findings else why
    )


def _findings(records: Rows) -> list[Finding]:
    ranks = tuple(sorted(records))
    first = min(int(rows["step"].min()) for rows in records.values())
    last = max(int(rows["step"].max()) for rows in records.values())
    span = f"steps {first}-{last}"
    found = []
    if _everywhere(records, lambda rows: rows["lr"] == 0.0):  # nan (no LR) is not 0
        found.append(
            Finding(
                "not_learning",
                ranks,
                f"the LR is 0 at every step ({span}) on every rank: no step changes the parameters",
                first,
                {"lr": 0.0},
                LR_ZERO_FIX,
                "error",
            )
        )
    zero = _everywhere(records, _zero_gradients)
    if zero:
        loss = _constant_loss(records)
        said = f"; the loss is {loss:.6g} throughout" if loss is not None else ""
        found.append(
            Finding(
                "not_learning",
                ranks,
                f"every gradient is zero (or vanishing, norm <= "
                f"{VANISHING_NORM:g}) at every step ({span}) on every rank{said}: the job "
                "learns nothing",
                first,
                {"loss": loss},
                ZERO_GRAD_FIX,
                "error",
            )
        )
    elif not found and _parameters_frozen(records):
        found.append(
            Finding(
                "not_learning",
                ranks,
                f"the parameters did not change in {span} on any rank, "
                "although the optimizer stepped",
                first,
                {},
                FROZEN_FIX,
                "error",
            )
        )
    elif not found:
        losses = _losses_frozen(records)
        if losses is not None:
            values = sorted(set(losses.values()))
            said = f"is {values[0]:.6g}" if len(values) == 1 else "stays the same number"
            found.append(
                Finding(
                    "not_learning",
                    ranks,
                    f"the loss {said} at every step ({span}) on every rank, whatever the batch",
                    first,
                    {"loss": losses},
                    CONSTANT_LOSS_FIX,
                    "warning",
                )
            )
    return found


def _everywhere(records: Rows, symptom) -> bool:
    """``symptom(rows)`` (one bool per row) holds at every step of every rank."""
    return all(len(rows) and bool(np.all(symptom(rows))) for rows in records.values())


def _zero_gradients(rows: np.ndarray) -> np.ndarray:
    """False where unknown (not recorded: nan)."""
    norm = rows["grad_norm"]
    return np.isfinite(norm) & (norm <= VANISHING_NORM)


def _parameters_frozen(records: Rows) -> bool:
    """The parameter fingerprint is recorded and the same at every step, on every rank."""
    for rows in records.values():
        prints = rows["param_fingerprint"]
        if not len(prints) or prints[0] == 0 or not np.all(prints == prints[0]):
            return False
    return True


def _constant_loss(records: Rows) -> float | None:
    """The loss, when it is one finite number at every step of every rank."""
    values = set((_losses_frozen(records) or {}).values())
    return values.pop() if len(values) == 1 else None


def _losses_frozen(records: Rows) -> dict[int, float] | None:
    """Each rank's loss, when every rank's is one finite number at every step."""
    each = {}
    for rank, rows in records.items():
        losses = rows["loss"]
        if not len(losses) or not np.isfinite(losses[0]) or not np.all(losses == losses[0]):
            return None
        each[rank] = float(losses[0])
    return each

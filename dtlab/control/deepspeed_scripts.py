"""``%dt_resume_check`` of a DeepSpeed script: through DeepSpeed's own checkpoint.

A DeepSpeed job is restarted from what ``engine.save_checkpoint`` wrote, so that is what
is checked (:mod:`dtlab.agent.deepspeed_checkpoint` on the ranks):

1. at the step ``k`` the script is paused at, every rank's engine saves
   ``global_step<k>`` under the run folder's ``deepspeed_resume/``;
2. the script goes on ``steps`` steps: the reference;
3. on fresh engines (or the same ones), the script runs again from its start; the engine
   ``deepspeed.initialize`` returns loads the checkpoint before the script's code goes on
   (as a script that resumes from its latest checkpoint does), and dtlab counts its steps
   from DeepSpeed's restored ``global_steps``;
4. the same steps, compared step by step (:func:`dtlab.analysis.resume.compare_runs`):
   "identical", or the first thing that differs, causes first (the data position, an RNG,
   the LR), which names what DeepSpeed's checkpoint did not bring back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dtlab.agent import api
from dtlab.control.errors import DtlabError, RankError

RESUME_FOLDER = "deepspeed_resume"


def is_deepspeed(session) -> bool:
    trace = session.trace
    return trace is not None and any(j.deepspeed is not None for j in trace.jobs.values())


def resume_check(scripts, steps: int, *, fresh: bool = True, progress=None):
    """``Scripts.resume_check`` for a script that steps a DeepSpeed engine: ``(the step
    it resumed at, the comparison, the checkpoint's folder)``."""
    from dtlab.analysis.resume import compare_runs, without_rng

    session = scripts.session
    k = session.recovery.current_step()
    folder = _folder(session)
    tag = f"global_step{k}"
    try:
        saved = session.run(api.deepspeed_save, str(folder), tag)
    except RankError as e:
        raise DtlabError(f"DeepSpeed could not save its checkpoint at step {k}: {e}") from None
    session.stepper.run(steps, None, record=True)
    reference = session.replays.full_records(k + 1, k + steps)
    last = scripts.last
    assert last is not None  # a script job is current: it ran
    if fresh:
        session.renew(progress)
    session.run(api.deepspeed_load_next, str(folder), tag)
    status = scripts.run(
        last.path, last.argv, scripts.cwd, record=scripts.record, on_output=scripts.on_output
    )
    resumed = {status.steps[r] for r in status.states}
    if resumed != {k}:
        raise DtlabError(
            f"the script resumed from {folder / tag} at step(s) {sorted(resumed)}, not {k}: "
            "does it call deepspeed.initialize once, before its training loop?"
        )
    session.stepper.run(steps, None, record=True)
    again = session.replays.full_records(k + 1, k + steps)
    span = range(k + 1, k + steps + 1)
    names = {"other_name": "the run resumed from DeepSpeed's checkpoint"}
    comparison = compare_runs(without_rng(reference), without_rng(again), steps=span, **names)
    if not comparison.identical:
        comparison = compare_runs(reference, again, steps=span, **names)
    return k, comparison, next(iter(saved.values()))["path"]


def _folder(session) -> Path:
    """Where the checks' DeepSpeed checkpoints go: the run folder, else a temporary one."""
    trace = session.trace
    base = trace.folder if trace is not None and trace.folder is not None else None
    if base is None:
        base = Path(tempfile.mkdtemp(prefix="dtlab-deepspeed-"))
    return Path(base).absolute() / RESUME_FOLDER

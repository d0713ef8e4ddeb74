"""DeepSpeed's own checkpoints of a script job (``%dt_resume_check`` on a DeepSpeed script).

What users restart from is ``engine.save_checkpoint`` / ``engine.load_checkpoint``, not a
dtlab checkpoint, so that is what is checked: :func:`save` asks the paused script's engine
to save (a collective: every rank, at the same step boundary); :func:`load_when_initialized`
makes the next script run on this rank load it into its new engine as soon as
``deepspeed.initialize`` returns that engine, before the script's own code goes on, as a
script that restarts from its latest checkpoint does. The script's own first
``engine.load_checkpoint`` (of its latest) then finds this one loaded and returns what it
returned. The job counts steps from DeepSpeed's restored ``global_steps``, as for any
script that loads a checkpoint. What the checkpoint holds is DeepSpeed's choice (module,
optimizer partitions, scheduler, step counters); what it does not (the script's data
position, its RNGs) shows when the two runs are compared.
"""

from __future__ import annotations

import os
import time

from dtlab.agent.state import RANK


def _engine():
    run = RANK.script_run
    engine = getattr(getattr(run, "job", None), "engine", None)
    if engine is None:
        raise RuntimeError(
            "no DeepSpeed engine on this rank: the script paused here does not step one"
        )
    return engine


def save(folder: str, tag: str) -> dict:
    """``engine.save_checkpoint(folder, tag)`` of the paused script's engine, on every rank
    together; what it wrote."""
    engine = _engine()
    t0 = time.perf_counter()
    engine.save_checkpoint(folder, tag=tag)
    path = os.path.join(folder, tag)
    return {
        "path": path,
        "step": int(engine.global_steps),
        "seconds": time.perf_counter() - t0,
        "files": sorted(os.listdir(path)) if os.path.isdir(path) else [],
    }


def load_when_initialized(folder: str, tag: str) -> None:
    """The next ``deepspeed.initialize`` on this rank (once) loads ``folder``/``tag`` into
    the engine it made before returning it. Raises there, naming the folder, when DeepSpeed
    finds nothing to load."""
    import deepspeed

    original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)

    def initialize(*args, **kwargs):
        deepspeed.initialize = original  # once
        out = original(*args, **kwargs)
        engine = out[0]
        loaded = engine.load_checkpoint(folder, tag=tag)
        if loaded[0] is None:
            raise FileNotFoundError(
                f"DeepSpeed found no checkpoint {tag!r} under {folder} to load on this rank"
            )

        def load_checkpoint(*args, **kwargs):  # the script's own resume: this one is loaded
            del engine.load_checkpoint
            return loaded

        engine.load_checkpoint = load_checkpoint
        return out

    initialize.__wrapped__ = original  # type: ignore[attr-defined]
    deepspeed.initialize = initialize

"""dtlab never breaks the script it watches: each of its observations, made to raise on
purpose on every rank (``dtlab.inject.fail_observation``), is switched off with one note
naming it and the step; the script still ends with torchrun's losses, bit for bit, and
the doctor says "not checked" for the checks that observation fed.
"""

from __future__ import annotations

import pytest

from tests.test_script_live import SCRIPTS, losses_in, recorded, torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

# observation -> the doctor's checks it feeds (None: no check reads it alone)
FED = {
    "forward": ("accumulation", "data_order", "stragglers"),
    "backward": ("numerics", "learning", "accumulation"),
    "data loader": ("data_order",),
    "gradients": ("gradient_sync", "numerics"),
    "parameters": ("buffers",),
    "memory": ("memory",),
    "update size": ("update_size",),
    "output": (),  # what it prints after that goes to the engine's own stdout instead
    "optimizer": (),
}
FAIL_AT = 3  # the step (from 1) from which the observation raises


def test_each_observation_that_raises_is_switched_off_and_the_script_goes_on(live4, tmp_path):
    dt = live4
    args = ["--steps", "6", "--batch-size", "8"]
    torchrun(dt, "ddp_sampler.py", [*args, "--out", str(tmp_path / "torchrun")])
    theirs = losses_in(tmp_path / "torchrun")
    for name, fed in FED.items():
        out = tmp_path / name.replace(" ", "_")
        dt.execute(f"dtlab.inject.fail_observation({name!r}, {FAIL_AT})")
        try:
            dt.run_script(str(SCRIPTS / "ddp_sampler.py"), [*args, "--out", str(out)])
            end = dt.continue_script()
        finally:
            dt.execute("dtlab.inject.fail_observation(None)")
        assert end.stopped == "ended", (name, end)
        assert losses_in(out) == theirs, name  # the script computed what torchrun did
        notes = [n for n in dt.scripts.refresh().notes if "observation failed" in n]
        assert len(notes) == 1, (name, notes)  # one warning, the same on every rank
        assert f"dtlab's {name} observation failed at step {FAIL_AT}" in notes[0], notes
        assert "planted fault" in notes[0] and "not checked" in notes[0]
        if name == "optimizer":  # no boundary from step 3 on: it ran on to its end
            assert {len(recs) for recs in dt.trace.records.values()} == {FAIL_AT - 1}
            continue
        assert {len(recs) for recs in dt.trace.records.values()} == {6}, name
        results = {r.check: r for r in dt.training.checks()}
        for check in fed:
            result = results[check]
            why = result.passed_because
            assert not result.checked, (name, check, why)
            assert f"dtlab's {name} observation was switched off on ranks 0-3" in why
        others = [r for r in results.values() if r.checked]
        assert others, name  # the rest of the doctor still looked
        if name == "backward":  # no loss from then on: recorded as unknown
            early = recorded(dt)[0][: FAIL_AT - 1]
            assert early == theirs[0][: FAIL_AT - 1]

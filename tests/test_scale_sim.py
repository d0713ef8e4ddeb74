"""benchmarks/scale_sim.py, small: its fake ranks (real zmq sockets, real relays, in helper
processes) stepped by dtlab's own Stepper through the benchmark's stand-in session, so a
change to what the Stepper asks of a session breaks here, not silently in the benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("per_host", [0, 4])
def test_the_scale_simulator_steps_every_rank_and_the_doctor_names_what_it_planted(
    per_host, monkeypatch
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import scale_sim

    m = scale_sim.measure(16, 12, per_host)
    assert m["named"] == {"divergence": True, "memory": True, "straggler": True}
    assert m["wall_ms"] > 0 and m["cpu_ms"] > 0 and m["ingest_us"] > 0

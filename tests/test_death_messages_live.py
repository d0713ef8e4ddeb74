"""What a dead rank's error says (issue 39, item 9), on live ranks: a rank that aborts
inside gloo is reported with what gloo printed on its way out, not only "killed by signal
6"; and the advice is what works in the session's state: a rank killed while a script is
paused says dt.restart(), and following it brings the job back."""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path

import pytest

import dtlab
from dtlab.control.cluster import running
from dtlab.control.errors import RankError
from dtlab.control.hangs import last_words
from tests.conftest import quiet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WAIT_S = 30.0

# rank 1 skips the first all_reduce: its next one (5 floats) meets rank 0's first (3)
SKIPPED_ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "if dist.get_rank() == 0:\n"
    "    dist.all_reduce(torch.ones(3))\n"
    "dist.all_reduce(torch.ones(5))\n"
)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.05)


def test_a_rank_gloo_aborts_is_reported_with_what_gloo_said(cluster_cleanup, monkeypatch):
    # engines as a notebook starts them: ipykernel captures their descriptor 2 (it does
    # not under pytest), the way the last words of an aborting engine were lost; a
    # session of its own (no job, no script: the advice is the plain restart)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stopped the live session ..."
        dt = dtlab.launch(2, progress=quiet, restart=True)
    try:
        where = dt.run(_stderr_target)
        for rank, (captured, target) in where.items():
            assert captured, f"rank {rank}: ipykernel did not capture descriptor 2"
            assert target.endswith(f"engine-{dt.infos[rank].pid}.log"), target
        t0 = time.monotonic()
        with pytest.raises(RankError) as died:
            dt.execute(SKIPPED_ALL_REDUCE, timeout=60)
        assert time.monotonic() - t0 < 30
        text = str(died.value)
        dead = died.value.dead_ranks
        assert dead, text
        assert "killed by signal 6 (SIGABRT)" in text, text
        assert "its engine's last words:" in text, text
        assert "terminate called after throwing" in text, text
        assert " vs " in text or " != " in text, text  # the sizes gloo compared
        assert "%dt_launch" not in text, text  # the session is fine: a restart does it
        assert "dt.restart(None)" in text, text
        old = dt.pids()
        dt.restart(None)  # the advice works
        assert running(old) == []
        assert set(dt.status().values()) == {"idle"}
        assert dt.run(lambda: 1) == {0: 1, 1: 1}
    finally:
        dt.shutdown()  # its engines capture descriptor 2: the next test launches afresh


def _stderr_target():
    import os
    import sys

    captured = getattr(sys.stderr, "_original_stdstream_copy", None) is not None
    return captured, os.readlink("/proc/self/fd/2")


def test_a_rank_killed_while_a_script_is_paused_says_restart_and_restart_works(live2):
    dt = live2
    dt.run_script(str(SCRIPTS / "ddp_sampler.py"), ["--steps", "10"])
    dt.step(2)
    victim = dt.infos[1].pid
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: dt.status()[1] == "dead", "rank 1 seen dead")
    with pytest.raises(RankError) as died:
        dt.step(1)
    text = str(died.value)
    assert "rank 1 died: killed by signal 9 (SIGKILL" in text, text
    assert "dt.restart()" in text and "runs the script again" in text, text
    assert "%dt_launch" not in text, text
    event = dt.restart()  # as it says
    assert (event["rerun"], event["step"]) == (True, 2), event
    assert running([victim]) == []
    assert dt.step(1).last_step == 3
    assert set(dt.status().values()) == {"idle"}


def test_the_last_words_are_the_decisive_lines_bounded():
    log = "\n".join(
        [
            "2026-01-01 00:00:00 [IPEngine.1] Loading connection file",
            "[W1205 12:00:00.1 socket.cpp:1] [c10d] a warning long before",
            "\x1b[31mRuntimeError\x1b[39m  Traceback (most recent call last)",
            "File /v/torch/distributed/c10d_logger.py:83, in wrapper",
            *["noise"] * 50,
            "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
            "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. "
            + "8 vs 4" * 100,
            "",
        ]
    )
    said = last_words(log)
    assert said[0] == "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
    assert said[1].startswith("what():  [enforce fail") and len(said[1]) <= 300
    assert len(said) == 2
    crash = "[E1205 1 ProcessGroupNCCL.cpp:9] NCCL error: unhandled\nFatal Python error: Aborted\n"
    assert last_words(crash + '  File "/x/train.py", line 3 in f\n') == crash.splitlines()
    assert (
        last_words("Loading connection file\n[W1205 10:00:00.1 socket.cpp:1] [c10d] slow\n") == []
    )

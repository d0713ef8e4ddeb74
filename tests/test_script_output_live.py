"""What a user's script prints and logs, on 4 live ranks under %dt_script, and what it
leaves behind: every line arrives however the script holds its streams (a logging
handler bound to sys.stdout at set-up, sys.stderr written directly, a tee that replaced
sys.stdout), once and in order, as torchrun's per-rank logs have them; its gc and root
logger are back when it ends; ``script_locals`` is the frame that made the step, a
Trainer method in a module next to the script (tests/scripts/out_steps_lib.py).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from dtlab.agent.threads import thread_env
from tests.conftest import rank_threads, run_torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT = str(SCRIPTS / "out_logging.py")
TORCHRUN_TIMEOUT_S = 180


def torchrun_logs(session, args: list[str], folder: Path, n: int = 4) -> dict[int, tuple]:
    """The script under plain torchrun, each rank's stdout and stderr kept apart in files
    (``--redirects 3``): ``{rank: (stdout lines, stderr lines)}``."""
    env = {**os.environ, **thread_env(rank_threads(session))}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--redirects", "3"]
    cmd = [*run, f"--log-dir={folder}", f"--nproc-per-node={n}", SCRIPT, *args]
    done = run_torchrun(cmd, TORCHRUN_TIMEOUT_S, log_dir=folder, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = {}
    for r in range(n):
        [out] = folder.glob(f"*/attempt_0/{r}/stdout.log")
        [err] = folder.glob(f"*/attempt_0/{r}/stderr.log")
        logs[r] = (ours(out.read_text()), ours(err.read_text()))
    return logs


def ours(text: str) -> list[str]:
    """The script's own lines (not a library's warning, say)."""
    return [line for line in text.splitlines() if line.startswith(("[out] ", "[err] "))]


def expected_kinds(rank: int, steps: int) -> list[str]:
    """The order the script writes in: its set-up line, then per step the stderr line
    (before the update) and the log line (after it), then the last log line."""
    lines = [f"[out] rank {rank} out_steps_lib: set-up"]
    for s in range(1, steps + 1):
        lines += [f"[err] rank {rank} step {s} ", f"[out] rank {rank} out_steps_lib: step {s} "]
    return [*lines, f"[out] rank {rank} out_steps_lib: Training completed"]


def assert_every_line_once_in_order(output: dict[int, str], steps: int) -> None:
    for r in range(4):
        lines = ours(output[r])
        want = expected_kinds(r, steps)
        assert len(lines) == len(want), (r, lines)
        assert all(line.startswith(w) for line, w in zip(lines, want, strict=True)), (r, lines)


def process_state(session) -> dict[int, tuple]:
    """What of each rank's process a script may change: gc and the root logger."""
    return session.run(
        lambda: (
            __import__("gc").isenabled(),
            __import__("gc").get_threshold(),
            [id(h) for h in __import__("logging").getLogger().handlers],
            __import__("logging").getLogger().level,
        )
    )


def test_a_trainers_log_arrives_whole_and_its_process_state_is_put_back(live4, tmp_path):
    dt = live4
    steps = 10
    theirs = torchrun_logs(dt, ["--steps", str(steps)], tmp_path / "torchrun")
    before = process_state(dt)
    live: list[str] = []  # rank 0's, as it comes
    status = dt.run_script(SCRIPT, ["--steps", str(steps)], on_output=live.append)
    assert status.paused and set(status.steps.values()) == {0}
    for r in range(4):  # its set-up line, and step 1's before the update (the pause)
        assert ours(dt.scripts.output[r]) == [theirs[r][0][0], theirs[r][1][0]]
    # the script's own state while it runs: gc off (a %%dt cell sees it so too)
    assert set(dt.run(gc.isenabled).values()) == {False}

    dt.step(3)
    # paused inside Trainer.train_step (out_steps_lib.py), just after its optimizer.step()
    seen = dt.execute(
        "type(script_locals['self']).__name__, script_locals['self'].step, "
        "sorted(k for k in ('batch', 'loss', 'inputs', 'args') if k in script_locals)"
    )
    assert {o.result for o in seen.values()} == {"('Trainer', 3, ['batch', 'inputs', 'loss'])"}
    for r in range(4):  # steps 1 and 2 whole, step 3's line before its update
        assert len(ours(dt.scripts.output[r])) == 1 + 2 * 2 + 1
    # while paused, a cell that logs through the script's handler sees it in its own output
    cell = dt.execute("import logging; logging.getLogger('out_steps_lib').info('from a cell')")
    assert {o.stdout for o in cell.values()} == {
        f"[out] rank {r} out_steps_lib: from a cell\n" for r in range(4)
    }

    end = dt.continue_script()
    assert end.stopped == "ended" and end.last_step == steps
    assert_every_line_once_in_order(dt.scripts.output, steps)
    for r in range(4):  # what torchrun's rank wrote to each stream, line for line
        mine = ours(dt.scripts.output[r])
        assert [x for x in mine if x.startswith("[out]")] == theirs[r][0]
        assert [x for x in mine if x.startswith("[err]")] == theirs[r][1]
        assert "from a cell" not in dt.scripts.output[r]  # the cell's, not the script's
    assert "".join(live) == dt.scripts.output[0]  # rank 0's went out live, all of it
    # its end put back what it changed for the whole process: gc, the root logger
    assert process_state(dt) == before
    assert {s[0] for s in before.values()} == {True}


def test_a_tee_that_replaced_stdout_and_a_script_stopped_early(live4, tmp_path):
    dt = live4
    before = process_state(dt)
    dt.run_script(SCRIPT, ["--steps", "8", "--tee", str(tmp_path)])
    dt.step(4)
    dt.scripts.stop()  # ended by dtlab where it was paused: after step 4's update
    for r in range(4):
        lines = ours(dt.scripts.output[r])
        logged = [x for x in lines if x.startswith("[out]")]
        assert logged == ours((tmp_path / f"rank{r}.log").read_text())  # through the tee
        want = expected_kinds(r, 8)[: 1 + 2 * 3 + 1]  # set-up, 3 steps, step 4's stderr line
        assert len(lines) == len(want), (r, lines)
        assert all(x.startswith(w) for x, w in zip(lines, want, strict=True)), lines
    assert process_state(dt) == before
    # and the next script starts with the engine's streams and state
    dt.run_script(SCRIPT, ["--steps", "2"])
    assert dt.continue_script().stopped == "ended"
    assert_every_line_once_in_order(dt.scripts.output, 2)
    assert process_state(dt) == before

"""Ctrl-C pressed twice while %dt_launch starts its engines: the second press must not cut
the cleanup of the first short. A child process launches ranks and presses Ctrl-C on
itself as the first engine registers, and again 0.05-1 s later; then every process it
started must be gone (counted by pid from the child's own descendants)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import psutil
    import dtlab

    pressed = []

    def press_again():
        time.sleep(DELAY)
        os.kill(os.getpid(), signal.SIGINT)

    def progress(phase, done, total):
        if phase == "engines registered" and done >= 1 and not pressed:
            presser = threading.Thread(target=press_again, daemon=True)
            pressed.append(presser)
            presser.start()
            # the first press, from the main thread: it lands here, mid-launch, however
            # busy the machine (a thread's press could come after the launch ended)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)

    seen = set()
    def watch():  # every process this launch starts, by pid, while it runs
        me = psutil.Process()
        while True:
            seen.update(p.pid for p in me.children(recursive=True))
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    outcome = "launched"
    try:
        dtlab.launch(4, progress=progress, timeout=60)
    except KeyboardInterrupt:
        outcome = "interrupted"
    # a second press that comes only after the cleanup ended interrupts nothing of dtlab's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for presser in pressed:
        presser.join()
    time.sleep(0.5)  # a killed process is reaped by now
    alive = [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    print(json.dumps({"outcome": outcome, "started": len(seen), "alive": alive}))
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.3, 1.0])
def test_a_second_ctrl_c_during_launch_still_stops_everything_it_started(delay, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.replace("DELAY", str(delay)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    report = json.loads(lines[-1])
    try:
        assert report["outcome"] == "interrupted"
        assert report["started"] >= 4  # engines (and the controller) had started
        assert report["alive"] == [], f"left running: {report['alive']}"
    finally:  # never leave them behind, even when the test fails
        for pid in report["alive"]:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass

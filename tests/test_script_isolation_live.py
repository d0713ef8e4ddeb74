"""A script run by %dt_script on live ranks is in torchrun's world and leaves nothing of
itself behind: what it changed of the process (sys.path, torch's threads, environment
variables) is put back however it ends (finished, failed, stopped, its job replaced by
another attached job); it reads every variable torchrun sets, with torchrun's values
(checked against a real torchrun run of the same script); the magic's line is split as
a shell splits it (a path with spaces); two starts at once are refused, not run one
over the other.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import dtlab
from dtlab.agent import api
from dtlab.agent.threads import thread_env
from dtlab.control.errors import DtlabError, OptionError, RankError
from dtlab.views.script_magics import split_line
from tests.conftest import quiet, rank_threads, run_torchrun

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
TORCHRUN_TIMEOUT_S = 180
WAIT_S = 120

# what it changes of its process at set-up, then five optimizer steps
CHANGES_PROCESS = """
import os, sys, torch
sys.path.append("/dtlab-test/appended")
sys.path.insert(0, "/dtlab-test/first")
sys.path.remove(sys.path[-2])  # one of the engine's own entries
torch.set_num_threads(7)
os.environ["DTLAB_TEST_ADDED"] = "by the script"
os.environ["DTLAB_TEST_CHANGED"] = "by the script"
del os.environ["DTLAB_TEST_REMOVED"]
os.environ["OMP_NUM_THREADS"] = "7"
fail_at = int(sys.argv[1]) if len(sys.argv) > 1 else 0
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(1, 6):
    opt.zero_grad()
    (w * w).sum().backward()
    if step == fail_at:
        raise RuntimeError(f"planted failure at step {step}")
    opt.step()
"""

ANOTHER_JOB = """
import torch, dtlab
m = torch.nn.Linear(2, 1)
dtlab.attach(m, torch.optim.SGD(m.parameters(), lr=0.1),
             [torch.randn(4, 2) for _ in range(8)], lambda m, b: m(b).pow(2).mean())
"""


def process_state(dt) -> dict:
    """What of each rank's process the script changes: {rank: (sys.path, threads, env)}."""
    return dt.run(
        lambda: (
            list(__import__("sys").path),
            __import__("torch").get_num_threads(),
            dict(__import__("os").environ),
        )
    )


def set_test_env(dt, **values) -> None:
    """On every rank: each name set to its value, or removed where the value is None."""

    def apply(values):
        environ = __import__("os").environ
        for name, value in values.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value

    dt.run(apply, values)


@pytest.mark.parametrize("end", ["finished", "failed", "stopped", "detached"])
def test_what_a_script_changed_of_the_process_is_put_back_when_it_ends(live2, tmp_path, end):
    dt = live2
    path = tmp_path / "changes_process.py"
    path.write_text(CHANGES_PROCESS)
    set_test_env(dt, DTLAB_TEST_CHANGED="before", DTLAB_TEST_REMOVED="there")
    try:
        before = process_state(dt)
        status = dt.run_script(str(path), ["2"] if end == "failed" else [])
        assert status.paused
        # paused, the changes are the script's, as in its own process
        for paths, threads, env in process_state(dt).values():
            assert threads == 7 and paths[0] == "/dtlab-test/first"
            assert "/dtlab-test/appended" in paths
            assert env["DTLAB_TEST_ADDED"] == env["DTLAB_TEST_CHANGED"] == "by the script"
            assert "DTLAB_TEST_REMOVED" not in env and env["OMP_NUM_THREADS"] == "7"
        if end == "finished":
            assert dt.continue_script().stopped == "ended"
        elif end == "failed":
            with pytest.raises(RankError, match="planted failure at step 2"):
                dt.continue_script()
        elif end == "stopped":
            dt.scripts.stop()
        else:  # another job attached in its place: nothing can step the script any more
            dt.execute(ANOTHER_JOB)
            assert dt.step(2).last_step == 2  # the attached job steps
        status = dt.scripts.refresh()
        if end == "detached":
            assert {o["evalue"] for o in status.outcomes.values()} == {
                "stopped by dtlab: another job was attached"
            }
        after = process_state(dt)
        for r in before:
            assert after[r][0] == before[r][0], f"rank {r}: sys.path"
            assert after[r][1] == before[r][1], f"rank {r}: torch threads"
            assert after[r][2] == before[r][2], f"rank {r}: environment"
        assert {threads for _, threads, _ in after.values()} == {rank_threads(dt)}
    finally:
        if dt.scripts.refresh() is not None and dt.scripts.last.paused:
            dt.scripts.stop()
        set_test_env(dt, DTLAB_TEST_CHANGED=None, DTLAB_TEST_REMOVED=None, DTLAB_TEST_ADDED=None)


def test_a_paused_script_ends_before_a_relaunch_rebuilds_the_group(live2, tmp_path):
    """A relaunch with other group settings rejoins the same engines (a new MASTER_PORT,
    run id, thread count): the paused script ends first, so that what it puts back at its
    end is what the ranks had before it, not the old group's."""
    dt = live2
    path = tmp_path / "changes_process.py"
    path.write_text(CHANGES_PROCESS)
    set_test_env(dt, DTLAB_TEST_CHANGED="before", DTLAB_TEST_REMOVED="there")
    threads = rank_threads(dt)
    try:
        assert dt.run_script(str(path)).paused
        old_ids = set(dt.run(lambda: __import__("os").environ["TORCHELASTIC_RUN_ID"]).values())
        again = dtlab.launch(2, progress=quiet, threads=threads + 1)
        assert again is dt  # the same engines, regrouped
        assert set(dt.run(api.script_status).values()) == {None}  # stopped, then forgotten
        for paths, now, env in process_state(dt).values():
            assert now == threads + 1 and "/dtlab-test/appended" not in paths
            assert env["DTLAB_TEST_CHANGED"] == "before" and "DTLAB_TEST_ADDED" not in env
            assert env["TORCHELASTIC_RUN_ID"] not in old_ids
    finally:
        dtlab.launch(2, progress=quiet)  # the default threads again
        set_test_env(dt, DTLAB_TEST_CHANGED=None, DTLAB_TEST_REMOVED=None)


# every variable it sees, as a JSON file per rank
DUMPS_ENV = """
import json, os, sys
import torch.distributed as dist
name = f"{os.environ['GROUP_RANK']}-{os.environ['RANK']}.json"
with open(os.path.join(sys.argv[1], name), "w") as f:
    json.dump({"env": dict(os.environ), "elastic": dist.is_torchelastic_launched()}, f)
"""
# what dtlab does not set, on purpose (rendezvous.torchrun_env says why)
NOT_SET = {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE"}
ONLY_THE_AGENTS = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}  # torchrun's own process sets it
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # another store, another run
LOOPBACK = {"MASTER_ADDR"}  # one host: torchrun says localhost, dtlab 127.0.0.1


def dumped(folder: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("*.json")}


def test_the_script_reads_every_variable_torchrun_sets_with_torchruns_values(live2, tmp_path):
    dt = live2
    script = tmp_path / "dumps_env.py"
    script.write_text(DUMPS_ENV)
    theirs_dir, ours_dir = tmp_path / "torchrun", tmp_path / "dtlab"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    parent = {**os.environ, **thread_env(rank_threads(dt))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = run_torchrun([*cmd, str(script), str(theirs_dir)], TORCHRUN_TIMEOUT_S, env=parent)
    assert done.returncode == 0, done.stderr[-3000:]
    status = dt.run_script(str(script), [str(ours_dir)])
    assert set(status.states.values()) == {"ended"}
    theirs, ours = dumped(theirs_dir), dumped(ours_dir)
    assert set(theirs) == set(ours) == {0, 1}
    for r in (0, 1):
        # what torchrun gave the worker beyond the environment it was started in
        given = {k: v for k, v in theirs[r]["env"].items() if parent.get(k) != v}
        given = {k: v for k, v in given.items() if k not in ONLY_THE_AGENTS}
        mine = ours[r]["env"]
        assert ours[r]["elastic"] is theirs[r]["elastic"] is True
        assert {"GROUP_RANK", "ROLE_NAME", "TORCHELASTIC_RUN_ID"} <= set(given)
        assert set(given) - NOT_SET <= set(mine), f"rank {r} lacks {set(given) - set(mine)}"
        compared = set(given) - NOT_SET - PER_RUN - LOOPBACK
        differ = {k: (given[k], mine[k]) for k in compared if mine[k] != given[k]}
        assert differ == {}, f"rank {r}: (torchrun's, dtlab's) {differ}"
        for name in LOOPBACK:
            assert ipaddress.ip_address(socket.gethostbyname(given[name])).is_loopback
            assert ipaddress.ip_address(socket.gethostbyname(mine[name])).is_loopback
        assert not NOT_SET & set(mine)
        assert mine["MASTER_PORT"].isdigit() and mine["TORCHELASTIC_RUN_ID"]
    # one run id and one store for the whole world, as torchrun's
    for name in PER_RUN:
        assert len({ours[r]["env"][name] for r in ours}) == 1
    assert len({theirs[r]["env"]["TORCHELASTIC_RUN_ID"] for r in theirs}) == 1


# records the command line it got, then ends (no optimizer step)
RECORDS_ARGV = """
import json, os, sys
with open(os.path.join(os.path.dirname(__file__), f"argv-{os.environ['RANK']}.json"), "w") as f:
    json.dump(sys.argv, f)
"""


def test_a_path_with_spaces_through_the_magic(ip, live2, tmp_path):
    folder = tmp_path / "dir with space"
    folder.mkdir()
    script = folder / "train me.py"
    script.write_text(RECORDS_ARGV)
    escaped = str(script).replace(" ", "\\ ")
    for line in (
        f'"{script}" --name "a b" c\\ d',
        f"'{script}' --name 'a b' \"c d\"",
        f"{escaped} --name a\\ b 'c d'",
    ):
        for f in folder.glob("argv-*.json"):
            f.unlink()
        ip.run_line_magic("dt_script", line)
        for r in (0, 1):
            argv = json.loads((folder / f"argv-{r}.json").read_text())
            assert argv == [str(script), "--name", "a b", "c d"], line
    with pytest.raises(UsageError, match='has a " that is never closed, at character 1'):
        ip.run_line_magic("dt_script", f'"{script} --name x')


def test_the_line_is_split_as_a_shell_splits_it():
    assert split_line('"dir with space/train me.py" --lr 3e-4') == [
        "dir with space/train me.py",
        "--lr",
        "3e-4",
    ]
    assert split_line("dir\\ with\\ space/t.py 'a \"b\"' \"it's\" x\\'y") == [
        "dir with space/t.py",
        'a "b"',
        "it's",
        "x'y",
    ]
    assert split_line('--cwd \'my dir\' t.py --msg "say \\"hi\\""') == [
        "--cwd",
        "my dir",
        "t.py",
        "--msg",
        'say "hi"',
    ]
    assert split_line("t.py # not a comment") == ["t.py", "#", "not", "a", "comment"]
    assert split_line("") == []
    with pytest.raises(
        OptionError, match="has a ' that is never closed, at character 10 \\('a b\\)"
    ):
        split_line("t.py --x 'a b")
    with pytest.raises(OptionError, match='has a " that is never closed, at character 6'):
        split_line("t.py \"a 'b' \\\" c")
    with pytest.raises(OptionError, match="ends with a backslash, which escapes nothing"):
        split_line("t.py a\\")


# waits at its start for the test's go, then steps
WAITS_TO_GO = """
import os, sys, time, torch
folder = sys.argv[1]
open(os.path.join(folder, f"started-{os.environ['RANK']}"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.01)
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(100):
    opt.zero_grad()
    (w * w).sum().backward()
    opt.step()
"""
MARKS_ITS_RUN = """
import os, sys, torch
open(os.path.join(sys.argv[1], f"second-ran-{os.environ['RANK']}"), "w").close()
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(100):
    opt.zero_grad()
    (w * w).sum().backward()
    opt.step()
"""


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {WAIT_S} s"
        time.sleep(0.02)


def test_a_second_start_while_one_is_starting_is_refused_and_the_first_steps_on(live2, tmp_path):
    dt = live2
    first, second = tmp_path / "waits_to_go.py", tmp_path / "marks_its_run.py"
    first.write_text(WAITS_TO_GO)
    second.write_text(MARKS_ITS_RUN)
    results: list = []

    def start_first():
        try:
            results.append(dt.run_script(str(first), [str(tmp_path)]))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            results.append(e)

    thread = threading.Thread(target=start_first, daemon=True)
    thread.start()
    try:
        started = [tmp_path / f"started-{r}" for r in (0, 1)]
        wait_for(lambda: all(p.exists() for p in started), "start of the first script")
        with pytest.raises(DtlabError) as e:
            dt.run_script(str(second), [str(tmp_path)])
        text = str(e.value)
        assert f"cannot start {second}: another call is starting {first}" in text
        assert "Wait for that call to return" in text and "dt.scripts.stop()" in text
    finally:
        (tmp_path / "go").touch()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    [status] = results
    assert not isinstance(status, BaseException), status
    assert status.paused and set(status.steps.values()) == {0}
    assert not list(tmp_path.glob("second-ran-*"))  # the refused call reached no rank
    assert dt.step(3).last_step == 3  # the first is unharmed
    assert dt.scripts.last.path == str(first)
    # once that call returned, a new one replaces the paused script, as before
    again = dt.run_script(str(second), [str(tmp_path)])
    assert again.paused and len(list(tmp_path.glob("second-ran-*"))) == 2
    dt.scripts.stop()

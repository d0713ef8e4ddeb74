"""Launching for real: eight ranks, launches that must fail cleanly, and a notebook
kernel that dies under its ranks."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

import dtlab
from dtlab.control.cluster import EngineCluster, running
from dtlab.control.config import LaunchConfig
from dtlab.control.errors import LaunchError
from tests.conftest import default_threads, quiet

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def test_eight_ranks_all_reduce_and_threads(no_leftovers):
    dt = dtlab.launch(8, progress=quiet)
    assert sorted(dt.infos) == list(range(8))
    assert {i.allreduce_sum for i in dt.infos.values()} == {28}
    assert {i.num_threads for i in dt.infos.values()} == {default_threads(8)}
    assert [i.local_rank for i in dt.infos.values()] == list(range(8))
    assert len({i.pid for i in dt.infos.values()}) == 8
    out = dt.execute("t = torch.ones(3) * rank\ndist.all_reduce(t)\nprint(t.tolist())")
    assert {o.stdout for o in out.values()} == {"[28.0, 28.0, 28.0]\n"}
    assert dt.inconsistencies() == []
    pids = dt.pids()
    dt.shutdown()
    assert running(pids) == []


def test_progress_reports_both_phases(no_leftovers):
    seen = []
    dtlab.launch(2, restart=True, progress=lambda *a: seen.append(a))
    assert ("engines registered", 2, 2) in seen and ("ranks initialised", 2, 2) in seen
    phases = [p for p, _, _ in seen]
    assert phases.index("ranks initialised") > phases.index("engines registered")


def test_nccl_without_gpu_fails_clean(no_leftovers):
    with pytest.raises(LaunchError) as e:
        dtlab.launch(2, backend="nccl", restart=True, progress=quiet)
    assert "--backend nccl needs one CUDA device per rank" in str(e.value)
    assert "ranks 0-1" in str(e.value) and "--backend gloo" in str(e.value)
    with pytest.raises(Exception, match="no live dtlab session"):
        dtlab.session()


def test_port_in_use_fails_clean(no_leftovers):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError) as e:
            dtlab.launch(2, port=port, restart=True, progress=quiet)
    assert f"port {port} is already in use" in str(e.value)
    assert "rank 0" in str(e.value)


def test_engines_that_never_register_fail_clean(no_leftovers):
    start = time.monotonic()
    with pytest.raises(LaunchError) as e:
        dtlab.launch(2, timeout=0.5, restart=True, progress=quiet)
    assert time.monotonic() - start < 15
    assert re.search(r"only [01] of 2 engines registered within 0.5 s", str(e.value))
    assert "everything this launch started was stopped" in str(e.value)
    assert "Raise --timeout" in str(e.value)


def test_engine_launcher_that_dies_is_reported_with_its_output(no_leftovers):
    bad = {"ForkingEngineSetLauncher": {"engine_args": ["--no-such-engine-option"]}}
    with pytest.raises(LaunchError) as e:
        dtlab.launch(2, launcher_config=bad, restart=True, timeout=60, progress=quiet)
    assert "the engine launcher exited while engines were registering" in str(e.value)
    assert "no-such-engine-option" in str(e.value)


def test_dead_notebook_kernel_takes_its_ranks_along(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(
        "import dtlab, time\n"
        "dt = dtlab.launch(2, progress=lambda *a: None)\n"
        "print(' '.join(map(str, dt.pids())), flush=True)\n"
        "time.sleep(600)\n"
    )
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in kernel.stdout.readline().split()]
        assert len(pids) >= 6
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
    deadline = time.monotonic() + 20
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = running(pids)
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_an_engine_lost_while_registering_is_noticed(no_leftovers):
    engines = EngineCluster(LaunchConfig(num_ranks=2))
    try:
        engines.start(quiet)
        forkserver = psutil.Process(next(iter(engines.cluster.engines.values())).pid)
        assert engines._engines_lost() == 0
        victim = forkserver.children()[0]
        victim.kill()
        victim.wait(10)
        assert engines._engines_lost() == 1
        with pytest.raises(LaunchError, match="1 engine process\\(es\\) exited before registering"):
            engines._check_alive()
    finally:
        engines.stop()

"""A live 2-rank cluster driven through the Python API (dtlab.launch / Session)."""

import os
import signal
import socket
import threading
import time
from pathlib import Path

import ipyparallel as ipp
import pytest

import dtlab
from dtlab import demo
from dtlab.control.cluster import cluster_log_path, running
from dtlab.control.errors import (
    DtlabError,
    LaunchError,
    RankError,
    RankTimeoutError,
    StepInterrupted,
)
from tests.conftest import default_threads, quiet, signal_when_exists

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@ipp.interactive  # resolved in the rank's namespace, like a function defined in a notebook
def environ():
    import os

    return dict(os.environ)


def test_two_ranks_form_a_group_proved_by_all_reduce(live2):
    dt = live2
    assert dt.world_size == 2 and dt.backend == "gloo"
    assert {r: i.allreduce_sum for r, i in dt.infos.items()} == {0: 1, 1: 1}
    # the group works from user code too
    out = dt.execute("t = torch.tensor([rank + 1.0]); dist.all_reduce(t); t.item()")
    assert {r: o.result for r, o in out.items()} == {0: "3.0", 1: "3.0"}


def test_each_engine_is_the_rank_the_map_says(live2):
    dt = live2
    for rank, engine_id in enumerate(dt.rank_map.engine_ids):
        assert dt.engines.client[engine_id].pull("rank", block=True) == rank
    assert dt.pull("rank") == {0: 0, 1: 1}
    env = dt.run(environ)
    for rank in dt.ranks:
        assert env[rank]["RANK"] == str(rank) and env[rank]["LOCAL_RANK"] == str(rank)
        assert env[rank]["WORLD_SIZE"] == "2" and env[rank]["LOCAL_WORLD_SIZE"] == "2"
        assert env[rank]["MASTER_ADDR"] == "127.0.0.1"
        assert int(env[rank]["MASTER_PORT"]) > 0
        # the launcher's own order decides ranks: fork index, MPI rank, SLURM_PROCID
        index = {
            "local": "DTLAB_ENGINE_INDEX",
            "mpi": "OMPI_COMM_WORLD_RANK",
            "slurm": "SLURM_PROCID",
        }[dt.config.launcher]
        assert env[rank][index] == str(rank)
        assert env[rank]["OMP_NUM_THREADS"] == str(default_threads(2))  # cores / ranks
    assert len({env[r]["MASTER_PORT"] for r in dt.ranks}) == 1


def test_run_push_pull_and_rank_subsets(live2):
    dt = live2
    dt.push({"base": 10})

    @ipp.interactive
    def scaled():
        return base * (rank + 1)  # noqa: F821 - names of the rank's namespace

    assert dt.run(scaled) == {0: 10, 1: 20}
    assert dt.run(scaled, ranks="1") == {1: 20}
    dt.push({"base": 1}, ranks=[0])
    assert dt.pull("base") == {0: 1, 1: 10}
    with pytest.raises(ValueError, match="rank 2 in '2' does not exist"):
        dt.pull("base", ranks="2")


def test_errors_on_several_ranks_become_one(live2):
    with pytest.raises(RankError) as e:
        live2.execute("print('before', rank)\nif rank == 1:\n    1 / 0\n")
    err = e.value
    assert set(err.failures) == {1} and err.finished == (0,)
    assert err.failures[1].ename == "ZeroDivisionError"
    assert "rank 1 raised ZeroDivisionError" in str(err)
    assert "ZeroDivisionError" in err.failures[1].traceback
    assert err.outputs[0].stdout == "before 0\n" and err.outputs[1].stdout == "before 1\n"


def test_timeout_interrupts_a_hung_rank_and_names_it(live2):
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as e:
        live2.execute("import time\nif rank == 1:\n    time.sleep(600)\n", timeout=2)
    assert time.monotonic() - start < 10
    assert e.value.stopped == (1,) and e.value.stuck == () and e.value.finished == (0,)
    assert "rank 1 did not finish (timed out after 2 s)" in str(e.value)
    # the interrupted rank is usable again at once
    assert live2.run(os.getpid, ranks=[1])[1] == live2.infos[1].pid


def test_rank_blocked_in_a_collective_is_reported_stuck(cluster_cleanup):
    dt = dtlab.launch(2, progress=quiet)
    with pytest.raises(RankTimeoutError) as e:
        dt.execute(
            "import time\nif rank == 1:\n    time.sleep(600)\nelse:\n    dist.barrier()", timeout=2
        )
    assert e.value.stopped == (1,) and e.value.stuck == (0,)
    assert "probably blocked in a collective" in str(e.value)
    assert dt.status()[0] == "busy"
    # a new request would queue behind the stuck barrier: refused, naming the rank
    with pytest.raises(DtlabError, match="rank 0 still busy with an earlier call"):
        dt.execute("dist.barrier()")
    assert dt.run(os.getpid, ranks=[1]) == {1: dt.infos[1].pid}  # the free rank still works
    old_pids = dt.pids()
    fresh = dtlab.launch(2, progress=quiet)  # a busy session is replaced, not reused
    assert fresh is not dt and dt.closed
    assert running(old_pids) == []
    assert set(fresh.run(os.getpid).values()) == {i.pid for i in fresh.infos.values()}


@pytest.mark.timeout(500)
def test_ctrl_c_interrupts_the_ranks(live2, tmp_path):
    # Ctrl-C in the notebook is SIGINT to the kernel, sent once both ranks are sleeping
    ctrl_c = signal_when_exists(
        [tmp_path / "busy0", tmp_path / "busy1"], os.getpid(), signal.SIGINT
    )
    cell = f"import time\nopen({str(tmp_path)!r} + f'/busy{{rank}}', 'w').close()\ntime.sleep(600)"
    with pytest.raises(RankTimeoutError) as e:  # a lost SIGINT would end as "timed out"
        live2.execute(cell, timeout=400)  # the ranks may take long to start it when busy
    assert ctrl_c.sent, "the ranks never started the cell"
    assert e.value.reason == "interrupted" and e.value.stopped == (0, 1)
    assert live2.status() == {0: "idle", 1: "idle"}


SLOW_FROM = """
import time
from dtlab.agent.job import current
_job = current()
_inner = _job.loss_fn
def _slow(model, batch):
    step = current().step_count + 1
    if step >= {slow}:  # slow steps: the ranks then agree (pause?) every few steps
        time.sleep(0.25)
    if step in {flags}:  # the notebook's Ctrl-C comes once both ranks are here
        open({folder!r} + f'/step{{step}}-rank{{rank}}', 'w').close()
    return _inner(model, batch)
_job.loss_fn = _slow
"""


def ctrl_c_at(folder: Path, step: int):
    """SIGINT to this process (Ctrl-C in the notebook) once both ranks began ``step``."""
    paths = [folder / f"step{step}-rank{rank}" for rank in (0, 1)]
    return signal_when_exists(paths, os.getpid(), signal.SIGINT, timeout=200)


@pytest.mark.timeout(300)
def test_ctrl_c_stops_a_loop_of_steps_with_every_rank_paused(live2, tmp_path, ip, capsys):
    dt = live2
    demo.attach(dt)
    dt.execute(SLOW_FROM.format(slow=11, flags=(23, 43), folder=str(tmp_path)))
    ctrl_c = ctrl_c_at(tmp_path, 23)  # in the third call: steps 21-30
    calls = 0
    with pytest.raises(KeyboardInterrupt) as e:
        for _ in range(6):  # (a loop that Ctrl-C does not stop ends, and the test fails)
            calls += 1
            dt.step(10)
    assert ctrl_c.sent, "the ranks never reached step 23"
    assert isinstance(e.value, StepInterrupted), repr(e.value)  # not a stray SIGINT
    assert calls == 3  # the loop stopped in the call the Ctrl-C came in
    paused = e.value.result
    assert paused.stopped == "pause" and 23 <= paused.last_step < 30, paused
    assert {recs[-1].step for recs in dt.trace.records.values()} == {paused.last_step}
    assert dt.status() == {0: "idle", 1: "idle"}
    assert str(e.value).startswith(f"Ctrl-C: every rank paused after step {paused.last_step}")
    # the session goes on from there
    assert dt.step(1).last_step == paused.last_step + 1
    for _ in range(42 - dt.trace.last_step):  # up to step 42, one step a call
        dt.step(1)
    # %dt_step says what the run did, then the KeyboardInterrupt ends the cell
    capsys.readouterr()
    ctrl_c = ctrl_c_at(tmp_path, 43)
    with pytest.raises(KeyboardInterrupt) as e:
        ip.run_line_magic("dt_step", "20")
    assert ctrl_c.sent and isinstance(e.value, StepInterrupted)
    last = e.value.result.last_step
    assert 43 <= last < 62
    out = capsys.readouterr().out
    assert f"steps 43-{last} in " in out
    assert "paused (every rank stopped after the same step)" in out
    assert {recs[-1].step for recs in dt.trace.records.values()} == {last}
    assert dt.step(1).last_step == last + 1


def test_dead_rank_is_named_quickly(cluster_cleanup, capfd):
    dt = dtlab.launch(2, progress=quiet)
    log = cluster_log_path(dt.engines.cluster)
    victim = dt.infos[1].pid
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(RankError) as e:
        dt.execute("import time\ntime.sleep(30)", timeout=25)
    assert time.monotonic() - start < 10
    assert e.value.dead_ranks == (1,)
    assert "rank 1 died" in str(e.value)
    assert dt.status()[1] == "dead"
    with pytest.raises(RankError, match="rank 1 died"):
        dt.run(os.getpid)  # later calls name the dead rank instead of hanging
    assert dtlab.launch(2, progress=quiet) is not dt  # relaunch replaces the broken session
    # ipyparallel's account of the stopped engines goes to its log file, not the notebook
    assert "Output for" not in capfd.readouterr().err
    assert "Starting 2 engines" in Path(log).read_text()


def test_relaunch_reuses_live_ranks_and_rebuilds_changed_group(live2):
    dt = live2
    pids = dt.run(os.getpid)
    assert dtlab.launch(2, progress=quiet) is dt
    assert dtlab.launch(2, backend="gloo", progress=quiet) is dt  # what auto chose anyway
    again = dtlab.launch(2, threads=2, pg_timeout=300, progress=quiet)
    assert again is dt and dt.run(os.getpid) == pids  # same engines, new group
    assert {i.num_threads for i in dt.infos.values()} == {2}
    assert dt.execute("torch.get_num_threads()")[1].result == "2"
    dtlab.launch(2, progress=quiet)  # back to defaults for later tests
    assert {i.num_threads for i in dt.infos.values()} == {default_threads(2)}


def test_relaunch_with_new_environment_starts_new_engines(live2):
    pids = live2.run(os.getpid)
    fresh = dtlab.launch(2, env={"GLOO_SOCKET_TIMEOUT_MS": "60000"}, progress=quiet)
    assert fresh is not live2 and set(fresh.run(os.getpid).values()).isdisjoint(pids.values())
    assert fresh.infos[0].env["GLOO_SOCKET_TIMEOUT_MS"] == "60000"
    assert dtlab.launch(2, progress=quiet).run(environ)[0].get("GLOO_SOCKET_TIMEOUT_MS") is None


def test_bad_relaunch_leaves_the_live_ranks_alone(live2):
    live2.push({"kept": 42})
    with pytest.raises(LaunchError, match="--backend nccl needs one CUDA device per rank"):
        dtlab.launch(2, backend="nccl", progress=quiet)
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        with pytest.raises(LaunchError, match=f"port {s.getsockname()[1]} is already in use"):
            dtlab.launch(2, port=s.getsockname()[1], progress=quiet)
    assert dtlab.session() is live2 and live2.pull("kept") == {0: 42, 1: 42}
    assert {i.allreduce_sum for i in live2.infos.values()} == {1}
    out = live2.execute("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")  # group intact
    assert {o.result for o in out.values()} == {"2.0"}


def test_a_failure_interrupts_the_ranks_still_running(live2):
    start = time.monotonic()
    with pytest.raises(RankError) as e:
        live2.execute("import time\nif rank == 1:\n    raise ValueError('bad')\ntime.sleep(600)")
    assert time.monotonic() - start < 10
    assert set(e.value.failures) == {1} and e.value.stopped == (0,) and e.value.stuck == ()
    assert live2.status() == {0: "idle", 1: "idle"}


def test_different_size_restarts_and_shutdown_leaves_nothing(cluster_cleanup):
    two = dtlab.launch(2, progress=quiet)
    two_pids = two.pids()
    three = dtlab.launch(3, progress=quiet)
    assert three is not two and two.closed and running(two_pids) == []
    assert {i.allreduce_sum for i in three.infos.values()} == {3}
    pids = three.pids()
    rank_pids = {i.pid for i in three.infos.values()}
    assert rank_pids <= set(pids)
    # controller + fork server + 3 engines + 3 nannies at least
    assert len(pids) >= 8
    three.shutdown()
    assert running(pids) == []
    with pytest.raises(Exception, match="shut down"):
        three.run(os.getpid)
    with pytest.raises(Exception, match="no live dtlab session"):
        dtlab.session()


def test_dead_controller_is_an_error_not_a_hang(cluster_cleanup):
    dt = dtlab.launch(2, restart=True, progress=quiet)
    controller = dt.engines.cluster.controller.process.pid
    threading.Timer(1.0, os.kill, (controller, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(DtlabError, match="controller has exited"):
        dt.execute("import time\ntime.sleep(60)")  # no timeout: only the check can end it
    assert time.monotonic() - start < 10
    with pytest.raises(DtlabError, match=r"controller has exited.*%dt_launch 2 --restart"):
        dt.status()
    old = dt.pids()
    fresh = dtlab.launch(2, progress=quiet)
    assert fresh is not dt and running(old) == []
    assert fresh.pull("rank") == {0: 0, 1: 1}

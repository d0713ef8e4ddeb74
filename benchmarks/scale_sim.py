"""The notebook side at 512 and 1,024 ranks on a 2-core machine: fake ranks on the real wire.

    python benchmarks/scale_sim.py                        # 64, 512 and 1,024 ranks, 100 steps
    python benchmarks/scale_sim.py --ranks 512 --steps 300 --per-host 8

Fake ranks are zmq DEALER sockets in a few helper processes (asyncio, no torch): each says
hello, then answers every RunRequest the notebook's stepping Channel sends with a ``done``
RankReply carrying its step records as packed rows (records/packed.py), exactly what a real
rank's agent/stepping.py sends. The records are doctor_scale.py's simulated data-parallel job (300
parameters; one rank's weights part from the others at 40 % of the run, one rank leaks
4 MiB a step, one is a 1.5x straggler), so the notebook's Trace fills with what a real
512-rank job would send, and the doctor must find the planted problems at the end.

The notebook side is dtlab's own: each step is ``Stepper.run(1)``, the path of
``dt.step(1)`` (control/stepper.py and control/runs.py: the RunRequest sent to every rank,
the replies gathered and handled by the Run, their rows taken into the job's Trace, the
trace's run folder written at the end of the run). Only the world around the Stepper is
a stand-in (SimSession: no ipyparallel cluster to ask). Reported per step: the wall time of
``Stepper.run(1)``, the notebook's CPU time, the part of it spent taking rows into the
trace, per rank-record, the target (issue 20: <= 1 ms + 5 us x N for dt.step(1) at N
simulated ranks), how much the notebook process grew per rank-record (RSS, after the run),
and the doctor's time and verdict over the whole trace. The fake ranks do no work, so the
time is the notebook's and the transport's; they share the 2 cores with it, which the wall
time includes.

Each size runs three times in one go: every fake rank straight to the notebook (as jobs
below $DTLAB_RELAY_AT do); through a real relay per host (agent/relay.py, a thread per host
in the helper processes, as on each host's first rank), where the notebook sends one
command and gets one message per host; and with those host relays joined by group relays
(``--fan-in`` hosts each, as from $DTLAB_RELAY_FAN_IN host relays on; in a helper process
of their own, reached over TCP), where the notebook gets one message per group.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_scale import job, named, simulate  # noqa: E402

from dtlab.agent import api  # noqa: E402
from dtlab.analysis.doctor import all_findings, run_checks  # noqa: E402
from dtlab.analysis.registry import registered  # noqa: E402
from dtlab.control.activity import RankActivity  # noqa: E402
from dtlab.control.relays import FAN_IN, FAN_IN_ENV, RELAY_ENV  # noqa: E402
from dtlab.control.stepper import Stepper  # noqa: E402
from dtlab.records import Evidence  # noqa: E402
from dtlab.records.packed import pack  # noqa: E402
from dtlab.records.run_folder import RUNS_DIR_ENV  # noqa: E402
from dtlab.records.trace import Trace  # noqa: E402
from dtlab.records.wire import RankReply, RunRequest, decode_request, frames  # noqa: E402

HELPERS = 2  # processes holding the fake ranks (one per core)


def group_relays(address: str, key: str, leaders: list[int], opened, stop) -> None:
    """A helper process: the group relays (agent/relay.py, ``listen=True``) of ``leaders``,
    as each would run on its host's first rank; sends their addresses on ``opened`` and
    serves until ``stop`` is set."""
    from dtlab.agent.relay import Relay

    relays = [Relay(address, key, r, listen=True) for r in leaders]
    opened.send({relay.rank: relay.remote for relay in relays})
    stop.wait()
    for relay in relays:
        relay.close()


def fake_ranks(
    address: str,
    key: str,
    relays: dict[int, int | None],
    upstream: dict[int, str | None],
    total: int,
    steps: int,
    ready,
) -> None:
    """A helper process: one DEALER per rank of ``relays`` (rank -> the rank whose host
    relay it goes through, None: straight), replaying its simulated records; the host
    relays (agent/relay.py) of its hosts run in this process, as on each host's first rank,
    each sending up to its ``upstream`` (a group relay's address; None: the notebook), but
    for group relays, which run in the group_relays process."""
    import zmq
    import zmq.asyncio

    from dtlab.agent.relay import Relay, local_address

    all_records, *_ = simulate(total, steps)
    records = {r: all_records[r] for r in relays}
    del all_records
    context = zmq.asyncio.Context()
    threads = [
        Relay(upstream.get(r) or address, key, r)
        for r, via in relays.items()
        if via == r and upstream.get(r) != ""
    ]

    async def rank_loop(rank: int) -> None:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        socket.setsockopt(zmq.LINGER, 0)
        via = relays[rank]
        socket.connect(address if via is None else local_address(key, via))
        await socket.send_multipart(frames(RankReply("hello", None, rank), key))
        made = 0
        while True:
            request = decode_request(await socket.recv(), key)
            if not isinstance(request, RunRequest):
                continue
            if request.steps < 0:  # the benchmark's end
                break
            new = records[rank][made : made + request.steps]
            made += len(new)
            rows = pack(rank, new).to_bytes()
            reply = RankReply(
                "done", request.id, rank, step=made, attach=1, rows=rows, stopped="steps"
            )
            await socket.send_multipart(frames(reply, key))
        socket.close()

    async def main() -> None:
        ready.set()
        await asyncio.gather(*(rank_loop(r) for r in relays))

    asyncio.run(main())
    for relay in threads:
        relay.close()


class SimSession:
    """What dtlab's Stepper asks of its World and Hangs (control/world.py, hangs.py), for
    fake ranks: the
    ranks and their hosts, connecting them (here: starting the helper processes with what
    ``api.serve`` would get on each rank), the attached job, the rank states (the real
    RankActivity), and where the job stands. There is no ipyparallel cluster: nothing
    here may be asked of one, and a helper that dies is a dead rank."""

    def __init__(self, ranks: int, steps: int, per_host: int):
        self.ranks = list(range(ranks))
        self.world_size = ranks
        self.steps = steps
        hosts = {r: f"sim-{r // per_host if per_host else r}" for r in self.ranks}
        self.infos = {r: SimpleNamespace(host=h) for r, h in hosts.items()}
        self.config = SimpleNamespace(listen=None, launcher="local")
        self.activity = RankActivity()
        self.backend = "gloo"
        self.calls = 0
        _, params, self.planted, _ = simulate(ranks, 1)  # the jobs, and which ranks carry what
        self.jobs = {r: job(r, params) for r in self.ranks}
        self.names = tuple(p.name for p in params)
        self.helpers: list = []
        self.leaders: list[int] = []  # ranks running a group relay
        self.stop_groups = None
        self.stepper = Stepper(self, self)  # the world and its hangs, both stand-ins
        self.stepper.hang_timeout = 120.0  # generous: 2 cores for all the fake ranks

    # --- what the Stepper asks -------------------------------------------------------------
    def run_each(self, fn, args: dict, what: str = "", timeout: float | None = None) -> dict:
        ctx = mp.get_context("spawn")
        address, key = next(iter(args.values()))[:2]
        if fn is api.open_group_relay:  # first: a helper of their own (not on the notebook)
            assert not self.helpers and not self.leaders  # connected once
            self.leaders = sorted(args)
            opened, sent = ctx.Pipe(duplex=False)
            self.stop_groups = ctx.Event()
            helper = ctx.Process(
                target=group_relays, args=(address, key, self.leaders, sent, self.stop_groups)
            )
            helper.start()
            self.helpers.append(helper)
            if not opened.poll(300):
                raise RuntimeError("the group relays' helper did not start")
            return opened.recv()
        assert fn is api.serve and len(self.helpers) <= 1  # connected once
        # host relays: the group relays' own run in their helper ("" here: none to start)
        upstream = {r: "" if r in self.leaders else a[4] for r, a in args.items()}
        readies = []
        for h in range(HELPERS):  # whole hosts to each helper
            hosts = sorted({self.infos[r].host for r in self.ranks})[h::HELPERS]
            mine = {r: a[3] for r, a in args.items() if self.infos[r].host in hosts}
            if not mine:  # (fewer hosts than helpers)
                continue
            ready = ctx.Event()
            helper = ctx.Process(
                target=fake_ranks,
                args=(address, key, mine, upstream, self.world_size, self.steps + 1, ready),
            )
            helper.start()
            readies.append(ready)
            self.helpers.append(helper)
        for ready in readies:
            ready.wait(300)
        return {r: 1 for r in args}

    def run(self, fn, timeout: float | None = None) -> dict:
        assert fn is api.describe_job
        return {r: (1, info) for r, info in self.jobs.items()}

    def check_ready(self, client, ranks, what: str) -> None:  # (as the session's does)
        self.check_controller()
        self.stepper.read_late_replies()
        refused = self.activity.refusal(
            ranks,
            what,
            run_in_flight=self.stepper.active is not None,
            world_size=self.world_size,
        )
        if refused:
            raise RuntimeError(refused)

    def client(self) -> None:
        return None

    def check_controller(self) -> None:
        dead = [h.pid for h in self.helpers if not h.is_alive()]
        if dead:
            raise RuntimeError(f"fake-rank helper processes {dead} died")

    def dead_ranks(self, ranks) -> list[int]:
        return []  # (check_controller raises first)

    def listening(self):
        return self.config.listen, self.config.launcher, self.infos

    def close(self) -> None:
        if self.stepper.channel is not None:  # the helpers stop
            self.stepper.channel.send(self.ranks, RunRequest(id=0, steps=-1))
        if self.stop_groups is not None:
            self.stop_groups.set()
        for helper in self.helpers:
            helper.join(30)
            if helper.is_alive():
                helper.kill()
        self.stepper.close()


def measure(ranks: int, steps: int, per_host: int = 0, fan_in: int = 1) -> dict:
    """One configuration, stepped with dtlab's own Stepper (``dt.step(1)``'s path): each
    step one RunRequest to every rank, its replies gathered and taken into the job's trace
    (which writes its run folder, as a job's does). ``per_host``: ranks per relayed host
    (0: every rank straight to the notebook, as below $DTLAB_RELAY_AT); ``fan_in``: host
    relays per group relay (1: none, each host relay sends to the notebook)."""
    saved = {name: os.environ.get(name) for name in (RELAY_ENV, FAN_IN_ENV, RUNS_DIR_ENV)}
    folder = tempfile.mkdtemp(prefix="dtlab-scale-sim-")
    os.environ[RELAY_ENV] = "2" if per_host else str(ranks + 1)
    os.environ[FAN_IN_ENV] = str(fan_in)
    os.environ[RUNS_DIR_ENV] = folder
    took = [0.0]
    add = Trace._add_frame

    def timed(trace: Trace, frame) -> None:  # how long the trace takes the rows in
        t0 = time.perf_counter()  # not process_time: a syscall, 1,024 a step
        add(trace, frame)
        took[0] += time.perf_counter() - t0

    Trace._add_frame = timed  # type: ignore[method-assign]
    session = SimSession(ranks, steps, per_host)
    try:
        session.stepper.run(1)  # connects: the helpers start, every rank says hello
        walls, cpus, ingest = [], [], []
        gc.collect()
        rss_before = psutil.Process().memory_info().rss
        groups = psutil.Process(session.helpers[0].pid) if session.leaders else None
        relay_cpu = sum(groups.cpu_times()[:2]) if groups is not None else 0.0
        for _ in range(steps):
            took[0] = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            session.stepper.run(1)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            ingest.append(took[0])
        if groups is not None:  # what a group relay costs the rank it runs on, a step
            relay_cpu = (sum(groups.cpu_times()[:2]) - relay_cpu) / steps / len(session.leaders)
        gc.collect()
        grown = psutil.Process().memory_info().rss - rss_before
        trace = session.stepper.trace
        assert trace is not None and trace.last_step == steps + 1, "steps went missing"
        t0 = time.perf_counter()
        evidence = Evidence(
            records=trace.records, columns=trace.columns, names=session.names, jobs=session.jobs
        )
        findings = all_findings(run_checks(evidence, registered()))
        doctor = time.perf_counter() - t0
    finally:
        Trace._add_frame = add  # type: ignore[method-assign]
        session.close()
        shutil.rmtree(folder, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    skip = steps // 10  # first steps: connections and caches warm up
    return {
        "wall_ms": statistics.median(walls[skip:]) * 1e3,
        "wall_q": [q * 1e3 for q in statistics.quantiles(walls[skip:], n=4)],
        "wall_p95": statistics.quantiles(walls[skip:], n=20)[-1] * 1e3,  # the part writes
        "cpu_ms": statistics.median(cpus[skip:]) * 1e3,
        "cpu_mean_ms": statistics.mean(cpus[skip:]) * 1e3,  # with the Parquet parts' writes
        "ingest_us": statistics.median(ingest[skip:]) / ranks * 1e6,
        "doctor_s": doctor,
        "named": named(findings, session.planted),
        "bytes_per_record": grown / (ranks * steps),
        "group_relay_ms": relay_cpu * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--per-host", type=int, default=8, help="ranks per host behind a relay (default 8)"
    )
    parser.add_argument(
        "--fan-in", type=int, default=FAN_IN, help=f"host relays per group relay ({FAN_IN})"
    )
    args = parser.parse_args()
    print(
        f"one step of every fake rank at a time, {args.steps} steps, fake ranks in {HELPERS} "
        "processes (medians after the first tenth of the steps); each size straight to the "
        f"notebook, then through a relay per host of {args.per_host} ranks, then with those "
        f"joined by a group relay per {args.fan_in} hosts"
    )
    for ranks in args.ranks:
        target = 1.0 + 0.005 * ranks
        hosts = -(-ranks // args.per_host)
        configs = {
            "straight": (0, 1),
            f"relayed ({hosts} hosts)": (args.per_host, 1),
            f"relayed, grouped ({-(-hosts // args.fan_in)} group relays)": (
                args.per_host,
                args.fan_in,
            ),
        }
        for how, (per_host, fan_in) in configs.items():
            m = measure(ranks, args.steps, per_host, fan_in)
            q1, _, q3 = m["wall_q"]
            print(
                f"{ranks} ranks, {how}: step {m['wall_ms']:.1f} ms (IQR {q1:.1f}-{q3:.1f}, "
                f"p95 {m['wall_p95']:.1f}; "
                f"target {target:.1f} ms, {m['wall_ms'] / target:.1f}x), notebook CPU "
                f"{m['cpu_ms']:.1f} ms a step, {m['cpu_ms'] * 1e3 / ranks:.1f} us a rank "
                f"(target 10; mean {m['cpu_mean_ms']:.1f} ms, with the run folder's Parquet "
                f"parts), of which decode and store {m['ingest_us']:.1f} us per "
                f"rank-record, notebook memory {m['bytes_per_record']:.0f} B per "
                f"rank-record; doctor over the trace {m['doctor_s']:.2f} s, planted problems "
                "named: "
                + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in m["named"].items())
                + (
                    f"; each group relay's CPU (on its rank) {m['group_relay_ms']:.2f} ms a step"
                    if fan_in > 1 and m["group_relay_ms"]
                    else ""
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()

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

The notebook side is dtlab's own: Channel.send of a RunRequest to every rank,
Channel.receive_with_rows until every rank's done reply arrived, RankReply decoding, and
Trace.add_packed (an unrelayed rank's rows) or Trace.add_host (a relayed host's rows,
joined by its relay): the rows checked, kept, appended to the columns; no StepRecord is
made until something reads one. Reported per step: wall time of one step of every
rank (broadcast, gather, decode, store), the notebook's CPU time, its CPU per rank-record,
the target (issue 20: <= 1 ms + 5 us x N for dt.step(1) at N simulated ranks), how much
the notebook process grew per rank-record (RSS, after the run), and the doctor's time and
verdict over the whole trace. The fake ranks do no work, so the time is
the notebook's and the transport's; they share the 2 cores with it, which the wall time
includes.

Each size runs twice in one go: every fake rank straight to the notebook (as jobs below
$DTLAB_RELAY_AT do), then through a real relay per host (agent/relay.py, a thread per host
in the helper processes, as on each host's first rank), where the notebook sends one
command and gets one message per host.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_scale import job, named, simulate  # noqa: E402

from dtlab.analysis.doctor import all_findings, run_checks  # noqa: E402
from dtlab.analysis.registry import registered  # noqa: E402
from dtlab.control.channel import Channel  # noqa: E402
from dtlab.records import Evidence  # noqa: E402
from dtlab.records.packed import pack  # noqa: E402
from dtlab.records.trace import Trace  # noqa: E402
from dtlab.records.wire import RankReply, RunRequest, decode_request, frames  # noqa: E402

HELPERS = 2  # processes holding the fake ranks (one per core)


def fake_ranks(
    address: str, key: str, ranks: list[int], total: int, steps: int, ready, per_host: int
) -> None:
    """A helper process: one DEALER per rank, replaying its simulated records; with
    ``per_host``, the ranks go through a real relay (agent/relay.py) per host of that many
    consecutive ranks, run in this process as on the host's first rank."""
    import zmq
    import zmq.asyncio

    from dtlab.agent.relay import Relay, local_address

    all_records, *_ = simulate(total, steps)
    records = {r: all_records[r] for r in ranks}
    del all_records
    context = zmq.asyncio.Context()
    firsts = sorted({r - r % per_host for r in ranks}) if per_host else []
    relays = [Relay(address, key, first) for first in firsts]

    async def rank_loop(rank: int) -> None:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, str(rank).encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(local_address(key, rank - rank % per_host) if per_host else address)
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
            reply = RankReply("done", request.id, rank, step=made, rows=rows, stopped="steps")
            await socket.send_multipart(frames(reply, key))
        socket.close()

    async def main() -> None:
        ready.set()
        await asyncio.gather(*(rank_loop(r) for r in ranks))

    asyncio.run(main())
    for relay in relays:
        relay.close()


def measure(ranks: int, steps: int, per_host: int = 0) -> dict:
    """One configuration; ``per_host``: ranks per relayed host (0: every rank straight to
    the notebook, as below $DTLAB_RELAY_AT)."""
    channel = Channel()
    ctx = mp.get_context("spawn")
    readies, helpers = [], []
    for h in range(HELPERS):
        ready = ctx.Event()
        if per_host:  # whole hosts to each helper
            mine = [r for r in range(ranks) if (r // per_host) % HELPERS == h]
        else:
            mine = list(range(h, ranks, HELPERS))
        helper = ctx.Process(
            target=fake_ranks,
            args=(channel.address, channel.key, mine, ranks, steps, ready, per_host),
        )
        helper.start()
        readies.append(ready)
        helpers.append(helper)
    _, params, planted, _ = simulate(ranks, 1)  # the jobs, and which ranks carry what
    jobs = {r: job(r, params) for r in range(ranks)}
    trace = Trace(jobs)
    try:
        for ready in readies:
            ready.wait(300)
        missing = channel.wait_connected(range(ranks), timeout=300)
        if missing:
            raise RuntimeError(f"{len(missing)} fake ranks never connected")
        walls, cpus, ingest = [], [], []
        gc.collect()
        rss_before = psutil.Process().memory_info().rss
        for step in range(1, steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            channel.send(range(ranks), RunRequest(id=step, steps=1))
            done = 0
            took = 0.0
            while done < ranks:
                received, joined = channel.receive_with_rows(10.0)
                for host in joined:  # a relayed host's rows, one frame
                    i0 = time.perf_counter()  # not process_time: a syscall, 1,024 a step
                    trace.add_host(host.data, host.ranks)
                    took += time.perf_counter() - i0
                for data, rows in received:
                    reply = RankReply.from_dict(data, rows)
                    if reply.kind == "done" and reply.id == step:
                        if reply.rows:  # an unrelayed rank's
                            i0 = time.perf_counter()
                            trace.add_packed(reply.rank, reply.rows)
                            took += time.perf_counter() - i0
                        done += 1
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            ingest.append(took)
        trace.columns.rows()
        gc.collect()
        grown = psutil.Process().memory_info().rss - rss_before
        channel.send(range(ranks), RunRequest(id=0, steps=-1))  # the helpers stop
    finally:
        for helper in helpers:
            helper.join(30)
            if helper.is_alive():
                helper.kill()
        channel.close()
    t0 = time.perf_counter()
    evidence = Evidence(
        records=trace.records, columns=trace.columns, names=tuple(p.name for p in params), jobs=jobs
    )
    findings = all_findings(run_checks(evidence, registered()))
    doctor = time.perf_counter() - t0
    skip = steps // 10  # first steps: connections and caches warm up
    return {
        "wall_ms": statistics.median(walls[skip:]) * 1e3,
        "wall_q": [q * 1e3 for q in statistics.quantiles(walls[skip:], n=4)],
        "cpu_ms": statistics.median(cpus[skip:]) * 1e3,
        "ingest_us": statistics.median(ingest[skip:]) / ranks * 1e6,
        "doctor_s": doctor,
        "named": named(findings, planted),
        "bytes_per_record": grown / (ranks * steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--per-host", type=int, default=8, help="ranks per host behind a relay (default 8)"
    )
    args = parser.parse_args()
    print(
        f"one step of every fake rank at a time, {args.steps} steps, fake ranks in {HELPERS} "
        "processes (medians after the first tenth of the steps); each size straight to the "
        f"notebook, then through a relay per host of {args.per_host} ranks"
    )
    for ranks in args.ranks:
        target = 1.0 + 0.005 * ranks
        walls = {}
        for per_host in (0, args.per_host):
            m = measure(ranks, args.steps, per_host)
            walls[per_host] = m["wall_ms"]
            q1, _, q3 = m["wall_q"]
            how = f"relayed ({ranks // per_host} hosts)" if per_host else "straight"
            print(
                f"{ranks} ranks, {how}: step {m['wall_ms']:.1f} ms (IQR {q1:.1f}-{q3:.1f}; "
                f"target {target:.1f} ms, {m['wall_ms'] / target:.1f}x), notebook CPU "
                f"{m['cpu_ms']:.1f} ms a step, decode and store {m['ingest_us']:.1f} us per "
                f"rank-record (target 10), notebook memory {m['bytes_per_record']:.0f} B per "
                f"rank-record; doctor over the trace {m['doctor_s']:.2f} s, planted problems "
                "named: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in m["named"].items())
            )
        print(f"{ranks} ranks: relayed / straight step time {walls[args.per_host] / walls[0]:.2f}x")


if __name__ == "__main__":
    main()

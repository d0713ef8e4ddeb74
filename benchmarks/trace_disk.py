"""Run folder size and speed: step records as packed rows and Parquet (format 3) against JSON lines.

    python benchmarks/trace_disk.py                  # 8 and 64 ranks x 1,000 steps
    python benchmarks/trace_disk.py --ranks 512 --steps 200

Records are doctor_scale.py's simulated data-parallel job (every rank reads its own 8
samples a step, replicas share their fingerprints, times and memory carry noise), written
in runs of 10 steps as a trace flushes them. Side by side: dtlab's way (each rank's frame of
packed rows, as agent/stepping.py sends it, taken in by Trace.add_packed and written as
Parquet parts) and format 1's (one JSON line per record, decoded into a StepRecord, kept,
appended to steps.jsonl). Reports bytes per rank-step on disk, the time to take each
record in (decode, keep, write: what the notebook does as steps arrive) and to load it
back, per rank-step, and the ratios (the target in issue 20: <= 300 B per rank-step at
data-parallel degree >= 8).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doctor_scale import job, simulate  # noqa: E402

from dtlab.control.run_folder_writer import FolderWriter  # noqa: E402
from dtlab.records import step_record_from_dict, step_record_to_dict  # noqa: E402
from dtlab.records.packed import pack  # noqa: E402
from dtlab.records.trace import Trace  # noqa: E402

RUN = 10  # steps per run (one flush each)


def measure(ranks: int, steps: int) -> dict:
    import pandas  # noqa: F401  # pyarrow imports it on first use: seconds, once (a notebook has it)
    import pyarrow.parquet  # noqa: F401

    records, params, _, _ = simulate(ranks, steps)
    jobs = {r: job(r, params) for r in records}
    # as the ranks send them, a frame per rank and run; and format 1's JSON line per record
    frames = {
        r: [pack(r, recs[start : start + RUN]).to_bytes() for start in range(0, steps, RUN)]
        for r, recs in records.items()
    }
    lines = {
        r: [json.dumps(step_record_to_dict(r, rec)) for rec in recs] for r, recs in records.items()
    }
    n = ranks * steps

    def store(folder: Path | None) -> float:
        """Seconds to take every record in as the notebook does (decode, keep, write), in
        runs of RUN steps; without a folder, format 1: each line decoded, appended to
        steps.jsonl."""
        t0 = time.perf_counter()
        trace = Trace(jobs, sink=FolderWriter(folder) if folder is not None else None)
        out = None if folder is not None else open(Path(tmp) / "steps.jsonl", "w")  # noqa: SIM115
        for start in range(0, steps, RUN):
            for rank in records:
                if out is None:
                    trace.add_packed(rank, frames[rank][start // RUN])
                    continue
                chunk = lines[rank][start : start + RUN]
                trace.add(rank, [step_record_from_dict(json.loads(line))[1] for line in chunk])
                out.write("".join(line + "\n" for line in chunk))
            trace.flush()
            if out is not None:
                out.flush()
        trace.close()
        if out is not None:
            out.close()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        write = store(folder)
        parquet = sum(p.stat().st_size for p in (folder / "steps").iterdir())
        t0 = time.perf_counter()
        loaded = Trace.load(folder)
        loaded.columns.rows()
        load = time.perf_counter() - t0
        assert len(loaded) == n, (len(loaded), n)
        assert list(loaded.records[ranks - 1]) == records[ranks - 1]  # made when read
        json_write = store(None)
        jsonl = (Path(tmp) / "steps.jsonl").stat().st_size
    return {
        "parquet_b": parquet / n,
        "jsonl_b": jsonl / n,
        "write_us": write / n * 1e6,
        "json_write_us": json_write / n * 1e6,
        "load_us": load / n * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"step records on disk, simulated data-parallel job, {args.steps} steps, runs of {RUN}")
    for ranks in args.ranks:
        m = measure(ranks, args.steps)
        print(
            f"{ranks} ranks: Parquet {m['parquet_b']:.0f} B per rank-step vs JSON lines "
            f"{m['jsonl_b']:.0f} B ({m['jsonl_b'] / m['parquet_b']:.1f}x smaller); taken in "
            f"(decoded, kept, written) at {m['write_us']:.1f} us per rank-step (JSON lines "
            f"{m['json_write_us']:.1f} us, {m['write_us'] / m['json_write_us']:.2f}x); "
            f"loaded back at {m['load_us']:.1f} us"
        )


if __name__ == "__main__":
    main()

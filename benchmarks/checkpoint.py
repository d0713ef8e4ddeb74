"""Checkpoint save and load time of dtlab, side by side with DCP alone and plain torch.save.

    python benchmarks/checkpoint.py                           # 100e6 params (1.2 GB), 4 ranks
    python benchmarks/checkpoint.py --params 2e6 --repeats 1  # a quick check
    python benchmarks/checkpoint.py --s3                      # also dtlab to a bucket
    python benchmarks/checkpoint.py --s3 s3://bucket/prefix   # ... a real one (AWS_* vars)

Starts its own ranks (torch.multiprocessing spawn, gloo on 127.0.0.1, one thread each) and
builds one job on every rank: a stack of ``nn.Linear`` layers of about --params parameters
in DDP, AdamW after one step (so its state exists), attached with ``dtlab.agent.attach.attach``.
On that same state, each repeat runs the three methods in turn (the order rotates, so drift
hits all), each save followed by zeroing the state and loading it back:

- dtlab: ``dtlab.agent.checkpoint.save`` / ``dtlab.agent.restore.load`` (DCP underneath,
  plus per-rank extras, fsync, checksum of every file, manifest, verified load);
- DCP alone: ``dcp.save`` (FileSystemWriter, sync_files=True) / ``dcp.load`` in place, of
  the same ``{"model": state_dict, "optim": optimizer tensors by parameter name}``;
- torch.save: rank 0 writes model + optimizer ``state_dict()`` to one file and fsyncs it;
  every rank ``torch.load``s it (weights_only, map_location cpu) and applies it.

A clock runs on rank 0 between barriers on all ranks. MB/s = bytes of the full (replicated)
state (model + optimizer tensors) / seconds, the same bytes for all three. Checkpoints go
to a temp folder under /tmp and are deleted between repeats; nothing is dropped from the
page cache, so these are page-cache write and read speeds of this machine. Also measured
apart for dtlab: re-reading and checksumming each rank's own files (what a save avoids by
checksumming while it writes; share of the save time).
- with ``--s3``: dtlab to a bucket (``dtlab.control.object_store``, what
  ``dt.checkpoint_root = "s3://..."`` does): the same save into a local staging folder, then
  rank 0 uploads it (hashing every file, manifest last); the load fetches it back into a
  local folder (every object size- and checksum-checked) on rank 0, then every rank loads
  it. Without a URL a moto S3 server on loopback (its own process) is the bucket: that
  measures dtlab's and the S3 protocol's cost on this machine, not a network's. Then the
  demo job on a dtlab session: ``dt.checkpoint()``/``dt.load_checkpoint`` to a local root,
  to the bucket, and to a local root mirrored to the bucket (``dt.checkpoint_mirror``),
  side by side, with 5 steps right after each save (a mirror copies while they run) and
  the time until the mirror's copy is in the bucket.
Ratios are dtlab / other: 1.50x means dtlab takes 50% longer. Medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
METHODS = ("dtlab", "dcp", "torch.save")
LABELS = {
    "dtlab": "dtlab save/load",
    "dtlab+s3": "dtlab to a bucket",
    "dcp": "DCP alone",
    "torch.save": "torch.save (rank 0)",
}


# --- on every rank --------------------------------------------------------------------
def build_job(num_params: float, width: int):
    """The attached job: Linear stack in DDP, AdamW stepped once, MSE on a small loader."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    from dtlab.agent import job as jobs
    from dtlab.agent.attach import attach

    torch.manual_seed(0)
    num_layers = max(1, round(num_params / (width * width + width)))
    model = DDP(torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(num_layers))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = DataLoader(TensorDataset(torch.randn(32, width), torch.randn(32, width)), batch_size=8)

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    attach(model, optimizer, data, loss_fn, record=False)
    jobs.current().step()
    return jobs.current()


def state_tensors(job) -> dict:
    """``{"model": ..., "optim": {param name: {key: tensor}}}``, the live tensors."""
    names = {id(p): n for n, p in job.module.named_parameters()}
    state = job.optimizer.state  # in parameter order: load_state_dict rebuilds this dict
    params = [p for g in job.optimizer.param_groups for p in g["params"] if p in state]
    optim = {names[id(p)]: dict(state[p]) for p in params}
    return {"model": dict(job.module.state_dict()), "optim": optim}


def _flat(job) -> list:
    state = state_tensors(job)
    return [*state["model"].values(), *(t for s in state["optim"].values() for t in s.values())]


def signature(job) -> list[float]:
    import torch

    return [float(t.sum(dtype=torch.float64)) for t in _flat(job)]


def zero_state(job) -> None:
    """So a load that restores nothing is caught: the check after it compares signatures."""
    import torch

    with torch.no_grad():
        for t in _flat(job):
            t.zero_()


def timed(fn) -> tuple[float, object]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


def all_true(ok: bool) -> bool:
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_dtlab(job, folder: Path, token: str, rank: int) -> dict:
    from dtlab.agent import checkpoint, restore
    from dtlab.records.checkpoints import file_checksum, read_manifest

    save_s, info = timed(lambda: checkpoint.save(str(folder), token))
    path = Path(info["path"])
    mine = [e["name"] for e in read_manifest(path)["files"] if e["rank"] == rank]
    crc_s, _ = timed(lambda: [file_checksum(path / name) for name in mine])
    zero_state(job)
    load_s, result = timed(lambda: restore.load(str(path)))
    return {"save_s": save_s, "load_s": load_s, "crc_s": crc_s, "notes": result["notes"]}


def run_dcp(job, folder: Path, token: str, rank: int) -> dict:
    import torch.distributed.checkpoint as dcp

    def save():
        writer = dcp.FileSystemWriter(str(folder), sync_files=True)
        dcp.save(state_tensors(job), storage_writer=writer)

    save_s, _ = timed(save)
    zero_state(job)
    reader = dcp.FileSystemReader(str(folder))
    load_s, _ = timed(lambda: dcp.load(state_tensors(job), storage_reader=reader))
    return {"save_s": save_s, "load_s": load_s}


def run_torch_save(job, folder: Path, token: str, rank: int) -> dict:
    import torch

    path = folder / "checkpoint.pt"

    def save():
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"model": job.module.state_dict(), "optim": job.optimizer.state_dict()}
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

    def load():
        state = torch.load(path, map_location="cpu", weights_only=True)
        job.module.load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optim"])

    save_s, _ = timed(save)
    zero_state(job)
    load_s, _ = timed(load)
    return {"save_s": save_s, "load_s": load_s}


def run_dtlab_s3(job, folder: Path, token: str, rank: int, url: str) -> dict:
    """dtlab's save, uploaded by rank 0; fetched back by rank 0, loaded by every rank."""
    import torch.distributed as dist

    from dtlab.agent import checkpoint, restore
    from dtlab.control.object_store import Bucket

    bucket = Bucket(f"{url}/{token}", folder / "fetched")
    uploaded: dict = {}

    def save():
        info = checkpoint.save(str(folder), token)
        if rank == 0:
            uploaded["info"] = bucket.upload(Path(info["path"]), info["step"])
            shutil.rmtree(info["path"])  # the bucket holds it now, as dt.checkpoint leaves it
        return info

    save_s, info = timed(save)
    zero_state(job)
    path = bucket.fetched / f"step-{info['step']:07d}"

    def load():
        if rank == 0:
            bucket.fetch(uploaded["info"])
        dist.barrier()
        return restore.load(str(path))

    load_s, result = timed(load)
    if rank == 0:
        bucket.remove(uploaded["info"])
    return {"save_s": save_s, "load_s": load_s, "notes": result["notes"]}


RUNNERS = {
    "dtlab": run_dtlab,
    "dtlab+s3": run_dtlab_s3,
    "dcp": run_dcp,
    "torch.save": run_torch_save,
}


def worker(rank: int, world: int, port: int, root: str, args: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import torch.distributed.checkpoint  # noqa: F401  imported here, not in a timed save

    from dtlab.agent import restore  # noqa: F401
    from dtlab.agent.stepping import control_group

    job = build_job(args["params"], args["width"])
    control_group()  # dtlab's gloo group is made on first use: not inside a timed save
    expected = signature(job)
    methods = METHODS + (("dtlab+s3",) if args.get("s3_url") else ())
    runs: dict = {m: [] for m in methods}
    for repeat in range(args["repeats"]):
        shift = repeat % len(methods)
        order = methods[shift:] + methods[:shift]
        for method in order:
            folder = Path(root) / method.replace(".", "_").replace("+", "_")
            extra = (args["s3_url"],) if method == "dtlab+s3" else ()
            out = RUNNERS[method](job, folder, f"r{repeat}", rank, *extra)
            out["restored"] = all_true(signature(job) == expected)
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
                runs[method].append(out)
                print(
                    f"  run {repeat + 1}/{args['repeats']} {method}: save {out['save_s']:.2f} s,"
                    f" load {out['load_s']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
            dist.barrier()
    if rank == 0:
        state_bytes = sum(t.numel() * t.element_size() for t in _flat(job))
        num_params = sum(p.numel() for p in job.module.parameters())
        result = {"state_bytes": state_bytes, "num_params": num_params, "runs": runs}
        (Path(root) / "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ranks: int, root: str, args: dict, timeout_s: float) -> dict:
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker,
        args=(ranks, free_port(), root, args),
        nprocs=ranks,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):  # raises, ending the others, if a rank fails
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not finish within {timeout_s:g} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return json.loads((Path(root) / "result.json").read_text())


def summarize(result: dict) -> dict:
    mb = result["state_bytes"] / 1e6
    summary = {}
    for method, runs in result["runs"].items():
        save, load = (statistics.median(r[k] for r in runs) for k in ("save_s", "load_s"))
        restored = all(r["restored"] for r in runs)
        summary[method] = {
            "save_s": save,
            "load_s": load,
            "save_mb_s": mb / save,
            "load_mb_s": mb / load,
            "restored": restored,
        }
    ours = summary["dtlab"]
    for row in summary.values():
        row["dtlab_over_save"] = ours["save_s"] / row["save_s"]
        row["dtlab_over_load"] = ours["load_s"] / row["load_s"]
    for key in ("crc_s",):
        share = statistics.median(r[key] for r in result["runs"]["dtlab"]) / ours["save_s"]
        ours[key.replace("_s", "_share_of_save")] = share
    return summary


def report(summary: dict, result: dict, args: argparse.Namespace) -> str:
    lines = [
        "| method | save s | save MB/s | load s | load MB/s | dtlab / this, save "
        "| dtlab / this, load | state restored |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, r in summary.items():
        lines.append(
            f"| {LABELS[method]} | {r['save_s']:.2f} | {r['save_mb_s']:.0f} | {r['load_s']:.2f} "
            f"| {r['load_mb_s']:.0f} | {r['dtlab_over_save']:.2f}x | {r['dtlab_over_load']:.2f}x "
            f"| {'yes' if r['restored'] else 'NO'} |"
        )
    ours = summary["dtlab"]
    notes = set(n for r in result["runs"]["dtlab"] for n in r["notes"])
    lines += [
        "",
        f"- {args.ranks} ranks (gloo, 1 thread each) on {os.cpu_count()} CPUs; "
        f"{result['num_params'] / 1e6:.1f}M parameters, state {result['state_bytes'] / 1e6:.0f}"
        f" MB (model + AdamW tensors); medians of {args.repeats} repeats.",
        "- Page cache not dropped: these are page-cache write/read speeds on this machine.",
        "- DCP alone loads in place; dtlab checks every file's size and checksum first, then "
        "loads in place; torch.save: rank 0 writes, every rank reads the one file.",
        f"- dtlab: re-reading and checksumming each rank's files would be "
        f"{ours['crc_share_of_save']:.0%} of the save time (timed apart; a save checksums "
        "while it writes; a load checks every file once, shared out across ranks).",
    ]
    if notes:
        lines.append(f"- dtlab load notes: {sorted(notes)}")
    if "dtlab+s3" in summary:
        where = "a moto S3 server on loopback" if args.s3 == "moto" else "the bucket given"
        lines.append(
            f"- dtlab to a bucket: {where}; save = the local save + rank 0's upload (manifest "
            "last), load = rank 0's verified fetch + every rank's load."
        )
    return "\n".join(lines)


def demo_side_by_side(ranks: int, url: str, repeats: int) -> dict:
    """The demo job on a dtlab session: ``dt.checkpoint()`` and ``dt.load_checkpoint`` to a
    local root, to the bucket, and to a local root mirrored to the bucket, alternately;
    then 5 steps right after the save (while a mirror copies it); medians in seconds,
    with their range. ``mirror_s``: from the save's start until the copy is in the bucket."""
    import dtlab
    from dtlab import demo

    session = dtlab.launch(ranks, progress=lambda *a: None)
    local = Path(tempfile.mkdtemp(prefix="dtlab-ckpt-bench-demo-", dir="/tmp"))
    wheres = ("local", "bucket", "local + mirror")
    times: dict = {w: {"save_s": [], "load_s": [], "steps_s": []} for w in wheres}
    times["local + mirror"]["mirror_s"] = []
    try:
        demo.attach(session)
        session.step(2)
        for repeat in range(repeats):
            for where in wheres:
                session.checkpoint_mirror = None
                session.checkpoint_root = (
                    f"{url}/demo-{repeat}" if where == "bucket" else local / f"{repeat}-{where}"
                )
                if where == "local + mirror":
                    session.checkpoint_mirror = f"{url}/mirror-{repeat}"
                start = time.perf_counter()
                saved = session.checkpoint()
                times[where]["save_s"].append(time.perf_counter() - start)
                begun = time.perf_counter()
                session.step(5)  # a mirror copies meanwhile
                times[where]["steps_s"].append(time.perf_counter() - begun)
                if where == "local + mirror":
                    session.mirror.wait(timeout=600)
                    times[where]["mirror_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                session.load_checkpoint(saved.step)
                times[where]["load_s"].append(time.perf_counter() - start)
                size = saved.size_bytes
    finally:
        session.checkpoint_mirror = None
        session.shutdown()
        shutil.rmtree(local, ignore_errors=True)
    out = {
        w: {k: (statistics.median(v), min(v), max(v)) for k, v in t.items()}
        for w, t in times.items()
    }
    return {"bytes": size, "repeats": repeats, **out}


def demo_report(demo: dict) -> str:
    mb = demo["bytes"] / 1e6

    def cell(t: tuple) -> str:
        return f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"

    lines = [
        "",
        f"The demo job (dt.checkpoint() / 5 dt.step() / dt.load_checkpoint(), {mb:.1f} MB "
        f"checkpoint; medians of {demo['repeats']}, range):",
        "",
        "| root | save s | 5 steps after it, s | until in the bucket, s | load s |",
        "|---|---|---|---|---|",
    ]
    for where in ("local", "bucket", "local + mirror"):
        d = demo[where]
        copied = cell(d["mirror_s"]) if "mirror_s" in d else "-"
        lines.append(
            f"| {where} | {cell(d['save_s'])} | {cell(d['steps_s'])} | {copied} | "
            f"{cell(d['load_s'])} |"
        )
    return "\n".join(lines)


def start_moto() -> tuple[object, str]:
    """moto's S3 server on a free loopback port, in its own process, with a bucket."""
    import subprocess

    import boto3

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    boto3.client("s3").create_bucket(Bucket="bench")
    return proc, "s3://bench/checkpoints"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="model parameters (about)")
    parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800, help="for the whole run, s")
    parser.add_argument("--json", help="where to write results (default benchmarks/results/)")
    parser.add_argument(
        "--s3",
        nargs="?",
        const="moto",
        default=None,
        metavar="URL",
        help="also dtlab to a bucket: s3://bucket/prefix (AWS_* variables), or none: moto",
    )
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dtlab-ckpt-bench-", dir="/tmp")
    moto = None
    try:
        if args.s3 == "moto":
            moto, args.s3_url = start_moto()
        else:
            args.s3_url = args.s3
        result = spawn(args.ranks, root, vars(args), args.timeout)
        if args.s3_url:
            result["demo"] = demo_side_by_side(args.ranks, args.s3_url, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if moto is not None:
            moto.kill()  # type: ignore[attr-defined]
            moto.wait()  # type: ignore[attr-defined]
    summary = summarize(result)
    print(report(summary, result, args))
    if "demo" in result:
        print(demo_report(result["demo"]))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.json or HERE.parent / "results" / f"checkpoint-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, **result}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Per-rank memory of the model states under DDP, DeepSpeed ZeRO-1/2/3, FSDP1 and FSDP2.

    python benchmarks/memory_by_strategy.py                       # 4 ranks, all six strategies
    python benchmarks/memory_by_strategy.py --steps 3 --json memory.json
    python benchmarks/memory_by_strategy.py --config default --strategies ddp zero3

The same model, optimizer and data under each strategy, one ``torchrun --standalone
--nproc-per-node 4`` per strategy (gloo on CPU, ``OMP_NUM_THREADS=1``), launched one after
the other by this script, so the whole table comes from one command:

- DDP: ``DistributedDataParallel``; every rank holds everything.
- ZeRO-1, ZeRO-2, ZeRO-3: ``deepspeed.initialize`` with ``zero_optimization.stage`` 1/2/3,
  DeepSpeed's defaults otherwise (bucket sizes, ``stage3_param_persistence_threshold``).
- FSDP1: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FULL_SHARD, flat parameters),
  each block its own unit, then the root.
- FSDP2: ``torch.distributed.fsdp.fully_shard`` on each block, then the root.

The model is dtlab's demo LM (dtlab/agent/demo_model.py) in a bigger, dense configuration
(``--config big``, the default: dim 256, 4 blocks, a 4,096-token vocabulary, 5.5M
parameters, 21 MiB in fp32), so the model states stand out of the few hundred MiB a rank holds for
torch itself; ``--config default`` is the demo's own (271k parameters, also dense). Dense:
``moe_layer=-1``, because ZeRO-3 gathers each submodule's parameters when it runs, and a
routed expert that gets no token on one rank would leave the other ranks waiting in its
all-gather. AdamW, fp32 throughout (DeepSpeed refuses fp16 on CPU), micro-batch 8.

Each rank runs --steps steps (forward, backward, optimizer step) and measures once, on
the last step, after the backward (DeepSpeed's ``engine.backward``, which ends with its
gradient reduction) and before the optimizer step: the optimizer state exists from the
previous steps, the gradients are the ones the step will use. Bytes actually held: every
tensor is counted by the byte range it covers in its storage, and ranges shared by several
tensors (views into one flat buffer) are counted once. The columns:

- params: the parameter bytes this rank holds. DDP: the full model. FSDP1: the local shard
  of each FlatParameter (padded to a multiple of the world size). FSDP2: each DTensor's
  local shard. ZeRO-1/2: the flat buffer the model's parameters are views into (all of the
  model, on every rank) plus the fp32 master copy of this rank's partition that DeepSpeed
  keeps for its optimizer (``optimizer.single_partition_of_fp32_groups``; a clone even when
  the model is fp32). ZeRO-3: the partitions (``param.ds_tensor``, in
  ``optimizer.fp16_partitioned_groups_flat``), the fp32 master copy of them
  (``optimizer.fp32_partitioned_groups_flat``: also a clone here; the shortcut meant to
  share the buffer when the model is fp32 compares a torch.device with the device's name as
  a string, which is never equal), plus every parameter still gathered at that moment
  (``param.data`` not empty): those below ``stage3_param_persistence_threshold`` (1e5
  elements) stay whole on every rank. The JSON splits DeepSpeed's params into
  ``params_model`` (the model's own tensors), ``params_partition`` and ``params_master``.
- grads: the gradient bytes held for the step. DDP, FSDP1, FSDP2: each parameter's
  ``.grad`` (FSDP: the reduce-scattered local shard). DeepSpeed clears ``.grad`` and keeps
  its own: ZeRO-1/2 ``optimizer.averaged_gradients`` (views into its gradient partition)
  and anything left in ``.grad``, ``.grad_accum``, ``optimizer.grads_in_partition`` or the
  master partition's ``.grad``; ZeRO-3 ``optimizer.grad_partitions_flat_buffer`` (this
  rank's partition of every gradient, allocated once and kept) and anything in ``.grad``.
  ZeRO-1 and ZeRO-2 hold the same here: DeepSpeed's stage 1 also keeps only its partition
  once the backward has ended; it differs from stage 2 during the backward (see below).
- optimizer state: the tensors in the (inner) torch optimizer's ``state``: exp_avg and
  exp_avg_sq (and the scalar ``step``), of the whole model (DDP) or of this rank's partition
  (the rest; FSDP2's are DTensors, counted by their local shard).
- total model state: params + grads + optimizer state. vs DDP: its median over that of DDP.
- RSS: resident set size of the rank's process at the same moment; peak RSS: its maximum
  over the run (``ru_maxrss``). Both include torch itself (a few hundred MiB) and everything
  the columns leave out.

Not counted in the model-state columns (RSS has them): communication buffers, i.e. DDP's
gradient buckets (a second copy of the gradients unless ``gradient_as_bucket_view``),
DeepSpeed's reduce buckets (``ipg_buckets``, ``torch.empty(reduce_bucket_size)``: 5e8
elements reserved, resident only as far as written; their size is in the JSON as
``ds_buffer_reserved``) and all-gather buffers; the transient full-size gradients during a
backward (ZeRO-1 reduces only at the end of the backward, ZeRO-2 bucket by bucket during
it, FSDP reduce-scatters unit by unit) and the gathered parameters of an FSDP unit or a
ZeRO-3 module while it runs; activations; allocator caches. The JSON also has, for
DeepSpeed, ``ds_other``: the bytes of any other tensor reachable from DeepSpeed's optimizer
object that none of the columns counted (bucket buffers by their written range).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def python() -> str:
    """This interpreter, reached through the virtual environment's real path: DeepSpeed
    builds its shared-memory op with its own path in the compiler flags, so launching it
    through a symlinked venv would rebuild the op (minutes) and thrash the shared cache."""
    real = Path(sys.prefix).resolve() / "bin" / Path(sys.executable).name
    return str(real) if sys.prefix != sys.base_prefix and real.exists() else sys.executable


TORCHRUN = [python(), "-m", "torch.distributed.run"]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp1", "fsdp2")
LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "fsdp1": "FSDP1",
    "fsdp2": "FSDP2",
}
CONFIGS = {
    # dense (no MoE block): see the docstring
    "big": {"dim": 256, "num_layers": 4, "vocab_size": 4096, "expert_dim": 256, "moe_layer": -1},
    "default": {"moe_layer": -1},
}
LR = 3e-3
MIB = 2**20


# --- on each rank ---------------------------------------------------------------------------
def optimizer_state_tensors(optimizer):
    for state in optimizer.state.values():
        yield from state.values()


def walk_tensors(obj, seen: set[int], depth: int = 0):
    """Tensors reachable from ``obj`` through attributes, lists, tuples and dicts of
    DeepSpeed's own objects (not into torch modules or optimizers)."""
    import torch

    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        grad = obj.grad if obj.is_leaf else None
        if grad is not None:
            yield grad
        return
    if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, list | tuple | set):
        children = list(obj)
    elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from walk_tensors(child, seen, depth + 1)


def measure_deepspeed(engine, stage: int) -> dict:
    """Bytes held by a DeepSpeed engine (see the module docstring), counted as dtlab's step
    records count them (``dtlab.agent.deepspeed_observe.model_state``), with the parameter
    bytes also split into the model's own tensors, this rank's partition and the fp32
    master copy, each less what the ones before it already counted."""
    from dtlab.agent.deepspeed_observe import Held, model_state

    state = model_state(engine)
    model, partition, params = state.model, state.partition, state.params()
    extra = {}
    if stage == 3:
        model_params = list(engine.module.parameters())
        persistent = [p for p in model_params if getattr(p, "ds_persist", False)]
        extra["zero3_persistent_params"] = sum(p.ds_numel for p in persistent)
        extra["zero3_gathered_params"] = sum(p.numel() for p in model_params)
    extra["ds_buffer_reserved"] = sum(t.nbytes for t in state.buffers)
    extra["params_model"] = model.nbytes()
    extra["params_partition"] = partition.nbytes(minus=model)
    extra["params_master"] = params.nbytes() - extra["params_model"] - extra["params_partition"]
    counted, skip = Held(), Held()
    counted.merge(params, state.grads, state.optimizer)
    skip.add_all(state.buffers)
    skip.merge(counted)
    other = Held()
    other.add_all(walk_tensors(engine.optimizer, set()))
    extra["ds_other"] = other.nbytes(minus=skip)
    param_bytes, grad_bytes, optimizer_bytes = state.nbytes()
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes, **extra}


def measure_torch(model, optimizer) -> dict:
    from dtlab.agent.deepspeed_observe import Held

    params, grads, state = Held(), Held(), Held()
    for p in model.parameters():
        params.add(p)
        grads.add(p.grad)
    state.add_all(optimizer_state_tensors(optimizer))
    return {"params": params.nbytes(), "grads": grads.nbytes(), "optimizer": state.nbytes()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(strategy: str, steps: int, config_name: str, out: Path) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dtlab.agent.demo_model import Block, DemoConfig, DemoLM, SyntheticTokens, demo_loss

    torch.set_num_threads(1)
    deepspeed_stage = int(strategy[-1]) if strategy.startswith("zero") else 0
    if deepspeed_stage:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = DemoConfig(**CONFIGS[config_name])
    torch.manual_seed(config.seed)  # every rank builds identical weights
    model = DemoLM(config)
    numel = sum(p.numel() for p in model.parameters())
    engine = None
    if deepspeed_stage:
        ds_config = {
            "train_micro_batch_size_per_gpu": config.batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": deepspeed_stage},
        }
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
            config=ds_config,
        )
        model = engine
    elif strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
    elif strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = None if engine else torch.optim.AdamW(model.parameters(), lr=LR)
    dataset = SyntheticTokens(config)
    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=config.seed, drop_last=True
    )
    data = iter(DataLoader(dataset, batch_size=config.batch_size, sampler=sampler))
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        batch = next(data)
        loss = demo_loss(model, batch)
        if engine:
            engine.backward(loss)
        else:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if step == steps - 1:  # gradients held, optimizer state from the steps before
            if engine:
                memory = measure_deepspeed(engine, deepspeed_stage)
            else:
                memory = measure_torch(model, optimizer)
            memory["rss"] = rss_bytes()
        engine.step() if engine else optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    memory["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "rank": rank,
        "numel": numel,
        "memory": memory,
        "losses": losses,
        "step_s": statistics.median(times),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ------------------------------------------------------------------------------
def run_strategy(strategy: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"membench-{strategy}-") as tmp:
        cmd = [
            *TORCHRUN,
            "--standalone",
            f"--nproc-per-node={args.ranks}",
            str(HERE),
            "--role",
            "worker",
            "--strategy",
            strategy,
            "--steps",
            str(args.steps),
            "--config",
            args.config,
            "--out",
            tmp,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{strategy} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    ranks.sort(key=lambda r: r["rank"])
    if len(ranks) != args.ranks:
        raise RuntimeError(f"{strategy}: {len(ranks)} of {args.ranks} ranks reported")
    per_rank = [r["memory"] for r in ranks]
    for m in per_rank:
        m["total"] = m["params"] + m["grads"] + m["optimizer"]
    return {
        "strategy": LABELS[strategy],
        "numel": ranks[0]["numel"],
        "per_rank": per_rank,
        "median": {k: statistics.median(m[k] for m in per_rank) for k in per_rank[0]},
        "last_loss": [r["losses"][-1] for r in ranks],
        "losses_rank0": ranks[0]["losses"],
        "step_s": statistics.median(r["step_s"] for r in ranks),
        "wall_s": wall,
    }


def machine() -> dict:
    import torch

    try:
        from importlib.metadata import version

        deepspeed_version = version("deepspeed")
    except Exception:  # noqa: BLE001
        deepspeed_version = "not installed"
    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed_version,
    }


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def report(results: list[dict], info: dict, args) -> str:
    numel = results[0]["numel"]
    full = numel * 4
    ddp = next((r for r in results if r["strategy"] == "DDP"), None)
    lines = [
        f"{info['cpus']} CPUs ({info['processor']}), torch {info['torch']}, deepspeed "
        f"{info['deepspeed']}, Python {info['python']}; {args.ranks} ranks, gloo, 1 thread "
        f"each; {args.steps} steps per strategy",
        f"model: demo LM, config {args.config!r} {CONFIGS[args.config]}: {numel:,} parameters, "
        f"P = {mib(full)} MiB in fp32; AdamW, fp32, micro-batch 8",
        "",
        "MiB per rank, median over ranks (in units of P in brackets)",
        "",
        "| strategy | params | grads | optimizer state | total model state | vs DDP "
        "| RSS | peak RSS | total per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["median"]
        ratio = f"{m['total'] / ddp['median']['total']:.2f}x" if ddp else "-"
        totals = " / ".join(mib(x["total"]) for x in r["per_rank"])
        cells = [
            f"{mib(m[k])} ({m[k] / full:.2f})" for k in ("params", "grads", "optimizer", "total")
        ]
        lines.append(
            f"| {r['strategy']} | {' | '.join(cells)} | {ratio} | {m['rss'] / MIB:.0f} "
            f"| {m['peak_rss'] / MIB:.0f} | {totals} |"
        )
    lines.append("")
    for r in results:
        notes = [f"loss at the last step {statistics.median(r['last_loss']):.4f}"]
        m = r["median"]
        if "params_master" in m:
            notes.append(
                f"params = model tensors {mib(m['params_model'])} + partition "
                f"{mib(m['params_partition'])} + fp32 master {mib(m['params_master'])} MiB"
            )
        if "ds_buffer_reserved" in m:
            notes.append(
                f"DeepSpeed reduce buckets reserved {mib(m['ds_buffer_reserved'])} MiB "
                f"(resident as written), other DeepSpeed tensors {mib(m['ds_other'])} MiB"
            )
        if "zero3_persistent_params" in m:
            notes.append(
                f"{int(m['zero3_persistent_params']):,} parameters persistent (whole on every "
                f"rank), {int(m['zero3_gathered_params']):,} gathered at the measurement"
            )
        notes.append(f"median step {r['step_s'] * 1e3:.0f} ms, torchrun {r['wall_s']:.0f} s")
        lines.append(f"- {r['strategy']}: " + "; ".join(notes))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps per strategy")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="big")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per strategy")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the optimizer state exists from the second step)")
    if args.role == "worker":
        worker(args.strategy, args.steps, args.config, args.out)
        return
    info = machine()
    start = time.perf_counter()
    results = []
    for strategy in args.strategies:
        print(f"{LABELS[strategy]} ...", file=sys.stderr, flush=True)
        results.append(run_strategy(strategy, args))
    info["wall_s"] = time.perf_counter() - start
    print(report(results, info, args))
    print(f"\n{info['wall_s']:.0f} s in all")
    if args.json:
        payload = {"machine": info, "config": CONFIGS[args.config], "results": results}
        payload["ranks"], payload["steps"] = args.ranks, args.steps
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()

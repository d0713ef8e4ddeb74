"""A DeepSpeed training script in the form DeepSpeed's getting-started tutorial teaches:
``deepspeed.add_config_arguments``, ``deepspeed.init_distributed``, ``deepspeed.initialize``
with a ds_config (ZeRO, accumulation, optimizer and scheduler in the config),
``engine.backward`` / ``engine.step`` once per micro-batch, ``engine.save_checkpoint``
every few steps and ``engine.load_checkpoint`` on a restart. Run unchanged under torchrun
(or the deepspeed launcher) and under dtlab's %dt_script by the tests.

    torchrun --nproc-per-node 4 tests/scripts/ds_zero.py --steps 8 \\
        --deepspeed --deepspeed_config ds_config.json --out losses
"""

import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to make")
    p.add_argument("--out", default=None, help="folder for each rank's micro-batch losses")
    p.add_argument("--save-dir", default=None, help="DeepSpeed checkpoints: saved, resumed")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument(
        "--own-accumulation",
        type=int,
        default=1,
        help="planted bug: the script "
        "also accumulates, calling engine.step() once per this many micro-batches",
    )
    p.add_argument("--odd-rank", type=int, default=-1, help="planted bug: this rank reads...")
    p.add_argument("--odd-config", default=None, help="...this ds_config instead")
    p.add_argument(
        "--resumable-data",
        action="store_true",
        help="after a checkpoint loaded, skip the micro-batches its steps already consumed",
    )
    p.add_argument("--die-rank", type=int, default=-1, help="planted failure: this rank...")
    p.add_argument("--die-at", type=int, default=0, help="...exits at once in this step...")
    p.add_argument("--die-once", default=None, help="...unless this file exists (it makes it)")
    p.add_argument("--inf-rank", type=int, default=-1, help="planted bug: inf loss here...")
    p.add_argument("--inf-from", type=int, default=0, help="...from this optimizer step on")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def batches(loader, skip: int):
    """The loader's batches after the first ``skip``, which are drawn outside autograd
    (passed over, not trained on). One iterator: DeepSpeed's loader starts over at iter()."""
    it = iter(loader)
    with torch.no_grad():
        for _ in range(skip):
            next(it)
    while True:
        try:
            yield next(it)
        except StopIteration:
            return


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if rank == args.odd_rank:
        args.deepspeed_config = args.odd_config
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    if args.save_dir and os.path.isdir(args.save_dir):
        engine.load_checkpoint(args.save_dir)  # an automatic restart picks up from here
    dtype = next(engine.module.parameters()).dtype
    losses, micro, saved = [], 0, engine.global_steps
    # a resumed run (from the script's own load, or dtlab's) goes on where the data was
    skip = engine.global_steps * engine.gradient_accumulation_steps() if args.resumable_data else 0
    while engine.global_steps < args.steps:
        for x, y in batches(loader, skip):
            skip = 0
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            if rank == args.inf_rank and engine.global_steps + 1 >= args.inf_from > 0:
                loss = loss * math.inf
            engine.backward(loss)
            micro += 1
            dying = rank == args.die_rank and engine.global_steps + 1 == args.die_at
            if dying and not (args.die_once and os.path.exists(args.die_once)):
                if args.die_once:
                    open(args.die_once, "w").close()
                os._exit(3)  # as a rank that crashes mid-step (OOM killer, segfault) does
            if micro % args.own_accumulation == 0:
                engine.step()
            losses.append(loss.item())
            if args.save_every and engine.global_steps - saved >= args.save_every:
                engine.save_checkpoint(args.save_dir)
                saved = engine.global_steps
            if engine.global_steps >= args.steps:
                break
    if rank == 0:
        print(f"{engine.global_steps} steps, last loss {losses[-1]:.4f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()

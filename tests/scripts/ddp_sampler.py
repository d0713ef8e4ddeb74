"""A torchrun training script in the form the PyTorch DDP tutorial teaches: argparse,
init_process_group / destroy_process_group, DistributedSampler + DataLoader, gradient
clipping and a learning rate set by hand every iteration. Run unchanged under torchrun
and under dtlab's %dt_script by the tests.

    torchrun --nproc-per-node 4 tests/scripts/ddp_sampler.py --steps 8 --out losses
"""

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--out", default=None, help="folder for each rank's losses (JSON)")
    p.add_argument("--same-data", action="store_true", help="planted bug: no sampler shard")
    p.add_argument("--no-ddp", action="store_true", help="planted bug: model not wrapped")
    p.add_argument("--lr-rank", type=int, default=-1, help="planted bug: this rank's LR x10")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--inf-rank", type=int, default=-1, help="planted bug: inf inputs here...")
    p.add_argument("--inf-step", type=int, default=0, help="...at this step (from 1)")
    return p.parse_args()


def lr_at(step, base, warmup=3):
    return base * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / 100))


def main():
    args = get_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    if args.same_data:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if not args.no_ddp:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            lr = lr_at(step, args.lr) * (10 if rank == args.lr_rank else 1)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            if rank == args.inf_rank and step + 1 == args.inf_step:
                x = x * math.inf  # a corrupt batch (e.g. an unnormalised feature)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

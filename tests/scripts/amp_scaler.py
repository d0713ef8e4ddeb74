"""A mixed-precision script: bfloat16 autocast and a GradScaler, whose skipped steps
(inf/nan gradients) fire no optimizer hook. ``--inf-at N`` plants an overflow at
iteration N on every rank. Run unchanged under torchrun and %dt_script.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--inf-at", type=int, default=-1)
p.add_argument("--out", default="")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
gen = torch.Generator().manual_seed(rank)
record = []
for it in range(args.steps):
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    if it == args.inf_at:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    record.append([loss.item(), scaler.get_scale()])
if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
dist.destroy_process_group()

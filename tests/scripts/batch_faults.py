"""A small DDP torchrun script with faults to plant, for the tests of ``-m dtlab.run``
(tests/test_run_wrapper_live.py): a rank that raises after step K, a rank that stops
stepping at step K (the others wait in DDP's all-reduce: a hang), a rank that sleeps a
while at step K (slow, not hung), a rank with ten times the LR, a rank whose data runs out
after step K (it skips the all-reduces of the steps after and waits in the closing barrier:
a hang), a rank that skips step K's all-reduce of the loss (the others' next collectives
no longer match its: gloo aborts). Knows nothing of dtlab.

    torchrun --standalone --nproc-per-node 2 tests/scripts/batch_faults.py --steps 6
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--lr-rank", type=int, default=-1, help="this rank's LR x10")
p.add_argument("--crash-rank", type=int, default=-1, help="raises once it made --at steps")
p.add_argument("--hang-rank", type=int, default=-1, help="stops stepping after --at steps")
p.add_argument("--sleep-rank", type=int, default=-1, help="sleeps --sleep-s after --at steps")
p.add_argument("--sleep-s", type=float, default=3.0)
p.add_argument("--short-rank", type=int, default=-1, help="its data ends after --at steps")
p.add_argument("--skip-rank", type=int, default=-1, help="skips the loss all-reduce at --at")
p.add_argument("--at", type=int, default=3)
p.add_argument("--exit-code", type=int, default=0, help="sys.exit(code) at the end")
p.add_argument("--out", default="")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
lr = 0.05 * (10 if rank == args.lr_rank else 1)
optimizer = torch.optim.SGD(model.parameters(), lr=lr)
data = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(1, args.steps + 1):
    if step > args.at and rank == args.short_rank:
        break  # its data ran out: the others wait in this step's all-reduce
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if args.skip_rank >= 0 and not (step == args.at and rank == args.skip_rank):
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the mean loss, for the log
    if rank == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    if step == args.at and rank == args.crash_rank:
        raise RuntimeError(f"planted crash on rank {rank} after step {step}")
    if step == args.at and rank == args.sleep_rank:
        time.sleep(args.sleep_s)
    while step == args.at and rank == args.hang_rank:
        time.sleep(0.2)  # never steps again; the other ranks wait in the next all-reduce
if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(losses, f)
dist.barrier()
dist.destroy_process_group()
sys.exit(args.exit_code)

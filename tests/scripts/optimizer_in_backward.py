"""Optimizer in backward, as PyTorch's tutorial on fusing the step into backward writes it:
one optimizer per parameter, stepped (and its gradient dropped) from a gradient hook as
soon as that gradient is ready; data parallel by averaging each gradient in the same hook.

    torchrun --nproc-per-node 4 optimizer_in_backward.py OUT
"""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizers = {p: torch.optim.SGD([p], lr=0.05) for p in model.parameters()}


def step_now(p: torch.Tensor) -> None:
    dist.all_reduce(p.grad)
    p.grad /= world
    optimizers[p].step()
    optimizers[p].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(step_now)

data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples
losses = []
for _ in range(6):
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    losses.append(loss.item())
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(losses, f)
dist.destroy_process_group()

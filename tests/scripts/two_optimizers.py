"""A GAN-style loop: two models, two optimizers, the discriminator's steps first. With
``--explicit`` the script marks its own step boundaries with ``dtlab.step_boundary()``
(a no-op outside dtlab, so it still runs under plain torchrun)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dtlab

explicit = "--explicit" in sys.argv
out = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")), "")
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
gen = DDP(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
disc = DDP(torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3)
noise = torch.Generator().manual_seed(rank)
bce = torch.nn.functional.binary_cross_entropy_with_logits
record = []
for _ in range(5):
    real = torch.randn(8, 2, generator=noise) + 3
    fake = gen(torch.randn(8, 4, generator=noise))
    d_loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(disc(fake), torch.ones(8, 1))
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    record.append([d_loss.item(), g_loss.item()])
    if explicit:
        dtlab.step_boundary()
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
dist.destroy_process_group()

"""A torchrun training script in the form FSDP1 code is still written: the model wrapped
in FullyShardedDataParallel with an auto-wrap policy (one unit per block), optionally
``use_orig_params=True``, AdamW, FSDP's own gradient clipping, DistributedSampler. Run
unchanged under torchrun and under dtlab's %dt_script by the tests.

    torchrun --nproc-per-node 4 tests/scripts/fsdp1_wrap.py --steps 8 --out losses
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int = 24, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(16, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--orig", action="store_true", help="use_orig_params=True")
    p.add_argument("--out", default=None, help="folder for each rank's losses (JSON)")
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = FSDP(
        Net(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=args.orig,
        device_id=torch.device("cpu"),  # FSDP1 wants it said on a CPU-only machine
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            losses.append(loss.item())
            step += 1
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

"""The training loop DeepSpeed's getting-started tutorial teaches, its set-up and loss in
functions that a %%dt cell can call to hand the same engine to ``dtlab.attach``
(tests/test_deepspeed_attach_live.py), and run as a whole under torchrun for the losses to
compare with:

    torchrun --nproc-per-node 4 tests/scripts/ds_attach.py --config ds_config.json \\
        --steps 6 --out losses
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def build(config):
    """The engine and its DeepSpeedDataLoader, from a ds_config (a path or a dict)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine, _, loader, _ = deepspeed.initialize(
        config=config, model=model, model_parameters=model.parameters(), training_data=data
    )
    return engine, loader


def loss_fn(engine, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(engine(x), y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="the ds_config file")
    p.add_argument("--steps", type=int, default=6, help="DeepSpeed updates to make")
    p.add_argument("--out", required=True, help="folder for each rank's micro-batch losses")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    engine, loader = build(args.config)
    losses = []
    while engine.global_steps < args.steps:
        for batch in loader:
            loss = loss_fn(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.global_steps >= args.steps:
                break
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main()

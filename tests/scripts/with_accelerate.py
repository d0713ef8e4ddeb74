"""An accelerate script: ``Accelerator().prepare(...)`` and ``accelerator.backward``, the
loop HF Trainer runs underneath. Run unchanged under torchrun and %dt_script."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1] if len(sys.argv) > 1 else ""
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
losses = []
for step, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    used_lr = optimizer.param_groups[0]["lr"]  # accelerate steps the scheduler per process
    optimizer.step()
    scheduler.step()
    losses.append([loss.item(), used_lr])
    if step == 7:
        break
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(losses, f)
accelerator.end_training()

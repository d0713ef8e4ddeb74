"""A nanoGPT-style script: module-level settings overridden by --key=value arguments,
``from torch.distributed import init_process_group``, random token windows drawn by its
own ``get_batch`` (no DataLoader), gradient accumulation that toggles DDP's
``require_backward_grad_sync`` itself, and nanoGPT's loop: ``while True`` until
``iter_num`` reaches ``max_iters`` (read each iteration, so a changed ``max_iters`` ends
the run there; the LR schedule runs over ``lr_decay_iters``, by default ``max_iters``).
Run unchanged under torchrun, %dt_script and ``-m dtlab.run``.
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

max_iters = 6
grad_accum = 4
batch_size = 4
block_size = 16
vocab = 64
learning_rate = 1e-2
lr_decay_iters = 0  # 0: max_iters
grad_clip = 1.0
out = ""
same_seed = 0  # planted bug: every rank draws the same windows
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals():
        raise ValueError(f"unknown config key {key}")
    globals()[key] = type(globals()[key])(value)
lr_decay_iters = lr_decay_iters or max_iters

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
else:
    rank = 0
# each rank draws its own windows (the model's own seed below must not reset this)
windows = torch.Generator().manual_seed(1337 + (0 if same_seed else rank))
text = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch():
    ix = torch.randint(len(text) - block_size - 1, (batch_size,), generator=windows)
    x = torch.stack([text[i : i + block_size] for i in ix])
    y = torch.stack([text[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.emb = torch.nn.Embedding(vocab, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, vocab)

    def forward(self, x):
        return self.head(torch.relu(self.mix(self.emb(x))))


def get_lr(it):
    return learning_rate * 0.5 * (1 + math.cos(math.pi * it / lr_decay_iters))


model = TinyLM()
if ddp:
    model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
losses = []
X, Y = get_batch()
iter_num = 0
while True:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    total = 0.0
    for micro in range(grad_accum):
        if ddp:  # sync only on the last micro-batch (what nanoGPT does instead of no_sync)
            model.require_backward_grad_sync = micro == grad_accum - 1
        logits = model(X)
        loss = F.cross_entropy(logits.view(-1, vocab), Y.view(-1)) / grad_accum
        X, Y = get_batch()
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(total)
    if rank == 0:
        print(f"iter {iter_num}: loss {total:.4f}")
    iter_num += 1
    if iter_num >= max_iters:
        break
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(losses, f)
if ddp:
    destroy_process_group()

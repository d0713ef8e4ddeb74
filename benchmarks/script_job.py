"""The training script that benchmarks/script_overhead.py runs under torchrun and under
%dt_script: a small transformer language model in DDP, AdamW, random token windows, a
hand-set cosine LR and gradient clipping. It knows nothing of dtlab and times itself:
rank 0 writes the median and the spread of its per-step times (after a warm-up) to --out.

    torchrun --standalone --nproc-per-node 4 benchmarks/script_job.py --steps 40 --out t.json
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--out", default="")
p.add_argument("--batch", type=int, default=8, help="token windows per step and rank")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
vocab, block, width = 256, 64, 128
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(
    torch.nn.Embedding(vocab, width),
    torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
    torch.nn.Linear(width, vocab),
)
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
text = torch.randint(0, vocab, (1 << 16,), generator=torch.Generator().manual_seed(rank))
gen = torch.Generator().manual_seed(100 + rank)
times = []
for it in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    ix = torch.randint(len(text) - block - 1, (args.batch,), generator=gen)
    x = torch.stack([text[i : i + block] for i in ix])
    y = torch.stack([text[i + 1 : i + 1 + block] for i in ix])
    for group in optimizer.param_groups:
        group["lr"] = 3e-4 * 0.5 * (1 + math.cos(math.pi * it / (args.warmup + args.steps)))
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, vocab), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    loss.item()
    if it >= args.warmup:
        times.append(time.perf_counter() - t0)
dist.barrier()
if rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump(
            {
                "median_ms": statistics.median(times) * 1e3,
                "p10_ms": sorted(times)[len(times) // 10] * 1e3,
                "p90_ms": sorted(times)[len(times) * 9 // 10] * 1e3,
                "threads": torch.get_num_threads(),
            },
            f,
        )
dist.destroy_process_group()

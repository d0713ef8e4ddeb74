"""A script whose work is in main() under ``if __name__ == "__main__"`` and that ends
with sys.exit; it also installs a SIGTERM handler (signal.signal works only on the main
thread). ``--fail-at N`` raises at step N on every rank."""

import argparse
import signal
import sys

import torch
import torch.distributed as dist

stopping = False


def on_term(signum, frame):
    global stopping
    stopping = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--code", type=int, default=0)
    p.add_argument("--fail-at", type=int, default=-1)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if step == args.fail_at:
            raise RuntimeError(f"planted failure at step {step}")
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if stopping:
            break
    return args.code


if __name__ == "__main__":
    sys.exit(main())

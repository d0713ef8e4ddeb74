"""A training script in the form people write, whose output is what matters: argparse,
init_process_group("gloo"), a logging handler bound to sys.stdout at set-up, a log line
per step on every rank and a final "Training completed", gc turned off for the run (the
script never turns it back on: its process would end), and the step itself a method of
a Trainer in a module next to it (``out_steps_lib``). ``--tee DIR`` replaces sys.stdout
with a tee into DIR/rank{r}.log first, as some loggers do.

    torchrun --nproc-per-node 4 tests/scripts/out_logging.py --steps 10
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from out_steps_lib import Trainer, init_logger, logger


class Tee:
    """sys.stdout written to a file as well."""

    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "w")  # noqa: SIM115 - lives with the run

    def write(self, text):
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tee", default=None, help="folder for each rank's copy of its stdout")
    args = p.parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    if args.tee:
        sys.stdout = Tee(sys.stdout, os.path.join(args.tee, f"rank{rank}.log"))
    init_logger(rank)
    logger.info(f"set-up: {dist.get_world_size()} ranks, {args.steps} steps")
    trainer = Trainer(rank)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        batch = (
            torch.randn(args.batch_size, 8, generator=data),
            torch.randn(args.batch_size, 1, generator=data),
        )
        trainer.train_step(batch)
    logger.info("Training completed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

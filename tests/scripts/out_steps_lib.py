"""The library half of ``out_logging.py``, a module next to the script as trainers keep
them: its logger set-up (a stdout handler on the root logger, bound once, as torchtitan's
``init_logger``), its garbage-collection handler (automatic gc off, as torchtitan's
``GarbageCollection``) and a ``Trainer`` whose ``train_step`` makes the optimizer step.

Every line it logs or writes starts with ``[out]`` (stdout, through the logger) or
``[err]`` (written to sys.stderr directly), then the rank, so tests can count them."""

import gc
import logging
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

logger = logging.getLogger(__name__)


def init_logger(rank: int) -> None:
    """A handler bound to the sys.stdout of this moment, on the root logger at INFO."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[out] rank {rank} %(name)s: %(message)s"))
    root.addHandler(handler)


class GarbageCollection:
    """Automatic gc off for the run, a collection every ``every`` steps."""

    def __init__(self, every: int = 4):
        self.every = every
        gc.disable()
        gc.set_threshold(100_000, 50, 50)
        gc.collect(1)

    def run(self, step: int) -> None:
        if step % self.every == 0:
            gc.collect(1)


class Trainer:
    def __init__(self, rank: int, seed: int = 0):
        self.rank = rank
        torch.manual_seed(seed)
        self.model = DDP(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.gc = GarbageCollection()
        self.step = 0
        self.losses: list[float] = []

    def train_step(self, batch) -> float:
        self.step += 1
        self.gc.run(self.step)
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        sys.stderr.write(f"[err] rank {self.rank} step {self.step} grad_norm {norm.item():.6f}\n")
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.item())
        logger.info(f"step {self.step} loss {loss.item():.6f}")
        return loss.item()

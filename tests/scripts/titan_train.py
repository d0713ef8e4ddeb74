"""A torchtitan-style LLM pre-training job: a tiny Llama on a synthetic token stream,
built through ``titan_lib`` (model parts, OptimizersContainer, LR schedulers, GC
handler, Trainer) and trained by calling ``trainer.train_step(batch)`` once a step.
Runs on CPU under gloo:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=4 titan_train.py \\
        --steps 6 --out DIR [--fsdp] [--tp 2] [--pp 2] [--parts 2] [--ac selective] \\
        [--loss-chunks 8] [--compile] [--same-data] [--lr-rank 1 --lr-mult 2]

Each rank logs ``step N  loss X`` every step and, with --out, writes DIR/rank{r}.json:
its losses as loss.item() floats.
"""

import argparse

import titan_lib
from titan_lib import logger


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="torchtitan-style training on CPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="", help="folder for rank{r}.json loss files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--gc-freq", type=int, default=4)
    parser.add_argument("--ac", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--parts", type=int, choices=[1, 2], default=1)
    parser.add_argument("--loss-chunks", type=int, default=0)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--same-data", action="store_true", help="planted bug: every rank reads data shard 0"
    )
    parser.add_argument(
        "--lr-rank",
        type=int,
        default=-1,
        help="planted bug: this rank's optimizers get --lr-mult x the LR",
    )
    parser.add_argument("--lr-mult", type=float, default=1.0)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    titan_lib.init_logger()
    titan_lib.init_distributed()
    trainer = titan_lib.Trainer(args)
    data_iterator = iter(trainer.dataloader)
    logger.info(f"Training starts at step 1, {args.steps} steps")
    try:
        for _ in range(args.steps):
            batch = next(data_iterator)
            trainer.train_step(batch)
        logger.info("Training completed")
        if args.out:
            trainer.write_losses(args.out)
    finally:
        trainer.close()


if __name__ == "__main__":
    main()

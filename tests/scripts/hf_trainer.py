"""A Hugging Face Trainer job: the step loop is the framework's, not the script's. A tiny
GPT-2 built from its config (no download), gradient accumulation and clipping by the
Trainer. Run unchanged under torchrun and %dt_script.

    torchrun --nproc-per-node 4 hf_trainer.py OUT [--steps N]
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Windows(torch.utils.data.Dataset):
    """Fixed token windows of a synthetic corpus (the same on every rank; the Trainer's
    distributed sampler shards them)."""

    def __init__(self, n: int = 256, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    losses = []  # every micro-batch's loss, as the Trainer computed it
    model.register_forward_hook(lambda module, inputs, output: losses.append(output.loss.item()))
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=0.5,
        warmup_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Windows())
    trainer.train()
    rank = trainer.args.process_index
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main()

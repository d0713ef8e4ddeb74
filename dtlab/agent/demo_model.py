"""The built-in demo training job: a tiny DeepSeek-style MoE language model on synthetic tokens.

Runs on each rank (pure torch). The model is a decoder-only LM of ``num_layers`` pre-norm
blocks (RMSNorm, causal attention with rotary positions, SwiGLU feed-forward); block
``moe_layer`` swaps its feed-forward for a DeepSeek-MoE layer (shared experts always on,
top-k routed experts). The default config has 271,168 parameters; one optimizer step takes
about 13 ms on one CPU thread, so eight ranks can share two cores.

The data are motifs tiled with a little noise, so the loss visibly falls within ~30 steps.
Every sample is a pure function of (seed, index), which lets a debugger tell which rank saw
which sample.

Run it single-process (30 steps, loss per step and the median step time)::

    python -m dtlab.agent.demo_model [--steps 30] [--threads 1]

On ranks, ``build_demo(rank=..., world_size=..., ddp=True)`` once the process group exists.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

_POSITIVE_FIELDS = (
    "vocab_size",
    "seq_len",
    "dim",
    "num_layers",
    "num_heads",
    "num_experts",
    "expert_dim",
    "batch_size",
    "num_samples",
)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    vocab_size: int = 256
    seq_len: int = 32
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    moe_layer: int = 2  # index of the block whose feed-forward is MoE; -1 for none
    num_experts: int = 4
    num_shared_experts: int = 1
    top_k: int = 2
    expert_dim: int = 64
    batch_size: int = 8  # per rank
    num_samples: int = 4096
    seed: int = 0
    # residual dropout: steps then draw from torch's RNG, which a resume must restore
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name}={value!r} must be a whole number")
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(
                f"dim={self.dim} must be divisible by num_heads={self.num_heads} into an even "
                "head size (rotary embeddings rotate pairs)"
            )
        if self.moe_layer != -1 and self.moe_layer not in range(self.num_layers):
            raise ValueError(
                f"moe_layer={self.moe_layer} must be in range({self.num_layers}) or -1 for none"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Shared experts on every token plus ``top_k`` of ``num_experts`` routed experts."""

    def __init__(self, dim: int, expert_dim: int, num_experts: int, num_shared: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, expert_dim) for _ in range(num_experts))
        # n shared experts of width w are one SwiGLU of width n*w (as DeepSeek implements them)
        self.shared = SwiGLU(dim, expert_dim * num_shared) if num_shared else None
        # A plain attribute, not a buffer: DDP would broadcast a buffer from rank 0 and hide
        # that each rank routes its own tokens.
        self.last_expert_counts = torch.zeros(num_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self._routed(flat).view_as(x)
        return out + self.shared(x) if self.shared is not None else out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(dim=-1)
        weights, chosen = gates.topk(self.top_k, dim=-1)
        # With k=1 the renormalised weight is always 1 and the router would learn nothing
        # (DeepSeek renormalises only for k>1 too).
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        self.last_expert_counts = counts.detach()
        # Sort the (token, slot) pairs by expert so each expert sees one contiguous slice.
        order = chosen.flatten().argsort(stable=True)
        token_ids = order // self.top_k
        slot_weights = weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts.tolist(), strict=True):
            if count:
                ids = token_ids[start : start + count]
                y = expert(x.index_select(0, ids)) * slot_weights[start : start + count]
                out.index_add_(0, ids, y)
            start += count
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary_tables(length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim, device = like.shape[-1], like.device
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
    angles = torch.outer(torch.arange(length, device=device), inv_freq).repeat(1, 2)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head_dim)
        # Recomputed per call (microseconds) rather than kept as buffers, which DDP would
        # broadcast every step and a pipeline stage would have to carry.
        cos, sin = _rotary_tables(length, q)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, config: DemoConfig, moe: bool) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.RMSNorm(c.dim)
        self.attn = Attention(c.dim, c.num_heads)
        self.ffn_norm = nn.RMSNorm(c.dim)
        if moe:
            self.ffn = MoE(c.dim, c.expert_dim, c.num_experts, c.num_shared_experts, c.top_k)
        else:
            # As wide as the experts a token passes through in the MoE block: same compute.
            self.ffn = SwiGLU(c.dim, c.expert_dim * (c.top_k + c.num_shared_experts))
        self.dropout = c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout, self.training)
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.dropout, self.training)


class DemoLM(nn.Module):
    """Decoder-only LM: ``embed`` -> ``blocks`` -> ``norm`` -> ``head`` (untied)."""

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(
            Block(config, moe=i == config.moe_layer) for i in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def demo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of ``batch["tokens"]`` (batch x seq_len+1)."""
    inputs, target = split_tokens(batch)
    return next_token_loss(model(inputs), target)


def split_tokens(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): the tokens, and the same shifted by one."""
    tokens = batch["tokens"]
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int = 10):
    """Linear LR warm-up over ``warmup_steps``, then constant."""
    warmup = max(warmup_steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


def pipeline_data(config: DemoConfig) -> DataLoader:
    """The demo data as every stage of one pipeline reads it: the same batches on all
    (one replica of the data, shuffled per epoch by the sampler)."""
    dataset = SyntheticTokens(config)
    sampler = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=config.seed, drop_last=True
    )
    return DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, num_workers=0)


class SyntheticTokens(Dataset):
    """Motifs (short random token strings) tiled from a random offset, with noise tokens.

    Sample ``index`` is a pure function of ``(config.seed, index)``.
    """

    def __init__(self, config: DemoConfig, *, num_patterns: int = 16, noise: float = 0.05):
        self.config = config
        self.noise = noise
        g = torch.Generator().manual_seed(config.seed)
        lengths = torch.randint(3, 9, (num_patterns,), generator=g).tolist()
        self.motifs = [torch.randint(config.vocab_size, (n,), generator=g) for n in lengths]

    def __len__(self) -> int:
        return self.config.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index={index} out of range(0, {len(self)})")
        c = self.config
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + index)
        motif = self.motifs[int(torch.randint(len(self.motifs), (1,), generator=g))]
        offset = int(torch.randint(len(motif), (1,), generator=g))
        length = c.seq_len + 1
        tokens = motif.repeat((offset + length) // len(motif) + 1)[offset : offset + length]
        noisy = torch.rand(length, generator=g) < self.noise
        noise = torch.randint(c.vocab_size, (length,), generator=g)
        return {"tokens": torch.where(noisy, noise, tokens), "index": torch.tensor(index)}


@dataclass
class DemoJob:
    config: DemoConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: DataLoader
    sampler: DistributedSampler
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def build_demo(
    config: DemoConfig | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    ddp: bool = False,
    lr: float = 3e-3,
    warmup_steps: int = 10,
    device: str | torch.device = "cpu",
    sharding: str | None = None,
) -> DemoJob:
    """This rank's demo job. ``ddp=True`` needs an initialised process group.
    ``sharding``: ``"fsdp2"`` (each block and the root under ``fully_shard``), ``"fsdp1"``
    (the same units under FSDP1's ``FullyShardedDataParallel``: flat parameters),
    ``"fsdp1-orig"`` (FSDP1 with ``use_orig_params=True``) or ``"zero"`` (DDP with a
    ZeroRedundancyOptimizer: optimizer state sharded, ZeRO-1/2 style)."""
    config = config or DemoConfig()
    if sharding not in (None, "fsdp2", "fsdp1", "fsdp1-orig", "zero"):
        raise ValueError(f"sharding={sharding!r}; choose fsdp2, fsdp1, fsdp1-orig, zero or None")
    torch.manual_seed(config.seed)  # every rank builds identical weights
    model: nn.Module = DemoLM(config).to(device)
    if sharding == "fsdp2":
        model = _fully_shard(model, device)
    elif sharding in ("fsdp1", "fsdp1-orig"):
        model = _fsdp1(model, device, use_orig_params=sharding == "fsdp1-orig")
    elif ddp:
        model = nn.parallel.DistributedDataParallel(
            model,
            # a routed expert that gets no token on a rank has no gradient there
            find_unused_parameters=True,
        )
    if sharding == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = warmup_schedule(optimizer, warmup_steps)
    dataset = SyntheticTokens(config)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed, drop_last=True
    )
    data = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, num_workers=0)
    return DemoJob(config, model, optimizer, scheduler, data, sampler, demo_loss)


def _fully_shard(model: DemoLM, device) -> nn.Module:
    """FSDP2 as torchtitan applies it: each block its own unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kind = torch.device(device).type
    mesh = init_device_mesh(kind, (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp1(model: DemoLM, device, use_orig_params: bool) -> nn.Module:
    """FSDP1 as most code still applies it: each block its own unit (an auto-wrap
    policy), the rest in the root's."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        device_id=torch.device(device),  # FSDP1 asks for it on CPU
    )


def demo_step(job: DemoJob, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step on ``batch``; returns the loss."""
    job.optimizer.zero_grad(set_to_none=True)
    loss = job.loss_fn(job.model, batch)
    loss.backward()
    job.optimizer.step()
    job.scheduler.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the demo model single-process.")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to run")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    job = build_demo()
    print(f"parameters: {sum(p.numel() for p in job.model.parameters()):,}")
    times = []
    for step, batch in enumerate(itertools.islice(job.data, args.steps)):
        start = time.perf_counter()
        loss = demo_step(job, batch)
        times.append(time.perf_counter() - start)
        print(f"step {step:3d}  loss {loss:.3f}")
    print(f"median step time: {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

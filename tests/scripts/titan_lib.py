"""The library half of a torchtitan-style LLM training job (``titan_train.py`` is the entry
point). Everything the way torchtitan users meet it, shrunk to run on CPU under gloo: a
tiny Llama (RMSNorm, rotary positions, SwiGLU) kept as a list of model parts, an
``OptimizersContainer`` holding one AdamW per part, an LR-scheduler container, the
``GarbageCollection`` helper, a dataloader that shards by data-parallel rank, and a
``Trainer`` whose ``train_step`` does forward, loss, backward, clipping and the step.

Parallelisms, as torchtitan applies them: tensor parallel (``parallelize_module``), then
activation checkpointing, then ``torch.compile`` per block, then FSDP2 (``fully_shard``
per block, ``[norm, output]`` and root) or, without FSDP, DDP through the composable
``replicate``; pipeline parallel through ``torch.distributed.pipelining``.

Two planted bugs: ``same_data`` (every rank reads shard 0) and ``lr_rank``/``lr_mult``
(one rank's inner AdamWs get a multiplied learning rate).
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- logging


def init_logger() -> None:
    """Bind a stdout handler to the root logger at INFO, as torchtitan's init_logger."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.INFO)
    handler.setFormatter(
        logging.Formatter("[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s")
    )
    root.addHandler(handler)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


# --------------------------------------------------------------------------- gc


class GarbageCollection:
    """torchtitan's GC handler: automatic gc off, a generation-1 collection every gc_freq
    steps."""

    def __init__(self, gc_freq: int = 4, debug: bool = False):
        assert gc_freq > 0, "gc_freq must be a positive integer"
        self.gc_freq = gc_freq
        self.debug = debug
        gc.disable()
        self.collect("Initial GC collection")

    def run(self, step_count: int) -> None:
        if self.debug:
            self.collect("Force GC to perform collection to obtain debug information", 2)
            gc.collect()
        elif step_count > 1 and step_count % self.gc_freq == 0:
            self.collect("Performing periodic GC collection")

    @staticmethod
    def collect(reason: str, generation: int = 1) -> None:
        begin = time.monotonic()
        gc.collect(generation)
        logger.info("[GC] %s took %.2f seconds", reason, time.monotonic() - begin)


# --------------------------------------------------------------------------- model


class ModelArgs:
    def __init__(
        self,
        vocab_size=256,
        dim=64,
        n_layers=4,
        n_heads=4,
        multiple_of=32,
        norm_eps=1e-6,
        max_seq_len=64,
        rope_theta=10000.0,
    ):
        self.vocab_size = vocab_size
        self.dim = dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.multiple_of = multiple_of
        self.norm_eps = norm_eps
        self.max_seq_len = max_seq_len
        self.rope_theta = rope_theta


def precompute_rope(head_dim: int, end: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-valued rotary tables (cos, sin), each (end, head_dim // 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary_emb(xq, xk, cos, sin):
    """Rotate halves of each head by position (x: bs, seq, heads, head_dim)."""
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(xq).type_as(xq), rotate(xk).type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, cos, sin):
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, cos[:seqlen], sin[:seqlen])
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, multiple_of: int):
        super().__init__()
        hidden = int(2 * (4 * dim) / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama-style decoder. ``layers`` is an nn.ModuleDict keyed "0".."n-1" so a split
    part keeps the full model's parameter names (layers.2.attention.wq.weight, ...). A
    part that lost its embedding takes hidden states as input; one that lost its norm and
    head returns hidden states. With ``return_hidden`` set the last part returns the
    normed hidden states instead of logits (the chunked loss applies the head itself)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model_args = args
        self.return_hidden = False
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        cos, sin = precompute_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self):
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            final_out_std = 0.02
            nn.init.trunc_normal_(
                self.output.weight,
                mean=0.0,
                std=final_out_std,
                a=-3 * final_out_std,
                b=3 * final_out_std,
            )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None or self.return_hidden:
            return h
        return self.output(h)


def split_model(model: Transformer, num_parts: int) -> list[Transformer]:
    """torchtitan's pipeline_module_split: deep-copy the whole model per part and delete
    what the part does not own (embedding in the first, norm + head in the last, the
    layers evenly)."""
    n_layers = len(model.layers)
    per_part = n_layers // num_parts
    parts = []
    for idx in range(num_parts):
        part = copy.deepcopy(model)
        keep = {str(i) for i in range(idx * per_part, (idx + 1) * per_part)}
        if idx == num_parts - 1:
            keep |= {str(i) for i in range(num_parts * per_part, n_layers)}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if idx != 0:
            part.tok_embeddings = None
        if idx != num_parts - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts


# --------------------------------------------------------------------------- parallelisms


# op-level selective AC, torchtitan's save list (plus the CPU SDPA kernel)
_save_list = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _get_custom_policy(meta):
    from torch.utils.checkpoint import CheckpointPolicy

    def _custom_policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        mm_count_key = f"{mode}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[mm_count_key] += 1
        # save the output of every op in the list, except every second mm
        to_save = func in _save_list and not (
            func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0
        )
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return _custom_policy


def selective_checkpointing_context_fn():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    meta = defaultdict(int)
    return create_selective_checkpoint_contexts(_get_custom_policy(meta))


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap each block in ptd_checkpoint_wrapper (non-reentrant torch.utils.checkpoint).
    full: recompute the whole block; selective: op-level SAC, i.e.
    checkpoint(block, use_reentrant=False, context_fn=selective_checkpointing_context_fn)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as ptd_checkpoint_wrapper,
    )

    for layer_id, block in model.layers.named_children():
        if mode == "full":
            wrapped = ptd_checkpoint_wrapper(block, preserve_rng_state=False)
        elif mode == "selective":
            wrapped = ptd_checkpoint_wrapper(
                block, context_fn=selective_checkpointing_context_fn, preserve_rng_state=False
            )
        else:
            raise ValueError(f"Invalid AC mode: {mode}")
        model.layers.register_module(layer_id, wrapped)
    logger.info(f"Applied {mode} activation checkpointing to the model")


class NoParallel:
    """torchtitan's NoParallel style: the module's parameters become DTensors replicated
    on the TP mesh (so that, once FSDP shards them, every parameter lives on the same
    2-D dp x tp mesh); plain inputs are taken as replicated and outputs handed back as
    plain local tensors."""

    @staticmethod
    def _prepare_input_fn(mod, inputs, device_mesh):
        from torch.distributed.tensor import DTensor, Replicate

        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(mod, outputs, device_mesh):
        from torch.distributed.tensor import Replicate

        if outputs.placements != (Replicate(),):
            outputs = outputs.redistribute(placements=(Replicate(),))
        return outputs.to_local()

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module, device_mesh, None, self._prepare_input_fn, self._prepare_output_fn
        )


def apply_tp(model: Transformer, tp_mesh) -> None:
    """Column-/row-wise parallel on the attention and MLP linears, as torchtitan's layer
    plan but without sequence parallel: activations between modules stay plain,
    replicated tensors. The embedding, the norms and the head are NoParallel (parameters
    replicated DTensors on the TP mesh)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for name in ("tok_embeddings", "norm", "output"):
        module = getattr(model, name)
        if module is not None:
            NoParallel().apply(module, tp_mesh)
    for block in model.layers.values():
        NoParallel().apply(block.attention_norm, tp_mesh)
        NoParallel().apply(block.ffn_norm, tp_mesh)
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)
    logger.info("Applied Tensor Parallelism to the model")


def apply_compile(model: Transformer) -> None:
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block))
    logger.info("Compiling each TransformerBlock with torch.compile")


def apply_fsdp(model: Transformer, dp_mesh, pp_enabled: bool = False) -> None:
    from torch.distributed.fsdp import fully_shard

    reshard_after_forward = not pp_enabled
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if model.norm is not None and model.output is not None:
        fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh)
    logger.info("Applied FSDP to the model")


def apply_ddp(model: nn.Module, dp_mesh, enable_compile: bool, static_graph: bool) -> None:
    from torch.distributed._composable.replicate import replicate

    if enable_compile:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    kwargs = {"static_graph": True} if static_graph else {}
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100, **kwargs)
    logger.info("Applied DDP to the model")


# --------------------------------------------------------------------------- optimizers


class OptimizersContainer(Optimizer):
    """One optimizer per model part, stepped together. Optimizer.__init__ runs on all
    parameters so step hooks work; the container's own param_groups is a single group
    holding every parameter and no hyperparameters (no 'lr'); the learning rates live in
    the inner optimizers' param_groups (``container.optimizers[i].param_groups``)."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs: dict):
        all_params = []
        self.optimizers = []
        self.model_parts = model_parts
        for model in model_parts:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizers.append(optimizer_cls(params, **optimizer_kwargs))
            all_params.extend(params)
        Optimizer.__init__(self, all_params, {})

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self):
        return len(self.optimizers)

    def step(self, *args, **kwargs) -> None:
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def zero_grad(self, *args, **kwargs) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(*args, **kwargs)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict) -> None:
        for o, sd in zip(self.optimizers, state_dict["optimizers"], strict=True):
            o.load_state_dict(sd)


def build_optimizers(model_parts, lr: float, lr_rank: int = -1, lr_mult: float = 1.0):
    optimizers = OptimizersContainer(
        model_parts,
        torch.optim.AdamW,
        {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "foreach": True},
    )
    if lr_mult != 1.0 and dist.is_initialized() and dist.get_rank() == lr_rank:
        # planted bug: this rank's inner optimizers (and so the schedulers' base LRs,
        # taken from them) run at lr_mult x the learning rate
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] *= lr_mult
    return optimizers


def linear_warmup(warmup_steps: int, current_step: int) -> float:
    """torchtitan's warm-up: (step + 1) / (warmup + 1) ramping to 1, then constant."""
    if current_step < warmup_steps:
        return float((current_step + 1) / (warmup_steps + 1))
    return 1.0


class LRSchedulersContainer:
    """One LambdaLR per inner optimizer of the container."""

    def __init__(self, optimizers: OptimizersContainer, warmup_steps: int):
        lr_lambda = partial(linear_warmup, warmup_steps)
        self.schedulers = [LambdaLR(opt, lr_lambda=lr_lambda) for opt in optimizers]

    def __iter__(self):
        return iter(self.schedulers)

    def __len__(self):
        return len(self.schedulers)

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()


# --------------------------------------------------------------------------- clipping


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, foreach=None, pp_mesh=None
) -> torch.Tensor:
    """torchtitan's dist_utils.clip_grad_norm_: total norm by get_total_norm, a DTensor
    norm reduced with full_tensor(), summed over the pipeline mesh, then
    clip_grads_with_norm_. One change: grads that live on different device meshes (FSDP's
    1-D dp mesh for plain parameters, the 2-D dp x tp mesh for tensor-parallel ones) are
    normed mesh by mesh and the partial norms combined, since one foreach norm cannot mix
    meshes."""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        by_mesh.setdefault(key, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm)
    if len(norms) == 1:
        total_norm = norms[0]
    else:
        total_norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total_norm **= norm_type
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total_norm **= 1.0 / norm_type
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


# --------------------------------------------------------------------------- data


class SyntheticTokens(torch.utils.data.IterableDataset):
    """A long token stream drawn once from a fixed-seed generator (a random first-order
    Markov chain: each token has four possible successors, so there is something to
    learn), cut into windows of seq_len + 1. Like torchtitan's dataset (which splits by
    node), rank ``dp_rank`` of ``dp_degree`` takes windows dp_rank, dp_rank + dp_degree,
    ...; no DistributedSampler. Infinite: it starts over at the end of the stream."""

    def __init__(
        self,
        seq_len: int,
        dp_rank: int,
        dp_degree: int,
        vocab_size: int = 256,
        num_tokens: int = 1 << 16,
        seed: int = 1234,
    ):
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=g).tolist()
        choice = torch.randint(0, 4, (num_tokens,), generator=g).tolist()
        token = int(torch.randint(0, vocab_size, (1,), generator=g))
        stream = []
        for c in choice:
            stream.append(token)
            token = successors[token][c]
        self.tokens = torch.tensor(stream, dtype=torch.long)

    def __iter__(self):
        window = self.seq_len + 1
        n_windows = len(self.tokens) // window
        while True:
            for i in range(self.dp_rank, n_windows, self.dp_degree):
                w = self.tokens[i * window : (i + 1) * window]
                yield w[:-1], w[1:]


def build_dataloader(
    batch_size: int, seq_len: int, dp_rank: int, dp_degree: int, same_data: bool = False
):
    if same_data:  # planted bug: every rank reads shard 0
        dp_rank = 0
    dataset = SyntheticTokens(seq_len, dp_rank, dp_degree)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


# --------------------------------------------------------------------------- losses


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


class _CarryHiddenGrad(torch.autograd.Function):
    """Value: the already computed total loss. Backward: the gradient of the hidden
    states accumulated by the chunk backward() calls (times the incoming grad)."""

    @staticmethod
    def forward(ctx, hidden, total, hidden_grad):
        ctx.save_for_backward(hidden_grad)
        return total.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (hidden_grad,) = ctx.saved_tensors
        return hidden_grad * grad_out, None, None


class ChunkedCrossEntropy:
    """Cross entropy over the vocabulary in ``chunks`` pieces of the tokens, never holding
    all logits. The final hidden states are detached; for each chunk the head is applied
    (F.linear on its weight, outside any module hooks), the chunk's share of the mean loss
    is computed and backward() is called on it at once, so the head's .grad and the
    detached hidden's .grad accumulate. Returns a total whose value is the mean loss over
    all tokens and whose backward() carries the accumulated hidden gradient into the
    trunk."""

    def __init__(self, head: nn.Linear, chunks: int):
        self.head = head
        self.chunks = chunks

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        h = hidden.detach().flatten(0, 1).requires_grad_()
        flat_labels = labels.flatten(0, 1)
        n_tokens = flat_labels.numel()
        total = torch.zeros((), dtype=torch.float32)
        for h_chunk, l_chunk in zip(
            h.chunk(self.chunks), flat_labels.chunk(self.chunks), strict=True
        ):
            weight = self.head.weight
            if isinstance(weight, DTensor):  # --tp: replicated on the TP mesh
                weight = weight.to_local()
            logits = F.linear(h_chunk, weight)
            chunk_loss = F.cross_entropy(logits.float(), l_chunk, reduction="sum") / n_tokens
            chunk_loss.backward()
            total += chunk_loss.detach()
        return _CarryHiddenGrad.apply(hidden, total, h.grad.view_as(hidden))


# --------------------------------------------------------------------------- trainer


class Trainer:
    """Builds the mesh, the model parts, the optimizers, LR schedulers and dataloader,
    and runs one training step per ``train_step(batch)`` call.

    Attributes a debugger meets: ``model_parts`` (list of Transformer parts; one unless
    --parts 2, or the rank's own stage under --pp), ``optimizers`` (OptimizersContainer),
    ``lr_schedulers``, ``dataloader``, ``world_mesh`` (None without FSDP/TP/PP),
    ``losses`` (loss.item() per step), ``step``."""

    def __init__(self, args):
        self.args = args
        self.step = 0
        self.losses: list[float] = []
        self.gc_handler = GarbageCollection(gc_freq=args.gc_freq)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        torch.manual_seed(args.seed)

        from torch.distributed.device_mesh import init_device_mesh

        self.pp_enabled = args.pp > 1
        self.tp_enabled = args.tp > 1
        self.world_mesh = None
        dp_mesh = tp_mesh = self.pp_mesh = None
        if self.pp_enabled:
            if self.tp_enabled or args.parts != 1 or args.loss_chunks:
                raise ValueError("--pp does not combine with --tp, --parts or --loss-chunks here")
            dp = self.world_size // args.pp
            self.world_mesh = init_device_mesh("cpu", (args.pp, dp), mesh_dim_names=("pp", "dp"))
            dp_mesh, self.pp_mesh = self.world_mesh["dp"], self.world_mesh["pp"]
        elif self.tp_enabled:
            if not args.fsdp:
                raise ValueError(
                    "--tp needs --fsdp (torchtitan: DDP has not supported > 1D parallelism)"
                )
            dp = self.world_size // args.tp
            self.world_mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
            dp_mesh, tp_mesh = self.world_mesh["dp"], self.world_mesh["tp"]
        elif self.world_size > 1:
            self.world_mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp",))
            dp_mesh = self.world_mesh["dp"]
        if dp_mesh is not None:
            self.dp_rank, self.dp_degree = dp_mesh.get_local_rank(), dp_mesh.size()
        else:
            self.dp_rank, self.dp_degree = self.rank, self.world_size

        # model: built whole on every rank from the same seed, then split into parts
        model_args = ModelArgs(max_seq_len=args.seq_len)
        model = Transformer(model_args)
        if self.pp_enabled:
            self.pp_rank = self.pp_mesh.get_local_rank()
            self.model_parts = [split_model(model, args.pp)[self.pp_rank]]
        elif args.parts > 1:
            self.model_parts = split_model(model, args.parts)
        else:
            self.model_parts = [model]
        del model

        if args.loss_chunks:
            last = self.model_parts[-1]
            last.return_hidden = True
            self.loss_fn = ChunkedCrossEntropy(last.output, args.loss_chunks)
        else:
            self.loss_fn = cross_entropy_loss

        for part in self.model_parts:
            if self.tp_enabled:
                apply_tp(part, tp_mesh)
            if args.ac != "none":
                apply_ac(part, args.ac)
            if args.compile:
                apply_compile(part)
            if args.fsdp or self.pp_enabled:
                apply_fsdp(part, dp_mesh, pp_enabled=self.pp_enabled)
            elif dp_mesh is not None:
                apply_ddp(
                    part, dp_mesh, enable_compile=args.compile, static_graph=bool(args.loss_chunks)
                )
            part.train()

        if self.pp_enabled:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            stage = PipelineStage(
                self.model_parts[0],
                self.pp_rank,
                args.pp,
                torch.device("cpu"),
                group=self.pp_mesh.get_group(),
            )
            self.pp_has_first_stage = stage.is_first
            self.pp_has_last_stage = stage.is_last
            self.pp_schedule = ScheduleGPipe(
                stage, n_microbatches=args.microbatches, loss_fn=cross_entropy_loss
            )
            logger.info(f"Applied pipeline parallel: stage {self.pp_rank} of {args.pp}")

        self.optimizers = build_optimizers(self.model_parts, args.lr, args.lr_rank, args.lr_mult)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, args.warmup_steps)
        self.dataloader = build_dataloader(
            args.batch_size, args.seq_len, self.dp_rank, self.dp_degree, same_data=args.same_data
        )
        n_params = sum(p.numel() for part in self.model_parts for p in part.parameters())
        logger.info(
            f"rank {self.rank}: dp_rank {self.dp_rank} of {self.dp_degree}, "
            f"{len(self.model_parts)} model part(s), {n_params} local parameters"
        )

    def forward_backward_step(self, inputs, labels) -> torch.Tensor:
        if self.pp_enabled:
            targets, losses = (labels, []) if self.pp_has_last_stage else (None, None)
            if self.pp_has_first_stage:
                self.pp_schedule.step(inputs, target=targets, losses=losses)
            else:
                self.pp_schedule.step(target=targets, losses=losses)
            # as torchtitan: only the last stage has a loss; the others log -1
            if self.pp_has_last_stage:
                return torch.mean(torch.stack(losses))
            return torch.tensor(-1.0)
        pred = inputs
        for part in self.model_parts:
            pred = part(pred)
        loss = self.loss_fn(pred, labels)
        del pred
        loss.backward()
        return loss

    def train_step(self, batch) -> float:
        self.step += 1
        self.gc_handler.run(self.step)
        inputs, labels = batch
        loss = self.forward_backward_step(inputs, labels)
        clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.args.max_norm,
            foreach=True,
            pp_mesh=self.pp_mesh,
        )
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        loss = loss.detach()
        value = loss.item()
        self.losses.append(value)
        logger.info(f"step {self.step:3d}  loss {value:.6f}")
        return value

    def write_losses(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{self.rank}.json"), "w") as f:
            json.dump(self.losses, f)

    def close(self) -> None:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def init_distributed() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend="gloo")

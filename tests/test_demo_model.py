"""The demo job's model and data, in one process (no process group, no cluster)."""

import itertools

import pytest
import torch

from dtlab.agent.demo_model import (
    DemoConfig,
    DemoLM,
    MoE,
    SyntheticTokens,
    build_demo,
    demo_step,
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": 5}, "top_k=5 must be in 1..num_experts=4"),
        ({"top_k": 0}, "top_k=0"),
        ({"dim": 63}, "dim=63 must be divisible by num_heads=4"),
        ({"moe_layer": 4}, r"moe_layer=4 must be in range\(4\) or -1"),
        ({"moe_layer": -2}, "moe_layer=-2"),
        ({"batch_size": 0}, "batch_size=0 must be >= 1"),
        ({"num_shared_experts": -1}, "num_shared_experts=-1"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DemoConfig(**kwargs)


def test_config_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        DemoConfig(256)
    with pytest.raises(AttributeError):
        DemoConfig().seed = 1


def test_dataset_samples_are_deterministic_with_the_right_shape():
    config = DemoConfig()
    first, again = SyntheticTokens(config), SyntheticTokens(config)
    sample = first[7]
    assert sample["tokens"].shape == (config.seq_len + 1,)
    assert sample["tokens"].dtype == torch.long
    assert int(sample["index"]) == 7
    assert 0 <= sample["tokens"].min() and sample["tokens"].max() < config.vocab_size
    assert torch.equal(sample["tokens"], again[7]["tokens"])
    num_distinct = len({tuple(first[i]["tokens"].tolist()) for i in range(50)})
    assert num_distinct > 40
    with pytest.raises(IndexError):
        first[config.num_samples]


def test_model_returns_logits_per_position():
    config = DemoConfig()
    torch.manual_seed(0)
    logits = DemoLM(config)(torch.randint(config.vocab_size, (3, config.seq_len)))
    assert logits.shape == (3, config.seq_len, config.vocab_size)
    model = DemoLM(config)
    assert len(model.blocks) == config.num_layers
    assert isinstance(model.blocks[config.moe_layer].ffn, MoE)


def test_moe_routes_each_token_to_exactly_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(dim=16, expert_dim=8, num_experts=4, num_shared=1, top_k=2)
    x = torch.randn(3, 5, 16)
    assert moe(x).shape == x.shape
    assert moe.last_expert_counts.shape == (4,)
    assert int(moe.last_expert_counts.sum()) == 3 * 5 * 2
    assert not moe.last_expert_counts.requires_grad


def test_moe_equals_dense_reference():
    torch.manual_seed(0)
    moe = MoE(dim=16, expert_dim=8, num_experts=4, num_shared=0, top_k=2)
    x = torch.randn(10, 16)
    weights, chosen = moe.router(x).softmax(-1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    every = torch.stack([expert(x) for expert in moe.experts], dim=1)  # (tokens, experts, dim)
    expected = (every.gather(1, chosen[..., None].expand(-1, -1, 16)) * weights[..., None]).sum(1)
    torch.testing.assert_close(moe(x), expected)


def test_loss_falls_within_30_steps():
    job = build_demo()
    losses = [demo_step(job, batch) for batch in itertools.islice(job.data, 30)]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_same_seed_builds_bitwise_identical_models():
    first, second = build_demo().model, build_demo().model
    pairs = zip(first.named_parameters(), second.named_parameters(), strict=True)
    for (name, a), (other_name, b) in pairs:
        assert name == other_name and torch.equal(a, b), name
    other = build_demo(DemoConfig(seed=1)).model
    assert not torch.equal(first.head.weight, other.head.weight)


def test_sampler_shards_are_disjoint_across_ranks():
    shards = []
    for rank in (0, 1):
        job = build_demo(rank=rank, world_size=2)
        job.sampler.set_epoch(0)
        shards.append({int(i) for batch in job.data for i in batch["index"]})
    assert not shards[0] & shards[1]
    assert len(shards[0]) == len(shards[1]) == DemoConfig().num_samples // 2

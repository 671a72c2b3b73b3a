"""Weight sync into two real serve-rollout processes over a gloo group (SGLang's
update_weights_from_distributed protocol), from a transformers model's updated weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_helpers import make_tiny_checkpoint
from test_rollout_server import PROMPT, reference_logprobs

from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.rollout.local import LocalEngines
from dapo_megatron.rollout.weight_sync import DistributedWeightSync, sync_by_tensor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_sync")
    model_dir = make_tiny_checkpoint(root / "model", seed=0)
    with LocalEngines(str(model_dir), num_engines=2, register_dir=str(root / "engines")) as engines:
        assert len(set(engines.urls)) == 2 and (root / "logs" / "engine_1.log").exists()
        yield {"root": root, "model_dir": model_dir, "urls": engines.urls}


def updated_model(model_dir, seed: int):
    """The 'trainer': the engines' model after a made-up update (every tensor changed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


async def _engine_logprobs(client: EngineClient, max_new_tokens: int = 12):
    out = await client.generate(input_ids=PROMPT, return_logprob=True,
                                sampling_params={"max_new_tokens": max_new_tokens, "sampling_seed": 9, "ignore_eos": True})
    return out["output_ids"], torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)


def test_distributed_sync_then_engine_logprobs_match_trainer(setup):
    trainer = updated_model(setup["model_dir"], seed=1)
    weights = list(trainer.state_dict().items())

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        sync = DistributedWeightSync(master_address="127.0.0.1", backend="gloo", bucket_bytes=64 * 1024)
        stats = await sync.sync(clients, iter(weights))
        results = [await _engine_logprobs(c) for c in clients]
        row = await clients[1].get_weights_by_name("model.layers.1.mlp.down_proj.weight", truncate_size=3)
        # a second sync re-uses the group (no re-forming) and records its own numbers
        stats2 = await sync.sync(clients, iter(weights))
        await sync.close(clients)
        for c in clients:
            await c.close()
        return stats, stats2, results, row, sync

    stats, stats2, results, row, sync = asyncio.run(scenario())
    total_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    assert stats.num_tensors == len(weights) and stats.bytes == total_bytes
    assert stats.num_buckets > 3  # 64 KiB buckets on a ~330 KB model
    assert stats.gb_per_s > 0 and stats.missing == [] and stats.num_engines == 2
    assert len(sync.history) == 2 and sync._generation == 1
    assert torch.equal(torch.tensor(row), trainer.state_dict()["model.layers.1.mlp.down_proj.weight"][:3])
    for tokens, got in results:
        want = reference_logprobs(trainer, PROMPT, tokens, 1.0)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("corruption", ["name", "shape"])
def test_corrupted_tensor_is_refused_before_anything_is_written(setup, corruption):
    trainer = updated_model(setup["model_dir"], seed=2)
    weights = list(trainer.state_dict().items())
    victim = weights[5][0]
    if corruption == "name":
        weights[5] = ("model.layers.0.self_attn.q_proj.weight_typo", weights[5][1])
        bad = "model.layers.0.self_attn.q_proj.weight_typo"
    else:
        weights[5] = (victim, weights[5][1][:-1])
        bad = victim

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        before = await _engine_logprobs(clients[0])
        sync = DistributedWeightSync(master_address="127.0.0.1", backend="gloo")  # one bucket holds all
        with pytest.raises(ValueError) as info:
            await sync.sync(clients, iter(weights))
        after = await _engine_logprobs(clients[0])
        # the server refuses by itself too (a trainer without the check): 400 naming the tensor
        from dapo_megatron.rollout.client import EngineError

        await sync.connect(clients)
        with pytest.raises(EngineError) as server_info:
            await clients[0].update_weights_from_distributed(
                names=[n for n, _ in weights], dtypes=["float32"] * len(weights),
                shapes=[list(t.shape) for _, t in weights], group_name=sync._group_name)
        await sync.close(clients)
        for c in clients:
            await c.close()
        return info.value, before, after, server_info.value

    err, before, after, server_err = asyncio.run(scenario())
    assert bad in str(err)
    assert before[0] == after[0] and torch.equal(before[1], after[1])  # nothing written
    assert server_err.status == 400 and bad in str(server_err)


def test_sync_by_tensor_value_transport(setup):
    trainer = updated_model(setup["model_dir"], seed=3)

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        stats = await sync_by_tensor(clients, iter(trainer.state_dict().items()), bucket_bytes=100_000)
        out = [await _engine_logprobs(c) for c in clients]
        for c in clients:
            await c.close()
        return stats, out

    stats, results = asyncio.run(scenario())
    assert stats.num_buckets > 1 and stats.missing == []
    for tokens, got in results:
        assert torch.allclose(got, reference_logprobs(trainer, PROMPT, tokens, 1.0), atol=1e-4, rtol=0)

"""Weight sync into two real serve-rollout processes (SGLang's protocol: a session around every sync,
update_weights_from_distributed over a gloo group with flattened buckets, update_weights_from_tensor with
shared-memory payloads), from a transformers model's updated weights; failures close every session and
name the engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dapo_megatron.launch.local.engines import LocalEngines
from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.transfer import weight_sync as ws
from dapo_megatron.transfer.weight_sync import DistributedWeightSync, TensorWeightSync, weight_update_session
from rollout_helpers import PROMPT, make_tiny_checkpoint, reference_logprobs


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
    out = await client.generate(
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={"max_new_tokens": max_new_tokens, "sampling_seed": 9, "ignore_eos": True},
    )
    return out["output_ids"], torch.tensor(
        [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64
    )


async def _sessions_open(clients: list[EngineClient]) -> list[bool]:
    return [(await c.server_info())["cpu_engine"]["weight_update_session_open"] for c in clients]


def test_distributed_sync_then_engine_logprobs_match_trainer(setup):
    trainer = updated_model(setup["model_dir"], seed=1)
    weights = list(trainer.state_dict().items())

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        # no backend given: the group's backend follows the engines (real CPU engines: gloo)
        sync = DistributedWeightSync(master_address="127.0.0.1", bucket_bytes=64 * 1024)
        assert sync.backend == ""
        stats = await sync.sync(clients, iter(weights), weight_version="step_1")
        assert sync.backend == "gloo"
        results = [await _engine_logprobs(c) for c in clients]
        row = await clients[1].get_weights_by_name("model.layers.1.mlp.down_proj.weight", truncate_size=3)
        versions = [
            (await c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}))["meta_info"]["weight_version"]
            for c in clients
        ]
        # a second sync re-uses the group (no re-forming) and records its own numbers
        stats2 = await sync.sync(clients, iter(weights), weight_version="step_2")
        sessions = await _sessions_open(clients)
        await sync.close(clients)
        for c in clients:
            await c.close()
        return stats, stats2, results, row, sync, versions, sessions

    stats, stats2, results, row, sync, versions, sessions = asyncio.run(scenario())
    total_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    assert stats.num_tensors == len(weights) and stats.bytes == total_bytes
    assert stats.num_buckets > 3  # 64 KiB buckets on a ~450 KB model
    assert stats.num_collectives == stats.num_buckets  # flattened: one broadcast per bucket, not per tensor
    assert stats.gb_per_s > 0 and stats.missing == [] and stats.num_engines == 2
    assert len(sync.history) == 2 and sync._generation == 1 and stats2.weight_version == "step_2"
    assert versions == ["step_1", "step_1"] and sessions == [False, False]  # every session closed
    assert torch.equal(torch.tensor(row), trainer.state_dict()["model.layers.1.mlp.down_proj.weight"][:3])
    for tokens, got in results:
        want = reference_logprobs(trainer, PROMPT, tokens, 1.0)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("corruption", ["name", "shape"])
def test_corrupted_tensor_is_refused_before_anything_is_written(setup, corruption, monkeypatch):
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
            await sync.sync(clients, iter(weights), weight_version="bad")
        after = await _engine_logprobs(clients[0])
        # the engines refuse by themselves too (a trainer without the check): after receiving the
        # bucket, 400 naming the tensor; the sync fails naming the engine and closes every session
        monkeypatch.setattr(ws, "check_against", lambda *a, **k: None)
        with pytest.raises(EngineError) as server_info:
            await sync.sync(clients, iter(weights), weight_version="bad")
        sessions = await _sessions_open(clients)
        after_server = await _engine_logprobs(clients[0])
        await sync.close(clients)
        for c in clients:
            await c.close()
        return info.value, before, after, server_info.value, sessions, after_server

    err, before, after, server_err, sessions, after_server = asyncio.run(scenario())
    assert bad in str(err)
    assert before[0] == after[0] and torch.equal(before[1], after[1])  # nothing written
    assert bad in str(server_err) and setup["urls"][0] in str(server_err) and "400" in str(server_err)
    assert sessions == [False, False]
    assert before[0] == after_server[0] and torch.equal(before[1], after_server[1])  # still nothing written


def test_session_refused_by_one_engine_is_closed_on_the_others(setup):
    """begin_weight_update refused by engine 1 (its session is already open): engine 0's session is
    closed again and the error names engine 1; nothing was sent."""

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        await clients[1].begin_weight_update()  # someone else's session
        with pytest.raises(EngineError) as info:
            async with weight_update_session(clients):
                raise AssertionError("the body must not run")
        sessions = await _sessions_open(clients)
        await clients[1].end_weight_update()
        for c in clients:
            await c.close()
        return info.value, sessions

    err, sessions = asyncio.run(scenario())
    assert err.url == setup["urls"][1] and "begin_weight_update" in str(err) and "already open" in str(err)
    assert setup["urls"][0] not in str(err)
    assert sessions == [False, True]  # engine 0 closed by us; engine 1's foreign session untouched


def test_tensor_sync_shared_memory_transport(setup):
    trainer = updated_model(setup["model_dir"], seed=3)

    async def scenario():
        clients = [EngineClient(url) for url in setup["urls"]]
        stats = await TensorWeightSync(bucket_bytes=100_000).sync(
            clients, iter(trainer.state_dict().items()), weight_version="colocated_1"
        )
        out = [await _engine_logprobs(c) for c in clients]
        rows = [await c.get_weights_by_name("lm_head.weight", truncate_size=300) for c in clients]
        sessions = await _sessions_open(clients)
        for c in clients:
            await c.close()
        return stats, out, rows, sessions

    stats, results, rows, sessions = asyncio.run(scenario())
    assert stats.num_buckets > 1 and stats.missing == [] and stats.num_collectives == 0 and sessions == [False, False]
    for row in rows:  # bit for bit: the whole head
        assert torch.equal(torch.tensor(row, dtype=torch.float32), trainer.state_dict()["lm_head.weight"])
    for tokens, got in results:
        assert torch.allclose(got, reference_logprobs(trainer, PROMPT, tokens, 1.0), atol=1e-4, rtol=0)

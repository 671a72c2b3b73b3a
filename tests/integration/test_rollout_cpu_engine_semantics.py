"""The CPU engine behaves like SGLang 0.5.21 where a client can tell (a real serve-rollout process with
--max-batch-size 1, so requests queue behind a running one): health while starting, flush_cache while
busy, rid expansion and abort semantics (exact rid lookup, then prefix match), pause modes with weight
updates in between (weight_versions spans; retract recomputes the KV cache with the new weights),
release/resume (idle only; the weights' storage really freed), stale-weight detection in the sampler."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from rollout_helpers import PROMPT, ServerProcess, get_json, make_tiny_checkpoint, post, reference_logprobs

LONG = {"ignore_eos": True, "sampling_seed": 1}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_engine_semantics")
    model_a = make_tiny_checkpoint(root / "model_a", seed=0)
    model_b = make_tiny_checkpoint(root / "model_b", seed=1)
    server = ServerProcess(
        model_a, root / "engines", log_path=root / "server.log", extra_args=("--max-batch-size", "1")
    )
    yield SimpleNamespace(root=root, model_a=model_a, model_b=model_b, url=server.url)
    server.kill()


def info(url: str) -> dict:
    return get_json(url + "/server_info")["cpu_engine"]


def flush(url: str, query: str = "") -> int:
    """POST /flush_cache: 200 when flushed, 400 (a text body) when the engine is busy."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + "/flush_cache" + query, method="POST"), timeout=120
        ) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


async def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(0.05)


async def start_long(
    client: EngineClient, url: str, rid: str, *, items: int = 1, max_new_tokens: int = 240, min_tokens: int = 0
) -> asyncio.Task:
    """A request of `items` samples (rids rid-0., rid-1., ...; one runs at a time: --max-batch-size 1)
    that occupies the engine until aborted or done; returns once the first one runs with at least
    min_tokens tokens (bounded by the context length: 6 + 240 = 246 <= 256 tokens each)."""
    task = asyncio.ensure_future(
        client.generate(
            input_ids=[PROMPT] * items,
            rid=[f"{rid}-{i}." for i in range(items)],
            return_logprob=True,
            sampling_params={**LONG, "max_new_tokens": max_new_tokens},
        )
    )

    def running() -> bool:
        return any(r["rid"] == f"{rid}-0." and r["completion_tokens"] >= min_tokens for r in info(url)["running"])

    await wait_for(running, f"{rid}-0. to run")
    return task


def test_health_is_503_until_the_warm_up_generation(env):
    from aiohttp import web

    from dapo_megatron.cpu_engine.engine import CpuEngine
    from dapo_megatron.cpu_engine.server import RolloutServer

    server = RolloutServer(CpuEngine(str(env.model_a)), model_name="a")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario():
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with EngineClient(f"http://127.0.0.1:{port}") as c:
                starting = await c.health()
                await server.warm_up()  # SGLang: the first 1-token generation, then ServerStatus.Up
                up = await c.health()
                await c.release_memory(["weights"])
                released = await c.health()
        finally:
            await runner.cleanup()
        return starting, up, released

    try:
        assert asyncio.run(scenario()) == (False, True, False)
    finally:
        server.batcher.close()


def test_flush_cache_refuses_while_busy(env):
    async def scenario():
        async with EngineClient(env.url) as c:
            task = await start_long(c, env.url, "busy", items=8)  # 8 x 240 tokens, one at a time
            busy = flush(env.url)
            # the queued samples first, at once: on a quiet machine a 240-token sample takes ~0.2 s, so
            # aborting them only after the wait below let some of them run to their length (2026-11-25)
            for i in range(7, 0, -1):
                await c.abort(f"busy-{i}.")
            waited = asyncio.get_running_loop().run_in_executor(None, flush, env.url, "?timeout=120")
            await asyncio.sleep(0.5)
            await c.abort("busy-0.")
            outs = await task
            return busy, await waited, outs, flush(env.url)

    busy, waited, outs, idle = asyncio.run(scenario())
    assert busy == 400  # SGLang: not while requests run or wait
    assert waited == 200 and idle == 200  # ?timeout=: flushed once the engine went idle
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs[1:]] == ["abort"] * 7  # still queued then


def test_abort_names_samples_exactly_then_matches_by_prefix(env):
    """SGLang: a rid the tokenizer manager does not hold is ignored (the samples of an n > 1 request
    have fresh uuids, so their parent's rid aborts nothing; so does a rid naming no sample, like
    "long" for long-0. ...); a known rid aborts every queued or running request whose rid starts with
    it ("s1" also aborts "s10", hence the sampler's terminated rids)."""

    async def scenario():
        async with EngineClient(env.url) as c:
            before = info(env.url)["num_requests"]
            long = await start_long(c, env.url, "long", items=8)  # keeps the others queued behind it
            parent = asyncio.ensure_future(
                c.generate(input_ids=PROMPT, rid="parent", sampling_params={"n": 2, "max_new_tokens": 4})
            )
            prefix = asyncio.ensure_future(
                c.generate(input_ids=[PROMPT] * 2, rid=["s1", "s10"], sampling_params={"max_new_tokens": 4})
            )
            exact = asyncio.ensure_future(
                c.generate(input_ids=[PROMPT] * 2, rid=["q-0-1.", "q-0-10."], sampling_params={"max_new_tokens": 4})
            )
            await wait_for(
                lambda: info(env.url)["num_requests"] == before + 4 and info(env.url)["num_waiting_sequences"] >= 6,
                "6 queued samples",
            )
            for rid in ("parent", "parent_0", "long", "s1", "q-0-1."):
                await c.abort(rid)
            for i in range(8):  # the samples of "long", by their own rids
                await c.abort(f"long-{i}.")
            return await long, await parent, await prefix, await exact

    long, parent, prefix, exact = asyncio.run(scenario())
    running_abort = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    waiting_abort = {"type": "abort", "message": "Abort in waiting queue"}
    assert long[0]["meta_info"]["finish_reason"] == running_abort and 0 < len(long[0]["output_ids"]) < 240
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in long)
    assert [o["meta_info"]["finish_reason"]["type"] for o in parent] == ["length", "length"]  # nothing reached them
    assert [o["meta_info"]["finish_reason"] for o in prefix] == [waiting_abort, waiting_abort]
    assert [o["meta_info"]["id"] for o in prefix] == ["s1", "s10"] and prefix[0]["output_ids"] == []
    assert [o["meta_info"]["finish_reason"]["type"] for o in exact] == ["abort", "length"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_weights_updated_during_a_pause_show_in_the_versions_of_the_tokens(env, mode):
    """A request paused mid-generation, weights updated (the update does not wait for it: paused),
    then continued: its tokens report both versions (meta_info.weight_versions). With retract the KV
    cache was recomputed with the new weights, so every later token's log-prob is the new model's."""
    from transformers import AutoModelForCausalLM

    model_b = AutoModelForCausalLM.from_pretrained(env.model_b, dtype=torch.float32).eval()
    payload = serialize_for_engine_rank(list(model_b.state_dict().items()))

    async def scenario():
        async with EngineClient(env.url) as c:
            task = await start_long(c, env.url, f"paused-{mode}", min_tokens=5)  # mid-generation
            await c.pause_generation(mode)
            flushed = flush(env.url)  # retracted requests wait, and waiting ones do not count while paused
            waiting = asyncio.ensure_future(c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}))
            await c.begin_weight_update()
            await c.update_weights_from_tensor([payload], weight_version=f"b-{mode}")
            await c.end_weight_update()
            await asyncio.sleep(0.5)
            held = waiting.done()  # new requests wait for continue_generation
            await c.continue_generation()
            (out,) = await task
            await waiting
            # back to model a for the other tests
            await c.update_weights_from_disk(str(env.model_a), weight_version="default")
            return out, flushed, held

    out, flushed, held = asyncio.run(scenario())
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", f"b-{mode}"] and out["meta_info"][
        "weight_version"
    ] == f"b-{mode}"
    k = spans[0]["end"]
    assert spans == [{"version": "default", "start": 0, "end": k}, {"version": f"b-{mode}", "start": k, "end": 240}]
    assert 5 <= k < 240 and not held
    assert flushed == (200 if mode == "retract" else 400)  # in_place keeps the running batch (and its cache)
    if mode == "retract":
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        want = reference_logprobs(model_b, PROMPT, out["output_ids"], 1.0)
        assert torch.allclose(got[k:], want[k:], atol=1e-4, rtol=0)


def test_pause_abort_mode_returns_once_everything_is_aborted(env):
    async def scenario():
        async with EngineClient(env.url) as c:
            long = await start_long(c, env.url, "to-abort", items=8)
            await c.pause_generation("abort")
            aborted_done = long.done()  # SGLang answers once no request holds the model-update lock
            later = asyncio.ensure_future(c.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}))
            await asyncio.sleep(0.5)
            held = later.done()
            await c.continue_generation()
            return aborted_done, await long, held, await later

    aborted_done, long, held, later = asyncio.run(scenario())
    assert aborted_done and {o["meta_info"]["finish_reason"]["type"] for o in long} == {"abort"}
    assert not held and later["meta_info"]["finish_reason"]["type"] == "length"


def test_release_needs_an_idle_engine(env):
    async def scenario():
        async with EngineClient(env.url) as c:
            long = await start_long(c, env.url, "busy-release", items=8)
            refused = post(env.url + "/release_memory_occupation", {"tags": ["weights"]})
            await c.abort(abort_all=True)
            await long
            return refused

    status, out = asyncio.run(scenario())
    assert status == 400 and "only when server is idle" in out["error"]["message"]
    assert info(env.url)["released_tags"] == []


def test_release_really_frees_the_weights_storage(env):
    """No reference to any parameter storage survives a release (torch's StorageWeakRef expires);
    resume allocates them again with NaN content; a load refills them bit for bit."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from dapo_megatron.cpu_engine.engine import CpuEngine

    engine = CpuEngine(str(env.model_a))
    original = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    refs = [StorageWeakRef(p.untyped_storage()) for p in engine.model.parameters()]
    loaded = engine.resident_weight_bytes()
    assert loaded == sum(t.numel() * 4 for t in engine.model.parameters()) > 0
    engine.release(["weights", "kv_cache"])
    gc.collect()
    assert all(ref.expired() for ref in refs) and engine.resident_weight_bytes() == 0
    assert engine.released
    engine.resume(["weights", "kv_cache"])
    assert engine.resident_weight_bytes() == loaded
    assert all(torch.isnan(p).all() for p in engine.model.parameters())
    engine.load_weights(list(original.items()))
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_stale_weight_version_is_counted_and_never_trained_on(env):
    from transformers import AutoTokenizer

    from dapo_megatron.rollout.pool import EnginePool
    from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings

    tokenizer = AutoTokenizer.from_pretrained(env.model_a)
    records = [SimpleNamespace(prompt=f"What is {i} + 1?", ground_truth="2") for i in range(3)]
    settings = RolloutSettings(
        n=2,
        max_new_tokens=4,
        gen_batch_size=3,
        dynamic_sampling=False,
        max_num_gen_batches=1,
        on_exhausted="train",
        overlong_shaping=False,
        progress=False,
    )

    async def scenario():
        pool = EnginePool(urls=[env.url])
        sampler = RolloutSampler(
            pool,
            tokenizer,
            settings,
            rid_prefix="stale",
            reward_fn=lambda text, gt: SimpleNamespace(score=1.0, acc=1.0, pred=None),
        )
        sampler.weight_version = "step_7"  # what the driver last synced; the engine still serves "default"
        result = await sampler.collect(iter(records), train_batch_size=3)
        await pool.close()
        return result

    result = asyncio.run(scenario())
    assert result.groups == [] and result.stats["groups_stale"] == 3 and result.stats["samples_stale"] == 6
    assert result.stats["responses_scored"] == 0
    assert json.loads(json.dumps(result.stats))  # plain numbers: they go to metrics.jsonl

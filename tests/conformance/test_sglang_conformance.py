"""The client against SGLang 0.5.21's own code (sglang_oracle.py: its FastAPI app, request classes,
TokenizerManager methods, SchedulerWeightUpdaterManager, the model runner's WeightUpdater and ServerArgs
parser), and the CPU engine against the same status codes.

What each test asserts:
  - a weight sync (flattened buckets, then one broadcast per tensor) passes SGLang's session rule and
    arrives bit for bit on both TP ranks through SGLang's own receive code; the call sequence and the
    number of collective calls are the expected ones; replies then carry the sync's weight_version;
  - by-tensor syncs send one payload per TP rank, which SGLang's deserialize_own_rank
    (MultiprocessingSerializer, SafeUnpickler) reads into the exact tensors, across processes;
  - every body the client sends holds only fields of the SGLang request class of its route (SGLang's
    schema silently drops unknown fields) and is accepted;
  - the sampler's per-sample items keep our rids through SGLang's normalisation, while SGLang gives the
    samples of an n > 1 request fresh rids (why aborts must name samples);
  - SGLang's ServerArgs parser reads the launcher's command line as intended;
  - the CPU engine answers the same status codes as SGLang to the same requests.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.rollout.pool import EnginePool
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command
from dapo_megatron.transfer.tensor_payload import ALLOWED_GLOBALS, CUDA_DATA_GLOBALS, CUDA_GLOBALS
from dapo_megatron.transfer.weight_sync import DistributedWeightSync, TensorWeightSync
from sglang_pins import CONTEXT_LENGTH, ORACLE_TP_SIZE


def call(url: str, path: str, body=None, method: str = "POST"):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
            return resp.status, (
                json.loads(raw) if resp.headers.get_content_type() == "application/json" and raw else raw
            )
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def oracle_log(url: str) -> list[dict]:
    return call(url, "/oracle/log", method="GET")[1]


def reset(url: str) -> None:
    call(url, "/oracle/reset_log", {})


def trainer_weights(model_dir, *, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The engines' checkpoint after a made-up update: every tensor changed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def assert_oracle_holds(url: str, weights: list[tuple[str, torch.Tensor]]) -> None:
    for rank in range(ORACLE_TP_SIZE):
        params = call(url, f"/oracle/weights?rank={rank}", method="GET")[1]["params"]
        for name, tensor in weights:
            got = params[name]
            assert got["shape"] == list(tensor.shape) and got["dtype"] == "float32", name
            # bit for bit: the bytes SGLang's receive path stored equal the trainer's
            assert base64.b64decode(got["b64"]) == tensor.contiguous().view(torch.uint8).numpy().tobytes(), (rank, name)


def http_calls(log: list[dict]) -> list[tuple[str, int]]:
    return [(e["path"], e["status"]) for e in log if e["event"] == "http"]


@pytest.mark.parametrize("flattened", [True, False])
def test_distributed_sync_passes_sglang_session_rule_and_arrives_bit_exact(oracle, tiny_model, flattened):
    weights = trainer_weights(tiny_model, seed=1 + int(flattened))
    version = f"step_{2 + int(flattened)}"
    reset(oracle)

    async def scenario():
        async with EngineClient(oracle) as client:
            sync = DistributedWeightSync(backend="gloo", bucket_bytes=64 * 1024, flattened=flattened, timeout_s=120)
            stats = await sync.sync([client], iter(weights), weight_version=version)
            reply = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
            await sync.close([client])
            return stats, reply

    stats, reply = asyncio.run(scenario())
    assert_oracle_holds(oracle, weights)
    calls = http_calls(oracle_log(oracle))
    updates = [c for c in calls if c[0] == "/update_weights_from_distributed"]
    # the group first (TP 2: world size 1 + 2), then one session around every bucket
    assert [p for p, _ in calls] == (
        ["/server_info", "/init_weights_update_group", "/model_info", "/begin_weight_update"]
        + ["/update_weights_from_distributed"] * len(updates)
        + ["/end_weight_update", "/generate", "/destroy_weights_update_group"]
    )
    assert all(status == 200 for _, status in calls), calls
    assert stats.num_buckets == len(updates) > 3 and stats.num_tensors == len(weights)
    # one collective per bucket when flattened, one per tensor otherwise
    assert stats.num_collectives == (len(updates) if flattened else len(weights))
    bodies = [e["body"] for e in oracle_log(oracle) if e.get("path") == "/update_weights_from_distributed"]
    assert all(
        b["load_format"] == ("flattened_bucket" if flattened else None)
        and b["weight_version"] == version
        and b["flush_cache"] is True
        for b in bodies
    )
    init = next(e["body"] for e in oracle_log(oracle) if e.get("path") == "/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"], init["master_address"]) == (1, 1 + ORACLE_TP_SIZE, "127.0.0.1")
    assert reply["meta_info"]["weight_version"] == version  # SGLang's config_value("weight_version")


def test_tensor_sync_one_payload_per_rank_read_by_sglang_across_processes(oracle, tiny_model):
    weights = trainer_weights(tiny_model, seed=7)
    reset(oracle)

    async def scenario():
        async with EngineClient(oracle) as client:
            return await TensorWeightSync(bucket_bytes=100_000).sync([client], iter(weights), weight_version="step_9")

    stats = asyncio.run(scenario())
    assert_oracle_holds(oracle, weights)  # SGLang's SafeUnpickler opened our shared-memory segments
    log = oracle_log(oracle)
    bodies = [e["body"] for e in log if e.get("path") == "/update_weights_from_tensor"]
    assert len(bodies) == stats.num_buckets > 1
    assert all(len(b["serialized_named_tensors"]) == ORACLE_TP_SIZE for b in bodies)  # one entry per TP rank
    assert [c[0] for c in http_calls(log)][-2 - len(bodies) :] == (
        ["/begin_weight_update"] + ["/update_weights_from_tensor"] * len(bodies) + ["/end_weight_update"]
    )
    sglang_allowed = {tuple(g) for g in call(oracle, "/oracle/safe_unpickler_globals", method="GET")[1]}
    assert sglang_allowed >= ALLOWED_GLOBALS, ALLOWED_GLOBALS - sglang_allowed
    assert sglang_allowed >= CUDA_GLOBALS, (
        CUDA_GLOBALS - sglang_allowed
    )  # CUDA IPC rebuilds (serve-rollout --device cuda)
    assert sglang_allowed >= CUDA_DATA_GLOBALS, CUDA_DATA_GLOBALS - sglang_allowed


def test_sglang_refuses_updates_outside_a_session(oracle):
    """What today's main client hit first: it never opened a session."""

    async def scenario():
        async with EngineClient(oracle) as client:
            with pytest.raises(EngineError) as outside:
                await client.update_weights_from_distributed(
                    names=["lm_head.weight"], dtypes=["float32"], shapes=[[300, 64]], group_name="none"
                )
            await client.begin_weight_update()
            with pytest.raises(EngineError) as twice:
                await client.begin_weight_update()
            await client.end_weight_update()
            with pytest.raises(EngineError) as unopened:
                await client.end_weight_update()
            return outside.value, twice.value, unopened.value

    outside, twice, unopened = asyncio.run(scenario())
    assert outside.status == 400 and "must run between begin_weight_update() and end_weight_update()" in str(outside)
    assert twice.status == 400 and "already open" in str(twice)
    assert unopened.status == 400 and "no weight-update session is open" in str(unopened)


def test_sampler_items_keep_our_rids_through_sglang_normalisation(oracle, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    records = [SimpleNamespace(prompt=f"What is {i} + 1?", ground_truth="x") for i in range(3)]
    reset(oracle)

    async def scenario():
        pool = EnginePool(urls=[oracle])
        seeded = await pool.seeds_honoured()  # SGLang's default: sampling_seed is ignored
        settings = RolloutSettings(
            n=4,
            max_new_tokens=5,
            gen_batch_size=3,
            dynamic_sampling=False,
            overlong_shaping=False,
            progress=False,
            per_sample_seeds=seeded,
        )
        sampler = RolloutSampler(
            pool,
            tokenizer,
            settings,
            rid_prefix="conf",
            reward_fn=lambda text, gt: SimpleNamespace(score=1.0, acc=1.0, pred=None),
        )
        sampler.weight_version = (await pool.live_clients()[0].model_info())["weight_version"]
        result = await sampler.collect(iter(records), train_batch_size=3)
        n_request = await pool.live_clients()[0].generate(
            input_ids=[1, 2], rid="parent", sampling_params={"n": 2, "max_new_tokens": 1}
        )
        await pool.close()
        return seeded, result, n_request

    seeded, result, n_request = asyncio.run(scenario())
    assert seeded is False and result.stats["groups_stale"] == 0 and len(result.groups) == 3
    generates = [e for e in oracle_log(oracle) if e["event"] == "generate"]
    ours = generates[:3]
    for k, entry in enumerate(ours):
        assert entry["parallel_sample_num"] == 1 and entry["batch_size"] == 4
        assert [item["rid"] for item in entry["items"]] == [f"conf-{k}-{j}." for j in range(4)]
        assert all("sampling_seed" not in item["sampling_params"] for item in entry["items"])
    # n > 1 with rid "parent": SGLang's own regenerate_rid names each sample; none is ours
    ids = [o["meta_info"]["id"] for o in n_request]
    assert len(ids) == 2 and not {"parent", "parent_0", "parent_1"} & set(ids)
    assert generates[-1]["parallel_sample_num"] == 2


def test_every_body_is_an_sglang_request_class_and_accepted(oracle, tiny_model):
    fields = call(oracle, "/oracle/request_fields", method="GET")[1]
    reset(oracle)

    async def scenario():
        async with EngineClient(oracle) as c:
            await c.generate(
                input_ids=[[1, 2], [1, 2]],
                rid=["a-0-0.", "a-0-1."],
                return_logprob=True,
                sampling_params=[
                    {
                        "n": 1,
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "top_k": -1,
                        "max_new_tokens": 3,
                        "stop_token_ids": [2],
                        "sampling_seed": 5,
                    }
                ]
                * 2,
            )
            await c.abort("a-0-0.")
            await c.abort(abort_all=True)
            await c.flush_cache()
            await c.release_memory(["weights", "kv_cache"])
            await c.resume_memory(["weights", "kv_cache"])
            await c.pause_generation("retract")
            await c.continue_generation()
            await c.pause_generation("abort")
            await c.continue_generation()
            await c.update_weights_from_disk(str(tiny_model), weight_version="disk")
            await c.get_weights_by_name("lm_head.weight", truncate_size=2)
            assert await c.health()
            return await c.server_info(), await c.model_info()

    info, model = asyncio.run(scenario())
    posted = [e for e in oracle_log(oracle) if e["event"] == "http" and e["method"] == "POST"]
    assert {e["path"] for e in posted} >= {
        "/generate",
        "/abort_request",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/get_weights_by_name",
    }
    for e in posted:
        assert e["status"] == 200, e
        if e["path"] in fields and e["body"]:
            assert set(e["body"]) <= set(fields[e["path"]]), (e["path"], set(e["body"]) - set(fields[e["path"]]))
    released = next(e for e in oracle_log(oracle) if e["event"] == "release_memory_occupation")
    assert released["body"]["tags"] == ["weights", "kv_cache"]
    # the keys the client reads exist in SGLang's replies
    assert info["tp_size"] == ORACLE_TP_SIZE and info["enable_deterministic_inference"] is False
    assert info["context_length"] == CONTEXT_LENGTH and model["model_path"] == str(tiny_model)


def test_launcher_command_line_is_parsed_by_sglang_server_args(oracle):
    settings = SGLangSettings(
        model_path="/ckpt/qwen",
        tp_size=4,
        context_length=22528,
        mem_fraction_static=0.55,
        colocate=True,
        seed=42,
        host="0.0.0.0",
        port=31000,
        base_gpu_id=4,
        python="python3",
    )
    argv = sglang_command(settings)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    want = {
        "model_path": "/ckpt/qwen",
        "tp_size": 4,
        "context_length": 22528,
        "mem_fraction_static": 0.55,
        "random_seed": 42,
        "enable_memory_saver": True,
        "host": "0.0.0.0",
        "port": 31000,
        "dtype": "auto",
        "base_gpu_id": 4,
    }
    status, parsed = call(oracle, "/oracle/server_args", {"argv": argv[3:], "fields": sorted(want)})
    assert status == 200 and parsed == want


BAD_OR_EDGE_REQUESTS = [
    # (path, body, what SGLang answers: the CPU engine must answer the same status)
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}}, 400),  # context
    ("/generate", {"input_ids": list(range(1, CONTEXT_LENGTH + 1))}, 400),  # prompt alone too long
    ("/generate", {"input_ids": [1], "sampling_params": {"temprature": 1.0}}, 500),  # SamplingParams TypeError
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0.0}}, 400),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1.0}}, 400),
    ("/generate", {"input_ids": []}, 400),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, 400),  # one rid per prompt
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a", "a"]}, 400),  # duplicate rids
    ("/generate", {"input_ids": [[1], [2]], "return_logprob": [True, False], "sampling_params": {"n": 2}}, 400),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, 400),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "some_new_field": 1}, 200),  # ignored
    ("/abort_request", {"rid": "nobody"}, 200),  # unknown rid: silently nothing
    ("/abort_request", {}, 200),
    ("/end_weight_update", {}, 400),  # no session
    ("/update_weights_from_tensor", {"serialized_named_tensors": []}, 400),  # no session
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, 400),  # no session
    ("/destroy_weights_update_group", {"group_name": "nope"}, 400),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, 400),  # missing fields
    ("/flush_cache", None, 200),  # idle
    ("/pause_generation", {"mode": "in_place"}, 200),
    ("/continue_generation", {}, 200),
]


def test_cpu_engine_answers_sglang_status_codes(oracle, cpu_engine):
    got = {}
    for path, body, want in BAD_OR_EDGE_REQUESTS:
        sglang_status, _ = call(oracle, path, body)
        cpu_status, cpu_body = call(cpu_engine, path, body)
        got[path, json.dumps(body)[:60]] = (sglang_status, cpu_status)
        assert sglang_status == want, (path, body, sglang_status)
    mismatches = {k: v for k, v in got.items() if v[0] != v[1]}
    # the one documented difference (docs/sglang.md): SGLang's uncaught TypeError is a 500, the CPU engine
    # answers a client's unknown sampling parameter with 400 (no client input is a 5xx there)
    unknown_param = ("/generate", json.dumps({"input_ids": [1], "sampling_params": {"temprature": 1.0}})[:60])
    assert mismatches.pop(unknown_param, None) == (500, 400), got
    assert not mismatches, mismatches
    # the keys the client reads from /server_info exist in both engines' answers
    for url in (oracle, cpu_engine):
        info = call(url, "/server_info", method="GET")[1]
        assert {"tp_size", "enable_deterministic_inference", "context_length", "weight_version"} <= set(info)
        assert info["context_length"] == CONTEXT_LENGTH


def test_cuda_ipc_rebuild_twin_reads_the_device_where_sglang_does():
    """The CPU engine on a GPU opens SGLang's uuid-patched CUDA IPC handles with its own function
    (tensor_payload._rebuild_cuda_tensor_from_uuid): the device argument's position and the rule
    (an int as is, a uuid looked up among the visible GPUs) are read from SGLang's patch_torch.py."""
    import ast
    import importlib.util

    from dapo_megatron.transfer import tensor_payload

    sglang_dir = importlib.util.find_spec("sglang").submodule_search_locations[0]
    source = Path(sglang_dir, "srt/utils/patch_torch.py").read_text()
    tree = ast.parse(source)
    consts = {
        n.targets[0].id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)
    }
    assert consts["_REDUCE_TENSOR_ARG_DEVICE_INDEX"] == tensor_payload._DEVICE_ARG
    funcs = {n.name: ast.unparse(n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert (
        "_modify_tuple(args, _REDUCE_TENSOR_ARG_DEVICE_INDEX, _device_from_maybe_uuid)"
        in funcs["_rebuild_cuda_tensor_modified"]
    )
    assert (
        "if isinstance(device_maybe_uuid, int):\n        return device_maybe_uuid" in funcs["_device_from_maybe_uuid"]
    )
    assert "torch.cuda.get_device_properties(device).uuid" in funcs["_device_from_maybe_uuid"]
    assert tensor_payload._device_index(3) == 3

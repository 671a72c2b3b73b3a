"""A real `dapo-megatron serve-rollout` process on 127.0.0.1 serving a tiny Qwen2 (fp32), checked
against transformers' own forward pass."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest
import torch

from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from rollout_helpers import PROMPT, ServerProcess, generate, get_json, make_tiny_checkpoint, post, reference_logprobs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_server")
    return {
        "a": make_tiny_checkpoint(root / "model_a", seed=0),
        "b": make_tiny_checkpoint(root / "model_b", seed=1),
        "root": root,
    }


@pytest.fixture(scope="module")
def server(ckpts):
    proc = ServerProcess(ckpts["a"], ckpts["root"] / "engines", log_path=ckpts["root"] / "server.log")
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def hf_models(ckpts):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(ckpts[k], dtype=torch.float32).eval() for k in ("a", "b")}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_of_sampled_tokens_match_transformers(server, hf_models, temperature):
    sent = time.time()
    out = generate(
        server.url,
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={"max_new_tokens": 24, "temperature": temperature, "sampling_seed": 3, "ignore_eos": True},
    )
    replied = time.time()
    # the engine's own stamps, as SGLang sends them (--enable-metrics): inside our send .. reply window
    meta = out["meta_info"]
    assert sent <= meta["request_received_ts"] <= meta["request_received_ts"] + meta["e2e_latency"] <= replied
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    tokens = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    assert tokens == out["output_ids"] and len(tokens) == 24
    want = reference_logprobs(hf_models["a"], PROMPT, out["output_ids"], temperature)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert out["meta_info"]["prompt_tokens"] == len(PROMPT) and out["meta_info"]["completion_tokens"] == 24


def test_batched_padded_requests_match_transformers(server, hf_models):
    """Prompts of different lengths share one left-padded decode; each row still matches its own forward."""
    prompts = [PROMPT, [1, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    outs = generate(
        server.url,
        input_ids=prompts,
        return_logprob=True,
        sampling_params={"max_new_tokens": 12, "sampling_seed": 11, "ignore_eos": True},
    )
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        want = reference_logprobs(hf_models["a"], prompt, out["output_ids"], 1.0)
        assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_seeds_follow_sglang_deterministic_inference(server):
    """As SGLang with --enable-deterministic-inference: the n samples of one request share its seed
    (identical samples, each with a fresh uuid rid), so per-sample seeds need per-sample items."""
    params = {"max_new_tokens": 16, "sampling_seed": 100, "ignore_eos": True}
    shared = generate(server.url, input_ids=PROMPT, sampling_params={**params, "n": 3}, rid="parent")
    assert len(shared) == 3 and len({tuple(o["output_ids"]) for o in shared}) == 1
    assert len({o["meta_info"]["id"] for o in shared}) == 3 and "parent" not in {o["meta_info"]["id"] for o in shared}
    items = generate(
        server.url,
        input_ids=[PROMPT] * 3,
        rid=["s-0.", "s-1.", "s-2."],
        sampling_params=[{**params, "sampling_seed": 100 + j} for j in range(3)],
    )
    assert [o["meta_info"]["id"] for o in items] == ["s-0.", "s-1.", "s-2."]
    assert len({tuple(o["output_ids"]) for o in items}) == 3  # distinct samples
    assert items[0]["output_ids"] == shared[0]["output_ids"]  # seed 100 draws the same either way
    again = generate(
        server.url, input_ids=[PROMPT] * 3, sampling_params=[{**params, "sampling_seed": 100 + j} for j in range(3)]
    )
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in items]  # reproducible


def test_batch_with_n_is_prompt_major(server):
    outs = generate(
        server.url, input_ids=[PROMPT, [1, 9, 9]], sampling_params={"max_new_tokens": 4, "n": 2, "temperature": 0.0}
    )
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(PROMPT), len(PROMPT), 3, 3]


def test_greedy_and_top_k_1_agree_with_argmax(server, hf_models):
    greedy = generate(
        server.url,
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    )
    topk1 = generate(
        server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "top_k": 1, "ignore_eos": True}
    )
    ids = list(PROMPT)
    for _ in range(8):
        with torch.no_grad():
            ids.append(int(hf_models["a"](torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy["output_ids"] == ids[len(PROMPT) :] == topk1["output_ids"]
    # greedy reports the raw distribution's log-prob (T = 1), like SGLang
    want = reference_logprobs(hf_models["a"], PROMPT, greedy["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_stop_token_ids_and_eos(server):
    base = generate(
        server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    )
    stop = base["output_ids"][3]
    first = base["output_ids"].index(stop)  # the first occurrence ends the generation
    out = generate(
        server.url,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 10, "temperature": 0.0, "stop_token_ids": [stop], "ignore_eos": True},
    )
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # eos (id 2 in the tiny config) ends a sample unless ignore_eos: find seeds whose sample meets it
    # (p(eos) ~ 1/300 per token), then the same seed with ignore_eos continues past it
    params = [{"max_new_tokens": 64, "sampling_seed": j} for j in range(16)]
    outs = generate(server.url, input_ids=[PROMPT] * 16, sampling_params=params)
    stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "no sample met eos; pick another seed"
    for o in outs:
        fr = o["meta_info"]["finish_reason"]
        if fr["type"] == "stop":
            assert fr["matched"] == 2 and o["output_ids"][-1] == 2 and 2 not in o["output_ids"][:-1]
        else:
            assert fr == {"type": "length", "length": 64} and 2 not in o["output_ids"]
    longer = generate(server.url, input_ids=[PROMPT] * 16, sampling_params=[{**p, "ignore_eos": True} for p in params])
    for o, long in zip(outs, longer):
        assert long["output_ids"][: len(o["output_ids"])] == o["output_ids"] and len(long["output_ids"]) == 64


def test_text_prompt_is_tokenized(server, ckpts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts["a"])
    text = "What is 12 + 30?"
    a = generate(server.url, text=text, sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    b = generate(
        server.url,
        input_ids=tok(text, add_special_tokens=False)["input_ids"],
        sampling_params={"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    )
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == tok.decode(a["output_ids"], skip_special_tokens=True)


@pytest.mark.parametrize(
    "body, field, status",
    [
        (b"{not json", "body", 400),
        ([1, 2], "body", 400),
        ({"sampling_params": {}}, "text/input_ids", 400),
        ({"input_ids": [1, 2], "text": "x"}, "text/input_ids", 400),
        ({"input_ids": []}, "input_ids", 400),
        ({"input_ids": [1, 300]}, "input_ids[1]", 400),
        ({"input_ids": [1, "a"]}, "input_ids[1]", 400),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature", 400),
        ({"input_ids": [1], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", 400),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k", 400),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n", 400),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens", 400),
        (
            {"input_ids": [1], "sampling_params": {"stop_token_ids": [1, 9999]}},
            "sampling_params.stop_token_ids[1]",
            400,
        ),
        (
            {"input_ids": [1], "sampling_params": {"temprature": 1.0}},
            "sampling_params.temprature",
            400,
        ),  # SGLang: 500 (CPU: a client error)
        ({"input_ids": [1], "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop", 400),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params", 400),
        ({"input_ids": [1], "rid": 5}, "rid", 400),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 256}}, "input_ids", 400),  # beyond the context length
    ],
)
def test_malformed_generate_is_refused_naming_the_field(server, body, field, status):
    got, out = post(server.url + "/generate", body)
    assert got == status
    assert out["error"]["field"] == field and field in out["error"]["message"]


def test_malformed_admin_requests_are_400_and_server_lives(server):
    cases = [
        ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"]}, "shapes", "missing"),
        (
            "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
            None,
            "must run between begin_weight_update() and end_weight_update()",
        ),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, None, "must run between"),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2, "backend": "gloo"},
            "rank_offset",
            "rank_offset",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
            "backend",
            "gloo",
        ),
        ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, "model_path", "no such directory"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all", "wrong type"),
        ("/get_weights_by_name", {"name": "no.such.weight"}, "name", "unknown parameter"),
        ("/resume_memory_occupation", {"tags": ["weights"]}, "tags", "not released"),
        ("/end_weight_update", {}, None, "no weight-update session is open"),
        ("/pause_generation", {"mode": "sometimes"}, "mode", "abort, retract or in_place"),
    ]
    for path, body, field, words in cases:
        status, out = post(server.url + path, body)
        assert status == 400, (path, out)
        assert out["error"]["field"] == field and words in out["message"], (path, out)
    # inside a session a bad payload is refused naming the entry
    assert post(server.url + "/begin_weight_update", {})[0] == 200
    status, out = post(server.url + "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]})
    assert status == 400 and out["error"]["field"] == "serialized_named_tensors[0]" and "base64" in out["message"]
    assert post(server.url + "/end_weight_update", {})[0] == 200
    with urllib.request.urlopen(server.url + "/health_generate", timeout=60) as resp:
        assert resp.status == 200
    generate(server.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})


def test_abort_running_request(server):
    async def scenario():
        async with EngineClient(server.url) as c:
            task = asyncio.ensure_future(
                c.generate(
                    input_ids=PROMPT, rid="long-one", sampling_params={"max_new_tokens": 240, "ignore_eos": True}
                )
            )
            while not any(
                r["rid"] == "long-one" and r["completion_tokens"] > 0
                for r in (await c.server_info())["cpu_engine"]["running"]
            ):
                assert not task.done(), "the request finished before it was seen running"
                await asyncio.sleep(0.02)
            await c.pause_generation("in_place")  # holds it mid-generation: the abort cannot come too late
            await c.abort("long-one")
            out = await task
            await c.continue_generation()
            return out, await c.server_info()

    out, info = asyncio.run(scenario())
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }  # SGLang's FINISH_ABORT of a running request
    assert 0 < out["meta_info"]["completion_tokens"] < 240
    assert "long-one" in info["cpu_engine"]["aborted_rids"]


def test_release_resume_and_weight_updates(server, hf_models, ckpts):
    """SGLang's semantics without a CPU backup: release frees the weights, resume brings storage back
    with undefined content (NaN here), and a sync refills them."""
    params = {"max_new_tokens": 10, "sampling_seed": 5, "ignore_eos": True}
    before = generate(server.url, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    resident = get_json(server.url + "/server_info")["cpu_engine"]["resident_memory_bytes"]
    assert resident["weights"] == sum(t.numel() * 4 for t in hf_models["a"].parameters())
    assert post(server.url + "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
    info = get_json(server.url + "/server_info")["cpu_engine"]
    assert info["resident_memory_bytes"] == {"weights": 0, "kv_cache": 0}
    assert info["released_tags"] == ["kv_cache", "weights"]
    status, out = post(server.url + "/generate", {"input_ids": PROMPT})
    assert status == 409 and "released" in out["error"]["message"]  # a 4xx saying why, never a 5xx
    assert status_of(server.url + "/health") == status_of(server.url + "/ready") == 503
    assert post(server.url + "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}) == (200, None)
    name = "model.layers.0.mlp.up_proj.weight"
    assert all(x != x for x in get_json_post(server.url, name)[0])  # NaN: the content did not survive
    # resumed but not synced: still refused (it once answered 500 "probability tensor contains inf, nan")
    status, out = post(server.url + "/generate", {"input_ids": PROMPT})
    assert status == 409 and "not been written" in out["error"]["message"], out
    assert status_of(server.url + "/health") == status_of(server.url + "/ready") == 503

    # by tensor (shared memory on CPU), in a session: model a again, a wrong shape refused first
    named = list(hf_models["a"].state_dict().items())
    bad = named[:3] + [(named[3][0], torch.zeros(7, 7))]
    assert post(server.url + "/begin_weight_update", {})[0] == 200
    status, out = post(
        server.url + "/update_weights_from_tensor", {"serialized_named_tensors": [serialize_for_engine_rank(bad)]}
    )
    assert status == 400 and named[3][0] in out["error"]["message"] and "shape" in out["error"]["message"]
    # half the tensors: the rest still hold NaN, so generation stays refused
    assert (
        post(
            server.url + "/update_weights_from_tensor",
            {"serialized_named_tensors": [serialize_for_engine_rank(named[:2])]},
        )[0]
        == 200
    )
    status, out = post(server.url + "/generate", {"input_ids": PROMPT})
    left = len({t.data_ptr() for _, t in named}) - len({t.data_ptr() for _, t in named[:2]})  # tied: one region
    assert status == 409 and f"{left} parameter tensors" in out["error"]["message"], (left, out)
    status, out = post(
        server.url + "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize_for_engine_rank(named)], "weight_version": "refilled"},
    )
    assert status == 200 and out["message"] == "Success Weight version updated to refilled.", out
    assert post(server.url + "/end_weight_update", {})[0] == 200
    assert status_of(server.url + "/health") == status_of(server.url + "/ready") == 200  # every tensor written
    again = generate(server.url, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    assert again["meta_info"]["weight_version"] == "refilled"
    assert (
        get_json(server.url + "/server_info")["cpu_engine"]["resident_memory_bytes"]["weights"] == resident["weights"]
    )

    # from disk (no session needed): model b, then logprobs follow model b
    status, out = post(server.url + "/update_weights_from_disk", {"model_path": str(ckpts["b"]), "weight_version": "b"})
    assert status == 200 and out["success"]
    out_b = generate(server.url, input_ids=PROMPT, sampling_params=params, return_logprob=True)
    got = torch.tensor([lp for lp, _, _ in out_b["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    assert torch.allclose(got, reference_logprobs(hf_models["b"], PROMPT, out_b["output_ids"], 1.0), atol=1e-4, rtol=0)
    assert out_b["meta_info"]["weight_version"] == "b"
    assert get_json(server.url + "/model_info")["model_path"] == str(ckpts["b"])
    assert get_json(server.url + "/get_model_info")["weight_version"] == "b"  # the deprecated alias


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def get_json_post(url: str, name: str):
    status, out = post(url + "/get_weights_by_name", {"name": name, "truncate_size": 100})
    assert status == 200, out
    return out


def test_client_raises_engine_error_with_status(server):
    async def scenario():
        async with EngineClient(server.url) as c:
            with pytest.raises(EngineError) as info:
                await c.generate(input_ids=[1], sampling_params={"n": -1})
            return info.value

    err = asyncio.run(scenario())
    assert err.status == 400 and "sampling_params.n" in str(err)

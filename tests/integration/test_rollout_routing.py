"""Routed experts from a real `dapo-megatron serve-rollout` serving a tiny Qwen3-MoE: the experts the
engine reports for every processed token (prompt + output - 1 rows, SGLang's shape and base64 int32
format) are the ones transformers' router picks in a plain forward of the same tokens; a dense layer
reports zeros; routed_experts_start_len, bad fields and weight updates by per-expert names behave as
SGLang's do."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import torch

from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.rollout.routing import decode_routed_experts, encode_routed_experts, routed_experts_of
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from helpers_tiny import save_tiny_hf
from rollout_helpers import ServerProcess, generate, get_json, post

PROMPT = [1, 17, 42, 99, 7, 250]
NUM_LAYERS, TOPK = 3, 2  # tiny Qwen3-MoE: layers 0 and 2 sparse, layer 1 dense (mlp_only_layers)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_tiny_hf(
        tmp_path_factory.mktemp("moe_engine") / "qwen3_moe", arch="qwen3_moe", num_layers=NUM_LAYERS, seed=3
    )


@pytest.fixture(scope="module")
def server(moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_server")
    proc = ServerProcess(moe_dir, root / "engines", log_path=root / "server.log")
    yield proc
    proc.kill()


def router_topk(moe_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, topk] experts of transformers' routers in one forward of `ids` (zeros for
    the dense layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    out = torch.zeros(len(ids), NUM_LAYERS, TOPK, dtype=torch.long)

    def keep(layer):
        def hook(module, args, output):  # returns None: the router's output is left as is
            out[:, layer] = output[2].reshape(len(ids), TOPK)

        return hook

    hooks = [
        layer.mlp.gate.register_forward_hook(keep(i))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return out


def test_engine_experts_are_transformers_routers_choice(server, moe_dir):
    outs = generate(
        server.url,
        input_ids=[PROMPT, PROMPT[:3]],
        return_routed_experts=True,
        return_logprob=True,
        sampling_params={"n": 2, "max_new_tokens": 7, "temperature": 1.0, "sampling_seed": 5},
    )
    assert len(outs) == 4  # batched, padded (prompts of 6 and 3 tokens), two samples each
    used = set()
    for k, out in enumerate(outs):
        prompt = PROMPT if k < 2 else PROMPT[:3]
        ids = prompt + out["output_ids"]
        raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
        assert raw.size == (len(ids) - 1) * NUM_LAYERS * TOPK  # SGLang: seqlen - 1 rows of [layers, topk]
        engine = torch.from_numpy(raw.copy()).view(len(ids) - 1, NUM_LAYERS, TOPK).long()
        want = router_topk(moe_dir, ids)[:-1]  # the last token is never fed to the model
        assert torch.equal(engine.sort(-1).values, want.sort(-1).values), f"sample {k}"
        assert (engine[:, 1] == 0).all()  # dense layer 1: nothing routed
        used |= set(engine[:, [0, 2]].flatten().tolist())
    assert used == {0, 1, 2, 3}  # every expert was chosen somewhere: the comparison is not vacuous


def test_start_len_and_absence(server):
    full = generate(
        server.url,
        input_ids=PROMPT,
        return_routed_experts=True,
        sampling_params={"max_new_tokens": 4, "temperature": 0.0},
    )
    tail = generate(
        server.url,
        input_ids=PROMPT,
        return_routed_experts=True,
        routed_experts_start_len=len(PROMPT),
        sampling_params={"max_new_tokens": 4, "temperature": 0.0},
    )
    assert full["output_ids"] == tail["output_ids"]
    num_out = len(full["output_ids"])
    rows = decode_routed_experts(full["meta_info"]["routed_experts"], num_rows=len(PROMPT) + num_out - 1, where="t")
    tail_rows = decode_routed_experts(tail["meta_info"]["routed_experts"], num_rows=num_out - 1, where="t")
    assert torch.equal(rows[len(PROMPT) :], tail_rows)
    plain = generate(server.url, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert "routed_experts" not in plain["meta_info"]  # not asked: not sent (SGLang's behaviour)


def test_experts_survive_a_retract_pause(server, moe_dir):
    """A retract pause drops the KV cache; on continue the engine re-prefills prompt + output so far.
    The experts it reports must still be one row per processed token, the router's choice for it."""

    async def scenario():
        async with EngineClient(server.url) as c:
            task = asyncio.ensure_future(
                c.generate(
                    input_ids=PROMPT,
                    rid="moe-retract",
                    return_routed_experts=True,
                    sampling_params={"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0},
                )
            )
            while not any(
                r["rid"] == "moe-retract" and r["completion_tokens"] >= 3
                for r in (await c.server_info())["cpu_engine"]["running"]
            ):
                assert not task.done(), "finished before it was seen running"
                await asyncio.sleep(0.02)
            await c.pause_generation("retract")
            paused_mid_generation = not task.done()
            await c.continue_generation()
            return await task, paused_mid_generation

    out, paused_mid_generation = asyncio.run(scenario())
    assert paused_mid_generation and len(out["output_ids"]) == 200
    ids = PROMPT + out["output_ids"]
    engine = decode_routed_experts(out["meta_info"]["routed_experts"], num_rows=len(ids) - 1, where="retract")
    engine = engine.long().view(len(ids) - 1, NUM_LAYERS, TOPK)
    want = router_topk(moe_dir, ids)[:-1]
    assert torch.equal(engine.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"input_ids": PROMPT, "return_routed_experts": "yes"}, "return_routed_experts"),
        (
            {"input_ids": PROMPT, "return_routed_experts": True, "routed_experts_start_len": -1},
            "routed_experts_start_len",
        ),
    ],
)
def test_bad_routing_fields_are_400_naming_them(server, body, field):
    status, out = post(server.url + "/generate", body)
    assert status == 400 and out["error"]["field"] == field


def test_weights_are_named_per_expert_and_update_the_fused_parameters(server, moe_dir):
    params = get_json(server.url + "/get_model_info")["parameters"]
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert params[name]["shape"] == [32, 64] and "model.layers.2.mlp.experts.gate_up_proj" not in params
    new = torch.full((32, 64), 0.5)
    assert post(server.url + "/begin_weight_update", {})[0] == 200  # SGLang: updates only inside a session
    status, out = post(
        server.url + "/update_weights_from_tensor",
        {"serialized_named_tensors": [serialize_for_engine_rank([(name, new)])]},
    )
    assert status == 200, out
    assert post(server.url + "/end_weight_update", {})[0] == 200
    status, values = post(server.url + "/get_weights_by_name", {"name": name, "truncate_size": 2})
    assert status == 200 and values == [[0.5] * 64] * 2
    status, gate = post(
        server.url + "/get_weights_by_name",
        {"name": "model.layers.2.mlp.experts.3.gate_proj.weight", "truncate_size": 1},
    )
    assert gate[0] != [0.5] * 64  # the gate half of the same fused row block is untouched


def test_wire_format_round_trip_and_size_check():
    rows = torch.randint(0, 128, (5, 48, 8))
    decoded = decode_routed_experts(encode_routed_experts(rows), num_rows=5, where="r")
    assert decoded.dtype == torch.uint8 and torch.equal(decoded.long().view(5, 48, 8), rows)
    wide = torch.randint(0, 300, (2, 4, 2))
    assert decode_routed_experts(encode_routed_experts(wide), num_rows=2, where="r").dtype == torch.int16
    with pytest.raises(ValueError, match="request 7: meta_info.routed_experts holds 40 ids"):
        decode_routed_experts(encode_routed_experts(torch.zeros(5, 4, 2)), num_rows=3, where="request 7")
    out = {
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "meta_info": {"routed_experts": encode_routed_experts(torch.ones(4, 3, 2))},
    }
    assert routed_experts_of(out, where="x").shape == (4, 6)
    assert routed_experts_of({"meta_info": {}}, where="x") is None

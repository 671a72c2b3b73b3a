"""actor/fake_quant.py without ranks: the fake-quantized Megatron shards equal, bit for bit, the
dequantized block-FP8 weights Fp8SyncConverter sends (TP=1, and TP=2 with the amax grids reduced by
hand as the MAX all-reduce does); modelopt's QAT fake-quant op would not give those bits; the gradient
is straight-through; actor.quantization_aware is validated. The same equality on real gloo ranks, through
the Linears' forward: tests/distributed/test_actor_fake_quant.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

from dapo_megatron.actor.fake_quant import (
    local_block_amax,
    shard_blocks,  # noqa: E402
    values_from_amax,
)
from dapo_megatron.quant.fp8_format import BLOCK, dequantize_block_fp8  # noqa: E402
from dapo_megatron.quant.fp8_sync import Fp8SyncConverter  # noqa: E402
from dapo_megatron.weights.mapping import Dims, expected_hf_shapes, map_param, merge_shards, shard_for_rank  # noqa: E402

# (hidden, intermediate, heads, kv heads): the tiny run's model (q/k/v one block each: modelopt's shared
# amax; gate/up two blocks; at TP=2 one 128-row block spans both ranks), a model whose dims are not
# multiples of 128 (partial blocks, blocks cut by TP in rows and columns) and one where gate/up are one
# block each too
SHAPES = [(128, 256, 4, 2), (320, 384, 4, 2), (64, 128, 4, 2)]
LINEARS = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)


def _dims(hidden, inter, heads, kv):
    from transformers import Qwen2Config

    return Dims.from_hf(
        Qwen2Config(
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            num_hidden_layers=1,
            vocab_size=300,
        )
    )


def _hf_weights(dims, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_hf_shapes(dims).items():
        if name.endswith("proj.weight"):
            # columns of different magnitude so that the blocks' amax differ; one zero block in down_proj
            # (modelopt's export substitutes amax 448 there)
            w = torch.randn(*shape, generator=gen) * torch.logspace(-3, -1, shape[1])
            if "down_proj" in name and shape[1] > BLOCK:
                w[:BLOCK, BLOCK : 2 * BLOCK] = 0
            weights[name] = w
    return weights


def _engine_values(weights):
    """What the engines multiply by: dequantize_block_fp8 of what the converter sends."""
    modules = {n.removesuffix(".weight") for n in weights}
    conv = Fp8SyncConverter(quantized_modules=modules, dtype=torch.bfloat16, block=BLOCK, ignored_layers=[])
    sent = dict(conv.convert(weights.items()))
    return {n: dequantize_block_fp8(sent[n], sent[n.removesuffix("weight") + "weight_scale_inv"]) for n in weights}


def _trainer_values(weights, dims, tp):
    """Every TP rank's Megatron shard fake-quantized (amax grids MAX-reduced over the ranks), merged back."""
    shapes = expected_hf_shapes(dims)
    out = {}
    for suffix in LINEARS:
        pmap = map_param(f"decoder.layers.0.{suffix}", layer_offset=0, dims=dims)
        hf = [weights[n] for n in pmap.hf_names]
        shards = [shard_for_rank(pmap.kind, hf, tp_rank=r, tp_size=tp, dims=dims) for r in range(tp)]
        blocks = [
            shard_blocks(pmap, [shapes[n] for n in pmap.hf_names], dims=dims, tp_rank=r, tp_size=tp, block=BLOCK)
            for r in range(tp)
        ]
        amax = torch.stack([local_block_amax(s.to(torch.bfloat16), b) for s, b in zip(shards, blocks)]).amax(0)
        fq = [values_from_amax(s.to(torch.bfloat16), b, amax) for s, b in zip(shards, blocks)]
        out.update(zip(pmap.hf_names, merge_shards(pmap.kind, fq, dims=dims)))
        assert blocks[0].shared_amax == (
            pmap.kind in ("qkv", "fc1") and all(shapes[n][0] <= BLOCK and shapes[n][1] <= BLOCK for n in pmap.hf_names)
        )
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tp", [1, 2])
def test_fake_quantized_shards_equal_the_engine_values_bit_for_bit(shape, tp):
    dims = _dims(*shape)
    weights = _hf_weights(dims, seed=sum(shape) + tp)
    engine = _engine_values(weights)
    trainer = _trainer_values(weights, dims, tp)
    assert set(trainer) == set(engine)
    for name in engine:
        assert trainer[name].dtype == torch.float32
        assert torch.equal(trainer[name], engine[name]), name
        assert not torch.equal(trainer[name], weights[name])  # it is quantized


def test_modelopt_qat_fake_quant_op_does_not_give_the_engine_bits():
    """modelopt's fake-quant op (tensor_quant.scaled_e4m3, what a TensorQuantizer runs in its forward)
    with the same block amax scales by 448/amax and back by 1/(448/amax); the engine divides by and
    multiplies with amax/448. Measured here: most elements differ in the last bits (not a tolerance
    question: bit equality is the requirement), so fake_quant.py calls modelopt's export quantizer
    (FP8QTensor.quantize / dequantize) instead."""
    from modelopt.torch.quantization.tensor_quant import scaled_e4m3

    dims = _dims(*SHAPES[1])
    weights = _hf_weights(dims, seed=3)
    engine = _engine_values(weights)
    trainer = _trainer_values(weights, dims, 1)
    differ = total = 0
    for name, w in weights.items():
        wq = w.to(torch.bfloat16).float()
        n, k = w.shape
        padded = torch.nn.functional.pad(wq.abs(), (0, -k % BLOCK, 0, -n % BLOCK))
        amax = padded.reshape(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax(dim=(1, 3))
        amax = torch.where(amax == 0, torch.full_like(amax, 448.0), amax)
        full = amax.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        qat_op = scaled_e4m3(wq, full, None, 4, 3)
        differ += int((qat_op != engine[name]).sum())
        total += w.numel()
        assert torch.equal(trainer[name], engine[name])
        assert (qat_op - engine[name]).abs().max() <= engine[name].abs().max() * 2**-3  # same grid, other bits
    assert differ > total // 4, (differ, total)


def test_straight_through_gradient():
    dims = _dims(*SHAPES[0])
    pmap = map_param("decoder.layers.0.mlp.linear_fc1.weight", layer_offset=0, dims=dims)
    shapes = expected_hf_shapes(dims)
    blocks = shard_blocks(pmap, [shapes[n] for n in pmap.hf_names], dims=dims, tp_rank=0, tp_size=1, block=BLOCK)
    from dapo_megatron.actor.fake_quant import fake_quant_weight

    w = torch.nn.Parameter(torch.randn(2 * dims.ffn, dims.hidden) * 0.05)
    g = torch.randn_like(w)
    fq = fake_quant_weight(w, blocks, dtype=torch.bfloat16)
    (fq * g).sum().backward()
    assert torch.equal(w.grad, g) and not torch.equal(fq, w)
    with torch.no_grad():  # the log-prob pass: same values, and the flag megatron's linear branches on
        again = fake_quant_weight(w, blocks, dtype=torch.bfloat16)
    assert again.requires_grad and torch.equal(again, fq.detach())


def test_quantization_aware_key_is_validated():
    from dapo_megatron.config import config_from_dict

    with pytest.raises(ValueError, match=r"actor\.quantization_aware.*attention_backend=torch.*'te'"):
        config_from_dict({"rollout": {"quantization": "fp8"}, "actor": {"quantization_aware": True}})
    cfg = config_from_dict(
        {"rollout": {"quantization": "fp8"}, "actor": {"quantization_aware": True, "attention_backend": "torch"}}
    )
    assert cfg.actor.quantization_aware is True
    assert config_from_dict({}).actor.quantization_aware is False
    # the cross-section rule alone (the actor section's own rules run first: attention_backend=torch here)
    with pytest.raises(ValueError, match=r"actor\.quantization_aware.*rollout\.quantization=fp8.*'none'"):
        config_from_dict({"actor": {"quantization_aware": True, "attention_backend": "torch"}})
    with pytest.raises(ValueError, match=r"actor\.quantization_aware.*expected true or false"):
        config_from_dict({"rollout": {"quantization": "fp8"}, "actor": {"quantization_aware": "yes"}})

"""Quantization-aware forward on real gloo ranks (actor/fake_quant.py, docs/fp8.md).

(a) The weight every FP8 Linear multiplies by inside Megatron's forward (recorded by a pre-hook that runs
    after ours), gathered over TP and merged to HF tensors, equals dequantize_block_fp8 of what
    Fp8SyncConverter sends the engines for the same weights, bit for bit as fp32 values: TP=1, TP=2 and
    TP=2 with sequence parallel; on the tiny run's shape (q/k/v one block each, modelopt's shared amax;
    a 128-row block of gate/up spanning both TP ranks) and on dims that are not multiples of 128. After
    the forward the modules hold their Parameters again, unchanged.
(c) With quantize_inputs (the actor's setting), the input every FP8 Linear multiplies, gathered over TP
    (row-parallel Linears split their input channels; sequence parallel splits the tokens), equals the
    engines' quantization of the whole unquantized input (quant/fp8_activation.py, checked against
    SGLang's kernel in tests/conformance), bit for bit: TP=1, TP=2 (a 128-channel group spans both
    ranks of linear_proj and linear_fc2) and TP=2 with sequence parallel.
(b) The gradient w.r.t. the master weights of a fixed loss (a weighted sum of next-token log-probs)
    equals, at TP=1 and TP=2, the gradient of the same loss in a float64 transformers model whose FP8
    Linears hold the (constant) engine values: the straight-through estimator.
"""

from __future__ import annotations

import pytest
import torch

from helpers_tiny import save_tiny_hf

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

TINY_RUN = dict(hidden_size=128, intermediate_size=256)  # 4 heads of 32, 2 KV heads: configs/runs/tiny_cpu.yaml
ODD = dict(hidden_size=320, intermediate_size=384)  # heads of 80: partial blocks, blocks cut by TP
SEQ = 16


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_quant")
    return {
        "tiny_run": save_tiny_hf(root / "tiny_run", shape=TINY_RUN, seed=4),
        "odd": save_tiny_hf(root / "odd", shape=ODD, seed=5),
    }


def _fp8_modules(hf_config) -> set[str]:
    """What modelopt's recipe quantizes: every Linear of the decoder layers (the export's weight_scale_inv)."""
    from dapo_megatron.weights.mapping import Dims, expected_hf_shapes

    return {n.removesuffix(".weight") for n in expected_hf_shapes(Dims.from_hf(hf_config)) if n.endswith("proj.weight")}


def _merged(local: torch.Tensor, pmap, dims) -> list[torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dapo_megatron.weights.mapping import merge_shards

    tp = parallel_state.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return merge_shards(pmap.kind, parts, dims=dims)


def _build(hf_dir, layout, sequence_parallel, quantize_inputs=False):
    from transformers import AutoConfig

    from dapo_megatron.actor.fake_quant import apply_weight_fake_quant
    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.weights.load import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model_chunks(
        hf_config, attention_backend="torch", precision="fp32", sequence_parallel=sequence_parallel
    )
    load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
    apply_weight_fake_quant(
        chunks,
        hf_config,
        layout,
        quantized_modules=_fp8_modules(hf_config),
        block=128,
        dtype=torch.bfloat16,
        quantize_inputs=quantize_inputs,
    )
    return hf_config, chunks


def _tokens(vocab):
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, vocab, (1, SEQ), generator=gen)


def _values_on_rank(hf_dir, tp, sequence_parallel):
    from megatron.core import parallel_state

    from dapo_megatron.actor.fake_quant import quantized_linears
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.quant.fp8_format import dequantize_block_fp8
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter
    from dapo_megatron.weights import iter_hf_weights
    from dapo_megatron.weights.mapping import Dims

    with model_parallel(tp=tp, seed=0) as layout:
        hf_config, chunks = _build(hf_dir, layout, sequence_parallel)
        dims = Dims.from_hf(hf_config)
        linears = quantized_linears(
            chunks,
            hf_config,
            quantized_modules=_fp8_modules(hf_config),
            block=128,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=tp,
        )
        seen, masters = {}, {}
        for module, pmap, _ in linears:
            masters[pmap.mcore_name] = (module.weight, module.weight.detach().clone())

            def record(mod, args, pmap=pmap):
                seen[pmap.mcore_name] = (pmap, mod.weight.detach().clone(), isinstance(mod.weight, torch.nn.Parameter))

            module.register_forward_pre_hook(record)  # after fake_quant's pre-hook: sees what forward uses
        tokens = _tokens(hf_config.vocab_size)
        with torch.no_grad():
            chunks[0](tokens, torch.arange(SEQ)[None], None)
        trainer = {}
        for pmap, local, is_param in seen.values():
            assert not is_param
            trainer.update(zip(pmap.hf_names, _merged(local, pmap, dims)))
        conv = Fp8SyncConverter(
            quantized_modules=_fp8_modules(hf_config), dtype=torch.bfloat16, block=128, ignored_layers=[]
        )
        sent = dict(conv.convert(iter_hf_weights(chunks, hf_config, layout=layout)))
        engine = {
            n: dequantize_block_fp8(sent[n], sent[n.removesuffix("weight") + "weight_scale_inv"])
            for n in sent
            if sent[n].dtype == torch.float8_e4m3fn
        }
        restored = all(
            isinstance(m.weight, torch.nn.Parameter) and m.weight is p and torch.equal(p, before)
            for (m, pmap, _), (p, before) in zip(linears, masters.values())
        )
        return {"trainer": trainer, "engine": engine, "restored": restored, "num_linears": len(linears)}


@pytest.mark.parametrize("model,tp,sp", [("tiny_run", 1, False), ("tiny_run", 2, False), ("odd", 2, True)])
def test_forward_weights_equal_dequantized_engine_weights_bit_for_bit(rank_pool, hf_dirs, model, tp, sp):
    results = rank_pool(2).run(_values_on_rank, str(hf_dirs[model]), tp, sp)
    for res in results:
        assert res["restored"]
        assert res["num_linears"] == 2 * 4  # 2 layers x linear_qkv, linear_proj, linear_fc1, linear_fc2
        assert set(res["trainer"]) == set(res["engine"]) and len(res["engine"]) == 2 * 7
        for name, value in res["engine"].items():
            assert res["trainer"][name].dtype == torch.float32
            assert torch.equal(res["trainer"][name], value), name


def _gather_input(x, *, kind, sequence_parallel):
    """The whole input of a Linear from the TP ranks' parts: row-parallel Linears split the channels (the
    last dim); with sequence parallel a column-parallel Linear's pre-hook sees a shard of the tokens."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or (kind != "row" and not sequence_parallel):
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1 if kind == "row" else 0)


def _inputs_on_rank(hf_dir, tp, sequence_parallel):
    from megatron.core import parallel_state

    from dapo_megatron.actor.fake_quant import quantized_linears
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.quant.fp8_activation import fake_quant_activation_fp8

    with model_parallel(tp=tp, seed=0) as layout:
        hf_config, chunks = _build(hf_dir, layout, sequence_parallel, quantize_inputs=True)
        linears = quantized_linears(
            chunks,
            hf_config,
            quantized_modules=_fp8_modules(hf_config),
            block=128,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=tp,
        )
        raw, seen = {}, {}
        for module, pmap, _ in linears:

            def before(mod, args, name=pmap.mcore_name):
                raw[name] = args[0].detach().clone()

            def after(mod, args, name=pmap.mcore_name):
                seen[name] = args[0].detach().clone()

            module.register_forward_pre_hook(before, prepend=True)  # before fake_quant's: the raw input
            module.register_forward_pre_hook(after)  # after it: what the Linear multiplies
        tokens = _tokens(hf_config.vocab_size)
        with torch.no_grad():
            chunks[0](tokens, torch.arange(SEQ)[None], None)
        out = {}
        for _, pmap, _ in linears:
            name = pmap.mcore_name
            whole_raw = _gather_input(raw[name], kind=pmap.kind, sequence_parallel=sequence_parallel)
            whole_seen = _gather_input(seen[name], kind=pmap.kind, sequence_parallel=sequence_parallel)
            out[name] = (whole_seen, fake_quant_activation_fp8(whole_raw), whole_raw)
        return out


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_linear_inputs_equal_the_engines_fp8_activations_bit_for_bit(rank_pool, hf_dirs, tp, sp):
    results = rank_pool(2).run(_inputs_on_rank, str(hf_dirs["tiny_run"]), tp, sp)
    for res in results:
        assert len(res) == 2 * 4
        for name, (seen, engine, whole_raw) in res.items():
            assert seen.shape[-1] % 128 == 0 and seen.shape[0] == SEQ, (name, seen.shape)
            assert torch.equal(seen, engine), name
            assert not torch.equal(seen, whole_raw), name  # the quantization really happened


def _grads_on_rank(hf_dir, tp, coef):
    from megatron.core import parallel_state

    from dapo_megatron.actor.fake_quant import quantized_linears
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.tools.parity import vocab_parallel_logprobs
    from dapo_megatron.weights.mapping import Dims

    with model_parallel(tp=tp, seed=0) as layout:
        hf_config, chunks = _build(hf_dir, layout, False)
        tokens = _tokens(hf_config.vocab_size)
        logits = chunks[0](tokens, torch.arange(SEQ)[None], None)  # [1, S, V_pad / tp]
        logprobs = vocab_parallel_logprobs(
            logits[0, :-1], tokens[0, 1:], vocab_size=hf_config.vocab_size, tp_rank=layout.tp_rank
        )
        (logprobs * coef).sum().backward()
        grads = {}
        linears = quantized_linears(
            chunks,
            hf_config,
            quantized_modules=_fp8_modules(hf_config),
            block=128,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=tp,
        )
        for module, pmap, _ in linears:
            grads.update(zip(pmap.hf_names, _merged(module.weight.grad, pmap, Dims.from_hf(hf_config))))
        return {"grads": grads, "logprobs": logprobs.detach()}


def _reference(hf_dir, coef, *, quantized: bool):
    """float64 transformers: the same loss, FP8 Linears holding the engine values (constants) or not."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.quant.fp8_format import dequantize_block_fp8
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64)
    state = {n: t.float() for n, t in model.state_dict().items()}
    modules = _fp8_modules(model.config)
    if quantized:
        conv = Fp8SyncConverter(quantized_modules=modules, dtype=torch.bfloat16, block=128, ignored_layers=[])
        sent = dict(conv.convert((n, state[n]) for n in sorted(state)))
        with torch.no_grad():
            for m in modules:
                model.get_submodule(m).weight.copy_(
                    dequantize_block_fp8(sent[f"{m}.weight"], sent[f"{m}.weight_scale_inv"])
                )
    tokens = _tokens(model.config.vocab_size)
    logp = torch.log_softmax(model(tokens).logits[0, :-1], dim=-1)
    logprobs = logp.gather(-1, tokens[0, 1:, None])[:, 0]
    (logprobs * coef.double()).sum().backward()
    return {f"{m}.weight": model.get_submodule(m).weight.grad for m in modules}, logprobs.detach()


@pytest.mark.parametrize("tp", [1, 2])
def test_straight_through_gradient_equals_float64_model_of_the_engine_weights(rank_pool, hf_dirs, tp):
    coef = torch.linspace(-1.0, 1.5, SEQ - 1)
    hf_dir = str(hf_dirs["tiny_run"])
    res = rank_pool(2).run(_grads_on_rank, hf_dir, tp, coef)[0]
    ref_grads, ref_lp = _reference(hf_dir, coef, quantized=True)
    plain_grads, plain_lp = _reference(hf_dir, coef, quantized=False)
    # the forward is the engine-weight model's: fp32 rounding (these random log-probs are about -9) ...
    lp_err = float((res["logprobs"].double() - ref_lp).abs().max())
    # ... while the unquantized model's are off by FP8's weight error
    lp_off = float((plain_lp - ref_lp).abs().max())
    print(f"tp={tp}: log-prob err {lp_err:.2e}, unquantized model off by {lp_off:.2e}")
    assert lp_err < 5e-5 and lp_off > 100 * lp_err
    for name, ref in ref_grads.items():
        scale = ref.abs().max()
        err = float((res["grads"][name].double() - ref).abs().max() / scale)
        off = float((plain_grads[name] - ref).abs().max() / scale)
        print(f"  {name}: grad err {err:.2e} (relative to max |grad|), unquantized off by {off:.2e}")
        assert err < 1e-4, (name, err)
        assert off > 30 * err, (name, off, err)  # the unquantized model's gradient is far off: the test can tell

"""The CPU compatibility layer: its patch targets still exist in the installed megatron-core, and
inside ranks (where it is applied) CUDA placement, RNG and type checks behave as on a GPU.

The patches are applied only in the pool's rank processes, never in the pytest process itself
(the TorchFunctionMode would otherwise leak into every other test).
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor import compat


def test_patch_targets_still_exist_in_installed_megatron():
    problems = compat.check_patch_targets()
    assert not problems, "megatron-core moved symbols the CPU compat layer patches:\n" + "\n".join(problems)


def test_check_patch_targets_names_a_missing_symbol(monkeypatch):
    monkeypatch.setattr(
        compat,
        "PATCH_TARGETS",
        compat.PATCH_TARGETS + (("megatron.core.tensor_parallel.random", "_no_such_symbol", "a test"),),
    )
    problems = compat.check_patch_targets()
    assert len(problems) == 1
    assert "megatron.core.tensor_parallel.random._no_such_symbol" in problems[0]
    assert "random.py" in problems[0]  # names the file to look at


def _cpu_behaviour():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    compat.apply_cpu_compat()  # second call: must not push a second mode
    modes = torch.overrides._get_current_function_mode_stack()
    out = {
        "num_modes": sum(isinstance(m, compat._CudaToCpuMode) for m in modes),
        "device_kw": torch.zeros(2, device="cuda").device.type,
        "device_idx": torch.zeros(2, device="cuda:0").device.type,
        "dot_cuda": torch.ones(2).cuda().device.type,
        "to_cuda": torch.ones(2).to("cuda").device.type,
        "to_dtype": torch.ones(2).to(torch.float64).dtype,
        "pinned": torch.empty(2, pin_memory=True).is_pinned(),
        "types": (
            torch.ones(1).type(),
            torch.ones(1, dtype=torch.bfloat16).type(),
            torch.ones(1).type(torch.float64).dtype,
        ),
        "current_device": str(torch.cuda.current_device()),
    }
    # RNG: the tracker's fork() must use and restore the (CPU) default generator like on CUDA.
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("test-stream", 1234)
    torch.manual_seed(7)
    expected_default = torch.rand(4)
    torch.manual_seed(7)
    with tracker.fork("test-stream"):
        forked_1 = torch.rand(4)
    after_fork = torch.rand(4)  # default stream continues as if fork() never happened
    with tracker.fork("test-stream"):
        forked_2 = torch.rand(4)  # the tracked stream advanced
    torch.manual_seed(1234)
    seeded_ref = torch.rand(4)
    out.update(
        after_fork_equal=torch.equal(after_fork, expected_default),
        forked_is_seed_stream=torch.equal(forked_1, seeded_ref),
        forked_advances=not torch.equal(forked_1, forked_2),
    )
    tracker.reset()
    out.update(_moe_behaviour())
    return out


def _moe_behaviour():
    """The MoE dispatcher's CUDA stream/event calls and gloo's all-to-all with tensor split sizes."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.current_stream())
        event = stream.record_event()
    event.synchronize()
    torch.cuda.Event().synchronize()
    # rank r sends r*10 + [0..r] to rank 0 and r*10 + [r+1..2] to rank 1: uneven splits given as a
    # tensor and a numpy array (what the dispatcher holds on CPU)
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.arange(3, dtype=torch.float32) + 10 * rank
    input_splits = torch.tensor([rank + 1, 2 - rank])
    counts = [[r + 1, 2 - r] for r in range(world)]  # counts[src][dst]
    output_splits = torch.tensor([counts[src][rank] for src in range(world)]).numpy()
    received = torch.empty(int(output_splits.sum()))
    dist.all_to_all_single(received, send, output_split_sizes=output_splits, input_split_sizes=input_splits)
    return {
        "one_stream": stream is torch.cuda.current_stream() and isinstance(stream, torch.cuda.Stream),
        "te_general_gemm": moe_utils.te_general_gemm,
        "all_to_all": received.tolist(),
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compat layer is a no-op with CUDA")
def test_cpu_behaviour_inside_ranks(rank_pool):
    results = rank_pool(2).run(_cpu_behaviour)
    for out in results:
        assert out["num_modes"] == 1
        assert out["device_kw"] == out["device_idx"] == out["dot_cuda"] == out["to_cuda"] == "cpu"
        assert out["to_dtype"] == torch.float64
        assert out["pinned"] is False
        assert out["types"] == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor", torch.float64)
        assert out["current_device"] == "cpu"
        assert out["after_fork_equal"] and out["forked_is_seed_stream"] and out["forked_advances"]
        assert out["one_stream"] and out["te_general_gemm"] is None
    # rank 0 receives rank 0's first element and rank 1's first two; rank 1 the rest
    assert results[0]["all_to_all"] == [0.0, 10.0, 11.0]
    assert results[1]["all_to_all"] == [1.0, 2.0, 12.0]


def test_moe_router_runs_without_transformer_engine_and_matches_float64(monkeypatch):
    """Without TE, moe_utils never binds te_general_gemm and the router's first forward raised NameError
    (on the H100 too, where the CPU patches are off). bind_missing_te_gemm is applied on every machine;
    the router then computes logits = x W^T (+ b) in the router dtype with megatron's torch path: forward
    and gradients equal a float64 reference."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False):
        pytest.skip("Transformer Engine is installed: its GEMM is used")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen, requires_grad=True)
    w = torch.randn(4, 8, generator=gen, requires_grad=True)
    b = torch.randn(4, generator=gen, requires_grad=True)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(x, w, b, torch.float32)
    compat.bind_missing_te_gemm()
    compat.bind_missing_te_gemm()  # idempotent
    out = moe_utils.router_gating_linear(x, w, b, torch.float32)
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = x64 @ w64.T + b64
    ref.backward(grad_out.double())
    assert out.dtype == torch.float32 and out.shape == (5, 3, 4)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_deferred_compile_compiles_at_the_first_call_with_the_decorators_options():
    calls = []

    def compile_now(fn, **options):
        calls.append((fn.__name__, options))
        return lambda x: fn(x) * 10  # "compiled": tells its results apart from the plain function's

    deferred = compat._deferred_compile(compile_now)

    def double(x):
        return 2 * x

    plain = deferred(double)
    with_options = deferred(dynamic=True, fullgraph=False)(double)
    assert calls == [] and plain.__name__ == "double" and plain.__wrapped__ is double
    assert plain(3) == 60 and plain(4) == 80  # compiled once, at the first call, then reused
    assert with_options(1) == 20
    assert calls == [("double", {}), ("double", {"dynamic": True, "fullgraph": False})]


def test_megatron_imports_on_cpu_without_torchs_compiler():
    """In a fresh process (the pytest process may have imported megatron already): megatron.core and
    its fused functions import without torch._dynamo / inductor, jit_fuser stays the deferred compile,
    and torch.compile is torch's own again after the import."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from dapo_megatron.actor.compat import apply_megatron_compat\n"
        "apply_megatron_compat()\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules,\n"
        "      jit.jit_fuser.__qualname__, torch.compile is real, bias_swiglu.__wrapped__.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "_deferred_compile.<locals>.deferred", "True", "bias_swiglu"]

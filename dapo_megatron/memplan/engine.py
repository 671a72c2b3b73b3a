"""Rollout engine memory per GPU: SGLang's static pool (weights + KV cache) and its runtime reserve.

    e = engine_memory(dims, engine_tp=4, mem_fraction_static=0.7, gpu_bytes=80 << 30)
    e.weights, e.kv_cache, e.kv_tokens, e.runtime

SGLang's definitions (sglang 0.5.21, srt/arg_groups/memory_hook.py:58-67): mem_fraction_static is
(model weights + KV cache pool) / GPU memory capacity; what is left is for activations and CUDA-graph
buffers, which SGLang estimates as
    reserved_MB = 512 + 1.5 * chunked_prefill_size + tp_size / 8 * 1024 + 2 * cuda_graph_max_bs
with, on a 60-160 GiB GPU, chunked_prefill_size 8192 and max_bs 256 (tp < 4) or 512 (:131-158, :296-306,
reserve_for_graph_mb :350-362). The KV pool is what the static pool leaves after the weights
(model_executor/pool_configurator.py: tokens = available bytes // cell size), one cell per token =
K and V of every layer for this TP rank's KV heads (replicated when engine_tp > kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.memplan.arch import ModelDims
from dapo_megatron.memplan.static import fp8_bytes, linear_params, total_params

GIB = 1 << 30
ENGINE_CONTEXT_BYTES = GIB // 2  # CUDA context of a released engine process (allowance, not measured here)


@dataclass(frozen=True)
class EngineMemory:
    weights: int  # bytes of one engine TP rank's weights
    static_pool: int  # mem_fraction_static * GPU memory
    kv_cache: int  # static_pool - weights (0 if negative)
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV pool of one engine holds (every TP rank holds its heads of all of them)
    runtime: int  # SGLang's activation + CUDA-graph reserve outside the static pool


def sglang_runtime_reserve(*, gpu_bytes: int, engine_tp: int) -> int:
    """SGLang's own estimate of its non-static memory (see the module docstring)."""
    gpu_mb = gpu_bytes / (1 << 20)
    if gpu_mb < 60 * 1024:
        chunked_prefill = 4096
    elif gpu_mb < 160 * 1024:
        chunked_prefill = 8192
    else:
        chunked_prefill = 16384
    max_bs = 256 if engine_tp < 4 else 512
    reserved_mb = 512 + 1.5 * chunked_prefill + engine_tp / 8 * 1024 + 2 * max_bs
    return int(reserved_mb * (1 << 20))


def engine_weight_bytes(dims: ModelDims, *, engine_tp: int, fp8: bool = False) -> int:
    """One TP rank's weights: everything split over TP except what SGLang replicates: the norms (QK-norms
    too) and, for Qwen3-MoE, each sparse layer's router (srt/models/qwen3_moe.py: the gate is a
    ReplicatedLinear; the experts are split over the engine's TP ranks by its fused-MoE layer). With fp8
    (rollout.quantization=fp8) every transformer Linear is held in block FP8 (static.linear_params)."""
    replicated = (2 * dims.layers + 1) * dims.hidden
    if dims.qk_norm:
        replicated += 2 * dims.layers * dims.head_dim
    replicated += dims.num_sparse_layers * dims.num_experts * dims.hidden
    linear = linear_params(dims) if fp8 else 0
    split = (total_params(dims) - replicated - linear) * dims.dtype_bytes + fp8_bytes(linear) * fp8
    return int(split / engine_tp + replicated * dims.dtype_bytes)


def kv_bytes_per_token(dims: ModelDims, *, engine_tp: int) -> int:
    heads_per_rank = max(1, dims.kv_heads // engine_tp)
    return 2 * dims.layers * heads_per_rank * dims.head_dim * dims.dtype_bytes


def engine_memory(
    dims: ModelDims, *, engine_tp: int, mem_fraction_static: float, gpu_bytes: int, fp8: bool = False
) -> EngineMemory:
    weights = engine_weight_bytes(dims, engine_tp=engine_tp, fp8=fp8)
    pool = int(mem_fraction_static * gpu_bytes)
    kv = max(0, pool - weights)
    per_token = kv_bytes_per_token(dims, engine_tp=engine_tp)
    return EngineMemory(
        weights=weights,
        static_pool=pool,
        kv_cache=kv,
        kv_bytes_per_token=per_token,
        kv_tokens=kv // per_token,
        runtime=sglang_runtime_reserve(gpu_bytes=gpu_bytes, engine_tp=engine_tp),
    )

"""Static per-GPU memory of the actor: parameters, the DDP gradient buffer, the optimizer state.

    layout = Layout(tp=8, pp=2, cp=1, dp=8, vpp=None, sequence_parallel=True)
    s = static_bytes(dims, layout, precision="bf16", distributed_optimizer=True, pp_rank=0, dp_rank=3)
    s.weights, s.grads, s.main_params, s.adam          # bytes on that GPU

These are exact, not estimates: they replay what megatron-core 0.16.1 allocates for the actor
(actor/actor.py builds GPTModel chunks, wraps each in DistributedDataParallel with
grad_reduce_in_fp32=True and overlap_grad_reduce=False, then get_megatron_optimizer), and
tests/distributed/test_memplan_static.py compares every number with the real objects on gloo ranks.

What megatron allocates (file:line of megatron/core in 0.16.1):
- Parameters: one per tensor of this rank's chunks, split over TP (vocab-parallel embedding and LM
  head, column-parallel QKV/fc1, row-parallel proj/fc2; norms replicated). The first pipeline stage
  holds the word embeddings, the last the final norm and the LM head (with tied embeddings and
  PP > 1 the last stage keeps its own copy, `output_layer.weight`; with PP = 1 it has none).
- DDP gradient buffer (distributed/param_and_grad_buffer.py:591-806): one flat fp32 buffer per chunk
  (grad_reduce_in_fp32). overlap_grad_reduce=False makes bucket_size None (distributed_data_parallel
  .py:66-68): one bucket, except that with the distributed optimizer a shared (tied, PP > 1)
  embedding gets a bucket of its own (:698-710). Walking the parameters in reverse, each one starts
  at a multiple of 64 elements and each bucket ends at a multiple of lcm(DP*CP, 128) (:635-665) when
  the distributed optimizer is on; without it, no padding at all.
- With the distributed optimizer the parameters are re-homed into a parameter buffer of the same
  padded layout in the parameter dtype (:795-835); without it each parameter keeps its own storage.
- Distributed optimizer (optimizer/distrib_optimizer.py:320-420): data-parallel rank r (of the DP*CP
  group) owns the slice [r*n/dp, (r+1)*n/dp) of every bucket; for each parameter piece in its slice it
  keeps an fp32 master copy (bf16/fp16 models; fp32 models use a view) and Adam's exp_avg and
  exp_avg_sq (fp32). Without it (Float16OptimizerWithFloat16Params / FP32Optimizer) every rank keeps
  them for all of its parameters.
- Mixture of experts (Qwen3-MoE): a sparse layer holds the router (TopKRouter.weight [E, h], replicated
  over TP, transformer/moe/router.py:53) and its E / EP local experts (SequentialMLP on CPU, TE's
  grouped GEMM on GPUs: the same tensors, fc1 [2 F_e / ETP, h] and fc2 [h, F_e / ETP] each,
  transformer/moe/experts.py). With EP > 1 the expert weights carry allreduce=False (tensor_parallel/
  layers.py:886, expert_parallel = expert_model_parallel_size > 1): DDP puts them in buffers of their
  own over the expert-data-parallel group (distributed_data_parallel.py:109-125, 295-302), of size
  EDP = world / (ETP * EP * PP) (parallel_state.py:788-791), and get_megatron_optimizer builds a second
  distributed optimizer over that group (optimizer/__init__.py:640-680): the same padding and slicing
  rules with EDP in place of DP * CP. With EP = 1 the experts are ordinary parameters of the dense buffer.
- Adam's `step` is a host scalar per parameter in torch's AdamW (not capturable) and a per-group
  scalar in TE/apex FusedAdam: no GPU memory, not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dapo_megatron.memplan.arch import ModelDims

PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4  # DistributedDataParallelConfig(grad_reduce_in_fp32=True) in actor.py
MASTER_BYTES = 4  # fp32 main parameters of a bf16/fp16 model
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32


@dataclass(frozen=True)
class Layout:
    """The actor's parallel layout: world = tp * pp * cp * dp."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    ep: int = 1  # expert model parallel (actor.ep)
    etp: int | None = None  # expert tensor parallel (actor.etp; None = tp, megatron's default)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel group: world / (ETP * EP * PP) (parallel_state.py:788-791)."""
        return self.world // (self.expert_tp * self.ep * self.pp)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def dp_shards(self) -> int:
        """Megatron's DDP buffers and the distributed optimizer use the DP x CP group."""
        return self.dp * self.cp


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    shared_embedding: bool = False  # LanguageModule marks the tied copies when PP > 1
    expert_parallel: bool = False  # allreduce=False: the expert-data-parallel buffer and optimizer


def check_layout(dims: ModelDims, layout: Layout) -> None:
    """ValueError for layouts megatron (or the actor) refuses, naming the config key."""
    tp = layout.tp
    checks = [
        ("attention heads", dims.heads, "num_attention_heads"),
        ("KV heads", dims.kv_heads, "num_key_value_heads"),
        ("vocabulary", dims.vocab, "vocab_size"),
    ]
    if dims.num_sparse_layers < dims.layers:  # some layer has a dense MLP (an all-MoE model never builds one)
        checks.append(("FFN width", dims.ffn, "intermediate_size"))
    for what, value, key in checks:
        if value % tp:
            raise ValueError(f"actor.tp={tp} must divide the model's {what} ({key}={value}, {dims.source})")
    if dims.is_moe:
        if dims.num_experts % layout.ep:
            raise ValueError(
                f"actor.ep={layout.ep} must divide the number of experts num_experts={dims.num_experts} ({dims.source})"
            )
        if dims.moe_ffn % layout.expert_tp:
            raise ValueError(
                f"actor.etp={layout.expert_tp} must divide each expert's width "
                f"moe_intermediate_size={dims.moe_ffn} ({dims.source})"
            )
        if layout.world % (layout.expert_tp * layout.ep * layout.pp):
            raise ValueError(
                f"actor.world_size={layout.world} must be a multiple of etp*ep*pp = "
                f"{layout.expert_tp}*{layout.ep}*{layout.pp}"
            )
    elif layout.ep > 1:
        raise ValueError(f"actor.ep={layout.ep}: expert parallelism needs a mixture-of-experts model ({dims.source})")
    per = layout.pp * layout.chunks
    if dims.layers % per:
        raise ValueError(f"actor.pp * actor.vpp = {per} must divide num_hidden_layers={dims.layers} ({dims.source})")


def layers_per_chunk(dims: ModelDims, layout: Layout) -> int:
    return dims.layers // (layout.pp * layout.chunks)


def chunk_params(dims: ModelDims, layout: Layout, *, pp_rank: int, vp_stage: int = 0) -> list[Param]:
    """This chunk's parameters, in GPTModel's named_parameters() order (local layer spec)."""
    tp, h = layout.tp, dims.hidden
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == layout.pp - 1 and vp_stage == layout.chunks - 1
    params: list[Param] = []
    if pre:
        params.append(
            Param("embedding.word_embeddings.weight", dims.vocab // tp * h, shared_embedding=dims.tied and not post)
        )
    qkv_rows = (dims.q_width + 2 * dims.kv_width) // tp
    per_chunk = layers_per_chunk(dims, layout)
    first_layer = (vp_stage * layout.pp + pp_rank) * per_chunk  # megatron's layer offset (interleaved order)
    for i in range(per_chunk):
        prefix = f"decoder.layers.{i}."
        params += [
            Param(prefix + "input_layernorm.weight", h),
            Param(prefix + "self_attention.linear_proj.weight", h * dims.q_width // tp),
            Param(prefix + "self_attention.linear_qkv.weight", qkv_rows * h),
        ]
        if dims.qkv_bias:
            params.append(Param(prefix + "self_attention.linear_qkv.bias", qkv_rows))
        if dims.qk_norm:  # one RMSNorm weight of head_dim for all query heads, one for all key heads
            params += [
                Param(prefix + "self_attention.q_layernorm.weight", dims.head_dim),
                Param(prefix + "self_attention.k_layernorm.weight", dims.head_dim),
            ]
        params.append(Param(prefix + "pre_mlp_layernorm.weight", h))
        if dims.is_sparse(first_layer + i):
            params += _moe_params(dims, layout, prefix=prefix + "mlp.")
        else:
            params += [
                Param(prefix + "mlp.linear_fc1.weight", 2 * dims.ffn // tp * h),
                Param(prefix + "mlp.linear_fc2.weight", h * dims.ffn // tp),
            ]
    if post:
        params.append(Param("decoder.final_layernorm.weight", h))
        if not dims.tied or not pre:  # tied and PP = 1: the LM head IS the embedding (no parameter)
            params.append(Param("output_layer.weight", dims.vocab // tp * h, shared_embedding=dims.tied))
    return params


def _moe_params(dims: ModelDims, layout: Layout, *, prefix: str) -> list[Param]:
    """A sparse layer's MoE MLP on one rank: the router, then this EP rank's experts (SequentialMLP order)."""
    h, width = dims.hidden, dims.moe_ffn // layout.expert_tp
    expert = layout.ep > 1  # allreduce=False only with expert parallelism (tensor_parallel/layers.py:829, 886)
    params = [Param(prefix + "router.weight", dims.num_experts * h)]
    for e in range(dims.num_experts // layout.ep):
        params += [
            Param(prefix + f"experts.local_experts.{e}.linear_fc1.weight", 2 * width * h, expert_parallel=expert),
            Param(prefix + f"experts.local_experts.{e}.linear_fc2.weight", h * width, expert_parallel=expert),
        ]
    return params


@dataclass
class Bucket:
    start: int
    end: int  # padded
    pieces: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each parameter


def buffer_buckets(params: list[Param], *, dp_shards: int, distributed_optimizer: bool) -> list[Bucket]:
    """The DDP buffer's buckets (bucket_size None), laid out like _ParamAndGradBuffer does."""
    align = 64 if distributed_optimizer else 1
    bucket_multiple = math.lcm(dp_shards, 128) if distributed_optimizer else 1

    def up(n: int, multiple: int) -> int:
        return -(-n // multiple) * multiple

    buckets: list[Bucket] = []
    current = Bucket(0, 0)
    pos = 0
    for param in reversed(params):  # megatron walks the parameters in reverse (backprop order)
        pos = up(pos, align)
        own_bucket = param.shared_embedding and distributed_optimizer
        if own_bucket and current.pieces:
            current.end = up(pos, bucket_multiple)
            buckets.append(current)
            pos = current.end
            current = Bucket(pos, pos)
        current.pieces.append((pos, pos + param.numel))
        pos += param.numel
        if own_bucket:
            current.end = up(pos, bucket_multiple)
            buckets.append(current)
            pos = current.end
            current = Bucket(pos, pos)
    if current.pieces:
        current.end = up(pos, bucket_multiple)
        buckets.append(current)
    return buckets


def owned_numel(buckets: list[Bucket], *, dp_shards: int, dp_rank: int) -> int:
    """Parameter elements in data-parallel rank dp_rank's slice of every bucket (distributed optimizer)."""
    total = 0
    for bucket in buckets:
        size = (bucket.end - bucket.start) // dp_shards
        lo = bucket.start + dp_rank * size
        hi = lo + size
        total += sum(max(0, min(end, hi) - max(start, lo)) for start, end in bucket.pieces)
    return total


@dataclass
class StaticBytes:
    weights: int = 0  # model parameters (the parameter buffer with the distributed optimizer)
    grads: int = 0  # the fp32 DDP gradient buffer (main_grad)
    main_params: int = 0  # fp32 master copies (bf16/fp16)
    adam: int = 0  # exp_avg + exp_avg_sq
    param_numel: int = 0  # parameter elements without padding
    largest_param_numel: int = 0

    @property
    def optimizer(self) -> int:
        return self.main_params + self.adam

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.main_params + self.adam

    def add(self, other: StaticBytes) -> None:
        for name in ("weights", "grads", "main_params", "adam", "param_numel"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.largest_param_numel = max(self.largest_param_numel, other.largest_param_numel)


def _buffer_bytes(
    params: list[Param], *, precision: str, distributed_optimizer: bool, dp_shards: int, dp_rank: int
) -> StaticBytes:
    """One DDP buffer (and its optimizer's state) over a data-parallel group of dp_shards ranks."""
    param_bytes = PARAM_BYTES[precision]
    master = MASTER_BYTES if precision != "fp32" else 0
    numel = sum(p.numel for p in params)
    buckets = buffer_buckets(params, dp_shards=dp_shards, distributed_optimizer=distributed_optimizer)
    buffer_numel = buckets[-1].end if buckets else 0
    if distributed_optimizer:
        owned = owned_numel(buckets, dp_shards=dp_shards, dp_rank=dp_rank)
        out = StaticBytes(
            weights=buffer_numel * param_bytes,
            grads=buffer_numel * GRAD_BYTES,
            main_params=owned * master,
            adam=owned * ADAM_BYTES,
        )
    else:
        out = StaticBytes(
            weights=numel * param_bytes,
            grads=buffer_numel * GRAD_BYTES,
            main_params=numel * master,
            adam=numel * ADAM_BYTES,
        )
    out.param_numel = numel
    out.largest_param_numel = max((p.numel for p in params), default=0)
    return out


def static_bytes(
    dims: ModelDims,
    layout: Layout,
    *,
    precision: str,
    distributed_optimizer: bool,
    pp_rank: int,
    dp_rank: int = 0,
    expert_dp_rank: int = 0,
) -> StaticBytes:
    """Bytes the actor allocates on the GPU of (pipeline rank pp_rank, DP*CP rank dp_rank, expert-data-
    parallel rank expert_dp_rank), all chunks. Expert-parallel weights (EP > 1) form a buffer of their own
    per chunk, sharded over the expert-data-parallel group (see the module docstring)."""
    check_layout(dims, layout)
    out = StaticBytes()
    for vp_stage in range(layout.chunks):
        params = chunk_params(dims, layout, pp_rank=pp_rank, vp_stage=vp_stage)
        out.add(
            _buffer_bytes(
                [p for p in params if not p.expert_parallel],
                precision=precision,
                distributed_optimizer=distributed_optimizer,
                dp_shards=layout.dp_shards,
                dp_rank=dp_rank,
            )
        )
        experts = [p for p in params if p.expert_parallel]
        if experts:
            out.add(
                _buffer_bytes(
                    experts,
                    precision=precision,
                    distributed_optimizer=distributed_optimizer,
                    dp_shards=layout.expert_dp,
                    dp_rank=expert_dp_rank,
                )
            )
    return out


def worst_static(
    dims: ModelDims, layout: Layout, *, precision: str, distributed_optimizer: bool, pp_rank: int
) -> StaticBytes:
    """The DP rank of pipeline stage pp_rank with the most static bytes (ranks differ by padding; the dense
    and expert buffers' worst ranks are taken together: an upper bound by at most the padding)."""

    def at(dp_rank: int, expert_dp_rank: int) -> StaticBytes:
        return static_bytes(
            dims,
            layout,
            precision=precision,
            distributed_optimizer=distributed_optimizer,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            expert_dp_rank=expert_dp_rank,
        )

    ranks = range(layout.dp_shards) if distributed_optimizer else range(1)
    worst_dense = max(ranks, key=lambda r: at(r, 0).total)
    expert_ranks = range(layout.expert_dp) if distributed_optimizer and dims.is_moe and layout.ep > 1 else range(1)
    worst_expert = max(expert_ranks, key=lambda r: at(worst_dense, r).total)
    return at(worst_dense, worst_expert)


def frozen_weight_bytes(dims: ModelDims, layout: Layout, *, precision: str, pp_rank: int) -> int:
    """The KL reference model on one GPU: the same sharding, weights only (no DDP buffer, no optimizer)."""
    return (
        sum(p.numel for v in range(layout.chunks) for p in chunk_params(dims, layout, pp_rank=pp_rank, vp_stage=v))
        * PARAM_BYTES[precision]
    )


def total_params(dims: ModelDims) -> int:
    """Parameters of the whole model (one copy, as in the HF checkpoint)."""
    one = Layout()
    return sum(p.numel for p in chunk_params(dims, one, pp_rank=0))


def expert_params(dims: ModelDims) -> int:
    """Parameters of all experts of all sparse layers (one copy): what expert parallelism shards."""
    return dims.num_sparse_layers * dims.num_experts * 3 * dims.moe_ffn * dims.hidden


def linear_params(dims: ModelDims) -> int:
    """Parameters of every transformer Linear (attention QKV and output, dense MLPs, experts): what modelopt's
    block FP8 export quantizes (the embeddings, LM head, norms and MoE routers stay in the checkpoint dtype)."""
    h = dims.hidden
    attention = h * (dims.q_width + 2 * dims.kv_width) + dims.q_width * h
    dense_mlp = 3 * dims.ffn * h
    return dims.layers * attention + expert_params(dims) + (dims.layers - dims.num_sparse_layers) * dense_mlp


def fp8_bytes(numel: int) -> int:
    """One byte per weight plus an fp32 scale per 128 x 128 block (modelopt's block FP8, docs/fp8.md)."""
    return numel + (numel * 4) // (128 * 128)

"""Quantization-aware trainer forward (actor.quantization_aware, rollout.quantization=fp8; docs/fp8.md).

    handles = apply_weight_fake_quant(chunks, hf_config, layout, quantized_modules=conv.quantized_modules,
                                      block=conv.block, dtype=conv.dtype,    # conv: Fp8SyncConverter
                                      quantize_inputs=True)
    ...     # every forward of a listed Linear now computes dequant(quant(x)) @ dequant(quant(w)).T
    for h in handles: h.remove()

The rollout engines multiply by block-FP8 weights: what Fp8SyncConverter sends, dequantized
(dequantize_block_fp8). With this on, every Megatron Linear whose HF weights the engines hold in FP8
(a module is fp8 iff the engines' checkpoint holds `<m>.weight_scale_inv`: linear_qkv, linear_proj,
linear_fc1, linear_fc2 of the decoder layers; embeddings, norms, biases and the LM head stay as they are)
runs its forward with exactly those values, bit for bit as fp32 values, computed from its own weights:

  1. amax: the max |w| of each 128 x 128 block of the HF tensors (q_proj, k_proj, ... : the engines'
     blocks), taken on the weight cast to the checkpoint dtype (bf16), as the converter calibrates.
     Megatron holds fused, TP-sharded, interleaved layouts (weights/mapping.py), so each local element's
     block is looked up (`ShardBlocks`, built with mapping.shard_for_rank itself), the local block maxima
     are reduced into the HF grids, and the grids (a few numbers per weight, not the weight) are MAX
     all-reduced over the TP group: at TP=2 on the tiny model one 128-row block spans both ranks.
  2. modelopt's shared amax for a q/k/v or gate/up group whose members are one block each
     (quant_utils.preprocess_linear_fusion, which the converter runs), and modelopt's export clean-up of
     the amax (TensorQuantizer._sanitize_export_amax, export_amax's clamp); scale = amax / 448.
  3. the values: modelopt's own export quantizer, FP8QTensor.quantize (what _export_quantized_weight
     calls: (w / scale).to(float8_e4m3fn)), given per-element scales so that it runs on the Megatron
     layout, then FP8QTensor.dequantize in fp32 (fp8 * scale: dequantize_block_fp8's product).
  4. with quantize_inputs (the actor's setting): the Linear's input as the engines' GEMM quantizes it,
     per token and per 128 input channels (SGLang's dynamic activations, quant/fp8_activation.py); a
     row-parallel Linear's groups may span TP ranks, so their per-token maxima are MAX all-reduced too
     (fake_quant_input_values). Straight-through gradient as for the weights.
Why not modelopt's fake-quant op (tensor_quant.scaled_e4m3, what TensorQuantizer runs in QAT) with the
same amax: it multiplies by 448/amax and dequantizes with 1/(448/amax), which differ from the engine's
w / (amax/448) and fp8 * (amax/448) in the last bit for most blocks (tests/unit/test_fake_quant.py
measures it); and why not mtq.quantize on the Megatron model (plugins/megatron.py): its quantizers would
see the local, interleaved shards, i.e. other blocks, and no TP reduction.

The gradient is straight-through (d/dw = identity, modelopt's pass_through_bwd; its clipped STE is the
same here since no element exceeds its block's amax). Master weights, optimizer, checkpoints and the
weight export never see the fake-quantized values: the Linear reads them only inside its forward, the
way modelopt's QuantLinear does (a dynamic `weight` attribute, quant_module.py): a forward pre-hook puts
the fake-quantized tensor in the module's parameter slot and a forward hook (always_call) puts the
Parameter back. Both Megatron's local linears and TE's read `self.weight` inside their forward, so the
same hooks reach both; only the local spec is verified on CPU (docs/fp8.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.quant.fp8_activation import quant_with_absmax
from dapo_megatron.weights.load import chunk_layer_offset, unwrap_model
from dapo_megatron.weights.mapping import Dims, ParamMap, expected_hf_shapes, map_param, shard_for_rank

if TYPE_CHECKING:
    from torch.types import Device
    from transformers import PretrainedConfig

# Megatron Linears the engines may hold in FP8 (the HF names they map to decide whether they do)
LINEAR_NAMES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# the HF groups that read one input (fp8_sync.SHARED_INPUT_GROUPS) and the Megatron kinds that fuse them
FUSED_KINDS = ("qkv", "fc1")


@dataclass(frozen=True)
class ShardBlocks:
    """Where each element of a local shard [R, C] lies in the engines' block grids of its HF tensors.

    The HF tensors of one parameter (q, k, v; gate, up; or one) share their input dimension, so their
    grids are stacked into one [num_block_rows, num_block_cols] grid: element (i, j) is in block
    (row_block[i], col_block[j]); HF tensor t owns grid rows [row_starts[t], row_starts[t+1])."""

    row_block: torch.Tensor  # int64 [R]
    col_block: torch.Tensor  # int64 [C]
    row_starts: tuple[int, ...]
    num_block_cols: int
    # modelopt's preprocess_linear_fusion applies: a fused group (q/k/v, gate/up; all of them fp8, which
    # quantized_linears requires) whose members are one block each
    shared_amax: bool

    @property
    def num_block_rows(self) -> int:
        return self.row_starts[-1]

    def to(self, device: Device) -> ShardBlocks:
        """The index tensors on `device`, once at set-up (not a host-to-device copy in every forward)."""
        return replace(self, row_block=self.row_block.to(device), col_block=self.col_block.to(device))


def shard_blocks(
    pmap: ParamMap, hf_shapes: Sequence[tuple[int, ...]], *, dims: Dims, tp_rank: int, tp_size: int, block: int
) -> ShardBlocks:
    """The block of every local element, from the mapping's own shard maths: shard_for_rank applied to
    HF-shaped tensors of block ids gives the local layout of the ids (no layout code repeated here)."""
    block_rows = [-(-rows // block) for rows, _ in hf_shapes]
    starts = [0]
    for n in block_rows:
        starts.append(starts[-1] + n)
    in_features = hf_shapes[0][1]
    col_ids = torch.arange(in_features, dtype=torch.int64) // block
    if pmap.kind == "row":  # columns split over TP, rows whole (one HF tensor)
        col_block = shard_for_rank("row", [col_ids[None, :]], tp_rank=tp_rank, tp_size=tp_size, dims=dims)[0]
        row_block = torch.arange(hf_shapes[0][0], dtype=torch.int64) // block
    elif pmap.kind in FUSED_KINDS:  # rows fused from several HF tensors, interleaved / stacked per TP shard
        ids = [
            (start + torch.arange(rows, dtype=torch.int64) // block)[:, None]
            for start, (rows, _) in zip(starts, hf_shapes)
        ]
        row_block = shard_for_rank(pmap.kind, ids, tp_rank=tp_rank, tp_size=tp_size, dims=dims)[:, 0]
        col_block = col_ids
    else:
        raise ValueError(
            f"{pmap.mcore_name}: the engines hold {pmap.hf_names} in FP8, but quantization-aware "
            f"forward supports dense Linear kinds only (not {pmap.kind!r}: MoE experts are not covered)"
        )
    one_block = all(n == 1 for n in block_rows) and -(-in_features // block) == 1
    return ShardBlocks(
        row_block=row_block.contiguous(),
        col_block=col_block.contiguous(),
        row_starts=tuple(starts),
        num_block_cols=-(-in_features // block),
        shared_amax=pmap.kind in FUSED_KINDS and one_block,
    )


def local_block_amax(weight_q: torch.Tensor, blocks: ShardBlocks) -> torch.Tensor:
    """fp32 [num_block_rows, num_block_cols]: max |w| of this shard's elements in every block (0 where it
    holds none). weight_q: the local shard already cast to the checkpoint dtype."""
    w_abs = weight_q.detach().abs().float()  # exact: every bf16 value is an fp32 value
    rows, cols = w_abs.shape
    col_index = blocks.col_block.to(w_abs.device).expand(rows, cols)
    per_row = w_abs.new_zeros(rows, blocks.num_block_cols).scatter_reduce_(1, col_index, w_abs, "amax")
    grid = w_abs.new_zeros(blocks.num_block_rows, blocks.num_block_cols)
    row_index = blocks.row_block.to(w_abs.device)[:, None].expand(rows, blocks.num_block_cols)
    return grid.scatter_reduce_(0, row_index, per_row, "amax")


def block_scales(amax: torch.Tensor, blocks: ShardBlocks) -> torch.Tensor:
    """fp32 grid of dequantization scales (= the engines' weight_scale_inv) from the full-tensor amax grid."""
    from modelopt.torch.quantization.utils.numeric_utils import E4M3_MAX

    if blocks.shared_amax:  # preprocess_linear_fusion: the group's members take their common max
        amax = amax.max().expand_as(amax)
    # TensorQuantizer.export_amax: _sanitize_export_amax (0 or NaN -> maxbound), clamp to [tiny, max]
    amax = torch.nan_to_num(torch.where(amax == 0, torch.full_like(amax, E4M3_MAX), amax), nan=E4M3_MAX)
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny, max=torch.finfo(amax.dtype).max)
    return amax.float() / E4M3_MAX  # export/quant_utils.get_scaling_factor: amax.float() / maxbound


def fake_quant_values(
    weight: torch.Tensor, blocks: ShardBlocks, *, dtype: torch.dtype, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """dequant(quant(weight)) of this local shard in fp32: the engines' weight values, bit for bit.
    Collective over tp_group (one small MAX all-reduce of the amax grid) when it has more than one rank."""
    weight_q = weight.detach().to(dtype)
    amax = local_block_amax(weight_q, blocks)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        coll.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp_group)
    return values_from_amax(weight_q, blocks, amax)


def values_from_amax(weight_q: torch.Tensor, blocks: ShardBlocks, amax: torch.Tensor) -> torch.Tensor:
    """fp32 dequant(quant(weight_q)) given the full-tensor amax grid (all TP ranks' blocks reduced)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    scale_grid = block_scales(amax, blocks)
    device = scale_grid.device
    scales = scale_grid[blocks.row_block.to(device)][:, blocks.col_block.to(device)]  # fp32 [R, C]
    qtensor, _ = FP8QTensor.quantize(weight_q, scales=scales)  # (w / s).to(e4m3): the export's division
    return qtensor.dequantize(dtype=torch.float32, scale=scales)  # fp8.float() * s


class _StraightThrough(torch.autograd.Function):
    """forward: value(t) (computed without autograd); backward: the gradient to t unchanged (the STE every
    fake quantization and cast of this module uses: rounding has zero derivative almost everywhere)."""

    @staticmethod
    def forward(ctx, t, value):
        return value(t.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _straight_through(t: torch.Tensor, value: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    out = _StraightThrough.apply(t, value)
    if not torch.is_grad_enabled() and t.requires_grad:
        # keep requires_grad as the Parameter has it: megatron picks linear_with_frozen_weight for a weight
        # that does not require grad, and ATen's matmul folds differently by that flag (actor.py, frozen=),
        # so the log-prob pass (no_grad) and the training forward would differ in the last bits
        out.requires_grad_(True)
    return out


def fake_quant_weight(
    weight: torch.Tensor, blocks: ShardBlocks, *, dtype: torch.dtype, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The tensor the Linear multiplies by: fake-quantized values, straight-through gradient to `weight`."""
    return _straight_through(weight, lambda w: fake_quant_values(w, blocks, dtype=dtype, tp_group=tp_group).to(w.dtype))


def fake_quant_input_values(
    x: torch.Tensor, blocks: ShardBlocks, *, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """dequant(quant(x)) of a Linear's input as the engines' GEMM quantizes it (SGLang's dynamic
    activations: one scale per token and per 128 input channels, quant/fp8_activation.py), in x's dtype.

    The groups are the weight's column blocks (the GEMM pairs activation group j with weight block
    column j). A row-parallel Linear (linear_proj, linear_fc2) holds K / tp input channels per rank; when a
    group spans ranks (the tiny model at TP=2: 64 channels a rank, 128 a group) its maximum is the MAX
    all-reduce over tp_group of the ranks' per-token, per-group maxima ([tokens, groups] numbers), so
    every rank quantizes with the scale the engine computes from the whole row."""
    xf = x.detach().float().reshape(-1, x.shape[-1])
    col = blocks.col_block.to(xf.device)
    absmax = xf.new_zeros(xf.shape[0], blocks.num_block_cols)
    absmax.scatter_reduce_(1, col.expand_as(xf), xf.abs(), "amax")
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        coll.all_reduce(absmax, op=dist.ReduceOp.MAX, group=tp_group)
    q, scale = quant_with_absmax(xf, absmax[:, col])
    return (q.float() * scale).reshape(x.shape).to(x.dtype)  # dequantize_activation_fp8's fp32 product


class _Hooks:
    """The pre/post forward hooks of one Linear: swap the fake-quantized weight in (and, with
    quantize_inputs, replace the input by its FP8 values), put the Parameter back after the forward."""

    def __init__(
        self,
        blocks: ShardBlocks,
        *,
        dtype: torch.dtype,
        tp_group: dist.ProcessGroup | None,
        input_tp_group: dist.ProcessGroup | None,
        quantize_inputs: bool,
    ) -> None:
        self.blocks, self.dtype, self.tp_group = blocks, dtype, tp_group
        self.input_tp_group, self.quantize_inputs = input_tp_group, quantize_inputs
        self.master: torch.nn.Parameter | None = None

    def pre(self, module, args):
        self.master = module._parameters["weight"]
        module._parameters["weight"] = fake_quant_weight(
            self.master, self.blocks, dtype=self.dtype, tp_group=self.tp_group
        )
        if self.quantize_inputs:  # the Linear's input is args[0]; returning new args replaces it
            x = _straight_through(
                args[0], lambda x: fake_quant_input_values(x, self.blocks, tp_group=self.input_tp_group)
            )
            return (x, *args[1:])
        return None

    def post(self, module, args, output):
        if self.master is not None:
            module._parameters["weight"] = self.master
            self.master = None
        return None


def cast_like_engines(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor the engines hold unquantized (embeddings, norms, biases, the LM head), at their values:
    rounded to the checkpoint dtype the sync sends it in (fp8_sync: every tensor that is not FP8 is cast
    to it), straight-through gradient. A no-op when the trainer already runs in that dtype (bf16 on GPUs)."""
    if t.dtype == dtype:
        return t
    return _straight_through(t, lambda v: v.to(dtype).to(v.dtype))


class _CastHooks:
    """Pre/post forward hooks of a module holding parameters the engines keep unquantized: each is
    swapped for cast_like_engines of itself during the module's own forward (so activation recompute
    sees the same values), the Parameters put back after it."""

    def __init__(self, names: Sequence[str], dtype: torch.dtype) -> None:
        self.names, self.dtype = tuple(names), dtype
        self.masters: dict[str, torch.nn.Parameter] = {}

    def pre(self, module, args):
        for name in self.names:
            self.masters[name] = module._parameters[name]
            module._parameters[name] = cast_like_engines(self.masters[name], self.dtype)
        return None

    def post(self, module, args, output):
        for name, master in self.masters.items():
            module._parameters[name] = master
        self.masters.clear()
        return None


def apply_engine_dtype_casts(chunks: Sequence[torch.nn.Module], *, skip: set[int], dtype: torch.dtype) -> list:
    """Register _CastHooks on every module of the chunks that holds parameters directly, except the
    parameters whose id() is in `skip` (the FP8 weights, which fake_quant_weight handles) and the LM head
    (its forward is replaced by an identity: the actor casts the head weight where it reads it, see
    Actor._head). Returns the hook handles."""
    handles = []
    for chunk in chunks:
        for name, module in unwrap_model(chunk).named_modules():
            if name.rpartition(".")[2] == "output_layer":
                continue
            names = [
                n
                for n, p in module._parameters.items()
                if p is not None and id(p) not in skip and p.is_floating_point()
            ]
            if names:
                hooks = _CastHooks(names, dtype)
                handles.append(module.register_forward_pre_hook(hooks.pre))
                handles.append(module.register_forward_hook(hooks.post, always_call=True))
    return handles


def _linears(chunk) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, m)
        for name, m in chunk.named_modules()
        if name.rpartition(".")[2] in LINEAR_NAMES and isinstance(m._parameters.get("weight"), torch.nn.Parameter)
    ]


def quantized_linears(
    chunks: Sequence[torch.nn.Module],
    hf_config: PretrainedConfig,
    *,
    quantized_modules: set[str],
    block: int,
    tp_rank: int,
    tp_size: int,
) -> list[tuple[torch.nn.Module, ParamMap, ShardBlocks]]:
    """(module, mapping, blocks) of every local Linear whose HF weights the engines hold in FP8."""
    dims = Dims.from_hf(hf_config)
    shapes = expected_hf_shapes(dims)
    found = []
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        offset = chunk_layer_offset(gpt)
        for name, module in _linears(gpt):
            pmap = map_param(f"{name}.weight", layer_offset=offset, dims=dims)
            members = [n.removesuffix(".weight") for n in pmap.hf_names]
            held = [m in quantized_modules for m in members]
            if not any(held):
                continue
            if not all(held):
                raise ValueError(
                    f"actor.quantization_aware: the engines' checkpoint holds only some of "
                    f"{members} in FP8 (a fused Megatron weight is quantized whole or not at all)"
                )
            blocks = shard_blocks(
                pmap, [shapes[n] for n in pmap.hf_names], dims=dims, tp_rank=tp_rank, tp_size=tp_size, block=block
            ).to(module.get_parameter("weight").device)
            found.append((module, pmap, blocks))
    return found


def apply_weight_fake_quant(
    chunks: Sequence[torch.nn.Module],
    hf_config: PretrainedConfig,
    layout: ParallelLayout,
    *,
    quantized_modules: set[str],
    block: int,
    dtype: torch.dtype,
    quantize_inputs: bool = False,
    cast_unquantized: bool = False,
) -> list:
    """Register the hooks on every FP8 Linear of this rank's chunks (call inside model_parallel, after the
    model is built). Returns the hook handles. quantize_inputs: also give each such Linear its input as
    the engines' GEMM quantizes it (the actor turns it on: SGLang's block-FP8 GEMM always does); needs
    every quantized Linear's input dimension to be a multiple of `block`, as SGLang does.
    cast_unquantized: every other parameter (embeddings, norms, biases; not the LM head) at the engines'
    values too, i.e. rounded to `dtype` (apply_engine_dtype_casts). The actor turns it on: with FP8
    activations a norm weight off by bf16's rounding moves activations across FP8 rounding boundaries,
    and the tiny fp32 run's mismatch stayed at the unquantized trainer's level without it."""
    experts = sorted(m for m in quantized_modules if ".experts." in m)
    if experts:  # TE's grouped experts hold weight0, weight1, ...: they would be skipped silently
        raise ValueError(
            f"actor.quantization_aware: the engines hold MoE experts in FP8 ({experts[0]}, ...), which the "
            "quantization-aware forward does not cover"
        )
    tp_size = layout.tp_size
    tp_group = layout.tp_group if tp_size > 1 else None
    linears = quantized_linears(
        chunks, hf_config, quantized_modules=quantized_modules, block=block, tp_rank=layout.tp_rank, tp_size=tp_size
    )
    if quantized_modules and not linears:
        raise ValueError("actor.quantization_aware: none of the engines' FP8 modules maps to a Linear of this model")
    handles = []
    for module, pmap, blocks in linears:
        in_features = int(blocks.col_block.numel()) * (tp_size if pmap.kind == "row" else 1)
        if quantize_inputs and in_features % block:
            raise ValueError(
                f"actor.quantization_aware: {pmap.hf_names[0]} reads {in_features} input features, not a "
                f"multiple of the FP8 group {block} (SGLang's block-FP8 GEMM refuses such inputs)"
            )
        if quantize_inputs and "LayerNorm" in type(module).__name__:
            # TE's fused norm + Linear (the te spec's linear_qkv / linear_fc1) normalizes inside its forward:
            # a hook sees the input before the norm, and the engines quantize the normalized one
            raise ValueError(
                f"actor.quantization_aware: {type(module).__name__} ({pmap.mcore_name}) fuses the norm into "
                "the Linear, so its FP8 input cannot be reproduced from a hook; use "
                "actor.attention_backend=torch (separate norm modules) with quantization_aware"
            )
        # a row-parallel Linear's input is split over TP along the channels its groups are made of
        input_tp_group = tp_group if pmap.kind == "row" else None
        hooks = _Hooks(
            blocks, dtype=dtype, tp_group=tp_group, input_tp_group=input_tp_group, quantize_inputs=quantize_inputs
        )
        handles.append(module.register_forward_pre_hook(hooks.pre))
        handles.append(module.register_forward_hook(hooks.post, always_call=True))
    if cast_unquantized:
        skip = {id(module._parameters["weight"]) for module, _, _ in linears}
        handles += apply_engine_dtype_casts(chunks, skip=skip, dtype=dtype)
    return handles

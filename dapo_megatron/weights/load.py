"""Load a Hugging Face safetensors checkpoint straight into this rank's Megatron shards.

    with model_parallel(tp=2, pp=2) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        load_hf_into_model(chunks, "/ckpt/Qwen2.5-7B", layout=layout)

Every rank reads only the tensors its own parameters need (a PP stage never opens the others'
layers, an EP rank only its own experts) and of those only its TP slice (safetensors get_slice: a
TP=8 rank reads 1/8 of each split matrix; expert matrices are split over the expert TP group),
builds its shard with weights/mapping.py's layout maths and copies it in. No communication: it
works for any TP x PP (x VPP) x EP x ETP layout, with DP/CP replicas reading the same files.
MoE checkpoints may hold the experts per expert (public layout) or fused (transformers' in-memory
layout): weights/hf_layout.py reads a public name out of the fused tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.weights.hf_layout import fused_source, public_shape, read_fused_rows
from dapo_megatron.weights.mapping import Dims, ParamMap, expected_hf_shapes, map_param, read_shard

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from transformers import PretrainedConfig


def unwrap_model(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (each keeps it in `.module`)."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(chunk, GPTModel):
        inner = getattr(chunk, "module", None)
        if not isinstance(inner, torch.nn.Module):
            raise ValueError(f"expected a megatron GPTModel (possibly wrapped), got {type(chunk).__name__}")
        chunk = inner
    return chunk


def chunk_layer_offset(model: GPTModel) -> int:
    """Global index of the chunk's first transformer layer (its PP stage / virtual stage offset)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))


def expert_offset(dims: Dims, *, layout: ParallelLayout) -> int:
    """Global index of this EP rank's first expert (0 for dense models)."""
    if dims.moe is None:
        return 0
    return layout.ep_rank * dims.moe.num_experts // layout.ep_size


def shard_group_of(pmap: ParamMap, *, layout: ParallelLayout) -> tuple[int, int]:
    """(rank, size) of the group a parameter is split over: the expert TP group for experts, TP otherwise."""
    if pmap.is_expert:
        return layout.etp_rank, layout.etp_size
    return layout.tp_rank, layout.tp_size


def chunk_param_maps(model: GPTModel, dims: Dims, *, first_expert: int) -> list[tuple[ParamMap, torch.nn.Parameter]]:
    """(mapping, parameter) for every parameter of one unwrapped chunk, in named_parameters order.
    first_expert: global index of local expert 0 (expert_offset(dims, layout=layout) for this EP rank's)."""
    offset = chunk_layer_offset(model)
    return [
        (map_param(name, layer_offset=offset, dims=dims, expert_offset=first_expert), param)
        for name, param in model.named_parameters()
    ]


class SafetensorsCheckpoint:
    """Tensor-by-name access to a HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.hf_dir = os.fspath(hf_dir)
        index_path = os.path.join(self.hf_dir, "model.safetensors.index.json")
        single_path = os.path.join(self.hf_dir, "model.safetensors")
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as handle:
                self.weight_map: dict[str, str] = json.load(handle)["weight_map"]
        elif os.path.exists(single_path):
            from safetensors import safe_open

            with safe_open(single_path, framework="pt") as handle:
                self.weight_map = dict.fromkeys(handle.keys(), "model.safetensors")
        else:
            raise ValueError(f"HF checkpoint {self.hf_dir}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[str, Any] = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        file_name = self.weight_map.get(name)
        if file_name is None:
            raise ValueError(f"HF checkpoint {self.hf_dir}: tensor {name!r} is missing")
        if file_name not in self._open:
            self._open[file_name] = safe_open(os.path.join(self.hf_dir, file_name), framework="pt")
        return self._open[file_name]

    def _fused(self, name: str) -> tuple[str, int, str] | None:
        """Where a public per-expert name lives in a fused-layout checkpoint (None: read it as is)."""
        if name in self.weight_map:
            return None
        source = fused_source(name)
        return source if source is not None and source[0] in self.weight_map else None

    def _slice(self, name: str):
        return self._handle(name).get_slice(name)

    def get(self, name: str) -> torch.Tensor:
        if self._fused(name):
            return self.read_rows(name, None, None, 0)
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        fused = self._fused(name)
        if fused:
            return public_shape(tuple(self._slice(fused[0]).get_shape()), fused[2])
        return tuple(self._slice(name).get_shape())

    def read_rows(self, name: str, start, stop, dim: int) -> torch.Tensor:
        """tensor[name][start:stop] along dim 0 or 1, reading only that part of the file."""
        fused = self._fused(name)
        if fused:
            fused_name, expert, proj = fused
            return read_fused_rows(
                self._slice, tuple(self._slice(fused_name).get_shape()), fused_name, expert, proj, start, stop, dim
            )
        part = self._slice(name)
        if dim == 0:
            return part[start:stop]
        return part[:, start:stop]


def load_hf_into_model(
    model_chunks: Iterable[torch.nn.Module],
    hf_dir: str | os.PathLike,
    *,
    layout: ParallelLayout,
    hf_config: PretrainedConfig | None = None,
) -> None:
    """Copy the HF checkpoint at hf_dir into every local parameter of model_chunks (this rank's
    shards: its TP / expert-TP slice and its EP rank's experts, read off `layout`).

    hf_config defaults to transformers.AutoConfig.from_pretrained(hf_dir). Raises ValueError naming
    the tensor for a missing tensor or a tensor of the wrong shape, and naming the parameter for a
    megatron parameter no mapping covers.
    """
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_dir)
    dims = Dims.from_hf(hf_config)
    shapes = expected_hf_shapes(dims)
    ckpt = SafetensorsCheckpoint(hf_dir)
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for pmap, param in chunk_param_maps(model, dims, first_expert=expert_offset(dims, layout=layout)):
            for hf_name in pmap.hf_names:
                shape = ckpt.shape(hf_name)
                if shape != shapes[hf_name]:
                    raise ValueError(
                        f"HF checkpoint {ckpt.hf_dir}: tensor {hf_name!r} has shape "
                        f"{shape}, the config implies {shapes[hf_name]}"
                    )
            rank, size = shard_group_of(pmap, layout=layout)
            shard = read_shard(
                pmap.kind,
                pmap.hf_names,
                ckpt.read_rows,
                tp_rank=rank,
                tp_size=size,
                dims=dims,
                vocab_rows=param.shape[0] * size if pmap.kind == "vocab" else None,
            )
            if shard.shape != param.shape:  # internal invariant: config and model disagree
                raise ValueError(
                    f"megatron parameter {pmap.mcore_name!r} has shape {tuple(param.shape)} but "
                    f"{', '.join(pmap.hf_names)} give a shard of {tuple(shard.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard.to(dtype=param.dtype, device=param.device))

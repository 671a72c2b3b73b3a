"""Load a Hugging Face safetensors checkpoint straight into this rank's Megatron shards.

    with model_parallel(tp=2, pp=2):
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        load_hf_into_model(chunks, "/ckpt/Qwen2.5-7B")

Every rank reads only the tensors its own parameters need (a PP stage never opens the others'
layers) and of those only its TP slice (safetensors get_slice: a TP=8 rank reads 1/8 of each
split matrix), builds its shard with weights/mapping.py's layout maths and copies it in. No
communication: it works for any TP x PP (x VPP) layout, with DP/CP replicas reading the same files.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch

from dapo_megatron.weights.mapping import Dims, ParamMap, expected_hf_shapes, map_param, read_shard


def unwrap_model(chunk: Any) -> Any:
    """The GPTModel inside Megatron's DDP / Float16Module wrappers (each keeps it in `.module`)."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(chunk, GPTModel):
        if not hasattr(chunk, "module"):
            raise ValueError(f"expected a megatron GPTModel (possibly wrapped), got {type(chunk).__name__}")
        chunk = chunk.module
    return chunk


def chunk_layer_offset(model: Any) -> int:
    """Global index of the chunk's first transformer layer (its PP stage / virtual stage offset)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))


def chunk_param_maps(model: Any, dims: Dims) -> list[tuple[ParamMap, torch.nn.Parameter]]:
    """(mapping, parameter) for every parameter of one unwrapped chunk, in named_parameters order."""
    offset = chunk_layer_offset(model)
    return [(map_param(name, layer_offset=offset, dims=dims), param) for name, param in model.named_parameters()]


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
                self.weight_map = {name: "model.safetensors" for name in handle.keys()}
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

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read_rows(self, name: str, start, stop, dim: int) -> torch.Tensor:
        """tensor[name][start:stop] along dim 0 or 1, reading only that part of the file."""
        part = self._handle(name).get_slice(name)
        if dim == 0:
            return part[start:stop]
        return part[:, start:stop]


def load_hf_into_model(model_chunks: Iterable[Any], hf_dir: str | os.PathLike, *, hf_config: Any = None) -> None:
    """Copy the HF checkpoint at hf_dir into every local parameter of model_chunks (this rank's).

    hf_config defaults to transformers.AutoConfig.from_pretrained(hf_dir). Raises ValueError naming
    the tensor for a missing tensor or a tensor of the wrong shape, and naming the parameter for a
    megatron parameter no mapping covers.
    """
    from megatron.core import parallel_state

    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_dir)
    dims = Dims.from_hf(hf_config)
    shapes = expected_hf_shapes(dims)
    ckpt = SafetensorsCheckpoint(hf_dir)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for pmap, param in chunk_param_maps(model, dims):
            for hf_name in pmap.hf_names:
                shape = ckpt.shape(hf_name)
                if shape != shapes[hf_name]:
                    raise ValueError(f"HF checkpoint {ckpt.hf_dir}: tensor {hf_name!r} has shape "
                                     f"{shape}, the config implies {shapes[hf_name]}")
            shard = read_shard(pmap.kind, pmap.hf_names, ckpt.read_rows, tp_rank=tp_rank, tp_size=tp_size, dims=dims,
                               vocab_rows=param.shape[0] * tp_size if pmap.kind == "vocab" else None)
            if shard.shape != param.shape:  # internal invariant: config and model disagree
                raise ValueError(f"megatron parameter {pmap.mcore_name!r} has shape {tuple(param.shape)} but "
                                 f"{', '.join(pmap.hf_names)} give a shard of {tuple(shard.shape)}")
            with torch.no_grad():
                param.copy_(shard.to(dtype=param.dtype, device=param.device))

"""The two HF layouts of mixture-of-experts weights, and views that turn one into the other.

Public checkpoint layout (the hub's Qwen3-MoE checkpoints, what transformers 5.23's
save_pretrained writes, what SGLang loads): one 2-D tensor per expert and projection,
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight   [F_e, H]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight     [F_e, H]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight   [H, F_e]
Fused layout (transformers 5.23's modules in memory, models/qwen3_moe/modeling_qwen3_moe.py
Qwen3MoeExperts; a state_dict saved as is holds it): 3-D tensors over the experts,
    model.layers.{i}.mlp.experts.gate_up_proj           [E, 2 F_e, H]   gate rows then up rows
    model.layers.{i}.mlp.experts.down_proj              [E, H, F_e]
(transformers' conversion_mapping.py "qwen2_moe" rule: MergeModulelist(dim=0) then
Concatenate(dim=1) of gate and up). The mapping layer speaks the public layout only; this module
lets the loader read a fused checkpoint and the CPU rollout engine accept public names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_PUBLIC_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED_EXPERT = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)")


def fused_source(public_name: str) -> tuple[str, int, str] | None:
    """(fused tensor name, expert, projection) holding a public per-expert name, or None for a
    name that is not an expert matrix."""
    match = _PUBLIC_EXPERT.fullmatch(public_name)
    if match is None:
        return None
    fused = "gate_up_proj" if match["proj"] in ("gate_proj", "up_proj") else "down_proj"
    return f"{match['prefix']}.{fused}", int(match["e"]), match["proj"]


def public_shape(fused_shape: tuple[int, ...], proj: str) -> tuple[int, ...]:
    """Shape of one expert's projection inside a fused tensor of `fused_shape`."""
    if proj == "down_proj":
        return tuple(fused_shape[1:])
    return (fused_shape[1] // 2, fused_shape[2])


def read_fused_rows(
    get_slice: Callable[[str], Any],
    fused_shape: tuple[int, ...],
    fused_name: str,
    expert: int,
    proj: str,
    start: int | None,
    stop: int | None,
    dim: int,
) -> torch.Tensor:
    """public_tensor[start:stop] along dim (0 or 1) of one expert's projection, read from the fused
    tensor through a safetensors slice without reading the other experts."""
    part = get_slice(fused_name)
    rows, cols = public_shape(fused_shape, proj)
    row0 = rows if proj == "up_proj" else 0  # up rows follow the gate rows
    if dim == 0:
        lo = 0 if start is None else start
        hi = rows if stop is None else stop
        return part[expert, row0 + lo : row0 + hi, :]
    lo = 0 if start is None else start
    hi = cols if stop is None else stop
    return part[expert, row0 : row0 + rows, lo:hi]


def public_expert_views(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under public names: every fused expert tensor is replaced by per-expert
    views into its storage (writing a view writes the fused parameter); other names unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _FUSED_EXPERT.fullmatch(name)
        if match is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        prefix = match["prefix"]
        tensor = tensor.detach()  # views of the storage, outside autograd
        for e in range(tensor.shape[0]):
            if match["name"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out

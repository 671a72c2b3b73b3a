"""Per-sync FP8 conversion: the actor's HF-named weights -> the block-FP8 weights + scales the engines load.

    conv = Fp8SyncConverter.from_checkpoint("out/run/rollout_fp8")    # the engines' export (fp8_export.py)
    for name, tensor in conv.convert(iter_hf_weights(chunks, hf_config, layout=layout)):
        ...   # "<m>.weight" fp8 [out, in], "<m>.weight_scale_inv" fp32 [ceil(out/128), ceil(in/128)], others in dtype

Which tensors are quantized is read from the engines' checkpoint, not decided here: a module is FP8 iff
the export holds `<module>.weight_scale_inv` (modelopt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG and its
disabled list decided that: embeddings, norms, lm_head stay in dtype). For each such weight the values
come from modelopt's own code, the path export_hf_checkpoint takes:
  1. a TensorQuantizer built from the recipe's "*weight_quantizer" entry (E4M3, 128 x 128 blocks)
     calibrates the per-block max|w| with its max calibrator (what mtq.quantize does to a weight
     quantizer: model_calib.max_calibrate);
  2. modelopt/torch/export/unified_export_hf.py `_export_quantized_weight` turns it into the fp8
     weight and the block scales (amax / 448);
  3. the scale takes SGLang's name and shape (fp8_export.sglang_scale: a reshape, no value changes).
One more step of modelopt's export is reproduced with its own function: before exporting, it gives the
Linears that read one input (q/k/v; gate/up) a common weight amax when each holds a single amax
(quant_utils.preprocess_linear_fusion, called by requantize_resmooth_fused_llm_layers): with 128 x 128
blocks that is a weight of one block, which only tiny models have. The converter therefore holds the
members of such a group until all of them arrived and runs preprocess_linear_fusion on them.
So a sync is bit-identical to exporting the same weights (tests/unit/test_quant_fp8.py), and it is
what SGLang's weight loaders put into Fp8LinearMethod's weight / weight_scale_inv parameters
(tests/conformance/test_fp8_sglang_reload.py). `_export_quantized_weight` is private: modelopt is
pinned to 0.47.0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from dapo_megatron.quant.fp8_export import modelopt_block_cfg, read_quant_config, sglang_scale


def _weight_quantizer_cfg() -> dict:
    for entry in modelopt_block_cfg()["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            cfg = dict(entry["cfg"])
            # the YAML preset spells block dimensions as strings; the quantizer takes int keys
            cfg["block_sizes"] = {int(k): v for k, v in cfg["block_sizes"].items()}
            return cfg
    raise RuntimeError("unreachable: modelopt_block_cfg checked the '*weight_quantizer' entry")


# Linears that read the same input, as modelopt's export groups them for the dense architectures
# (collect_shared_input_modules finds q/k/v and gate/up) and as SGLang fuses them (qwen2.py / llama.py
# stacked_params_mapping: qkv_proj, gate_up_proj)
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _calibrated(weight: torch.Tensor, *, dtype: torch.dtype, quantizer_cfg: dict) -> nn.Module:
    """A module holding `weight` in dtype and its weight quantizer after modelopt's max calibration."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    holder = nn.Module()
    # the export casts weight.to(dtype); a model loaded in dtype (what export_fp8_checkpoint does) also
    # calibrates on the dtype-cast weight, so the amax is taken after the same cast
    holder.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    quantizer = TensorQuantizer(QuantizerAttributeConfig(**quantizer_cfg))
    quantizer.disable_quant()
    quantizer.enable_calib()
    with torch.no_grad():
        quantizer(holder.weight)
    quantizer.load_calib_amax()
    quantizer.enable_quant()
    quantizer.disable_calib()
    holder.weight_quantizer = quantizer
    return holder


def _export(holder: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, SGLang weight_scale_inv) of a calibrated holder, written by modelopt's export."""
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    _export_quantized_weight(holder, dtype)
    fp8 = cast(torch.Tensor, holder.weight.data)
    return fp8, sglang_scale(fp8, cast(torch.Tensor, holder.weight_scale))


class Fp8SyncConverter:
    """Turns a stream of (hf_name, tensor) into the engines' block-FP8 layout (see the module docstring)."""

    def __init__(self, *, quantized_modules: set[str], dtype: torch.dtype, block: int, ignored_layers: list[str]):
        self.quantized_modules = quantized_modules
        self.dtype = dtype
        self.block = block
        self.ignored_layers = ignored_layers
        self._quantizer_cfg = _weight_quantizer_cfg()
        self._group_of: dict[str, tuple[str, ...]] = {}  # module -> the modules of its shared-input group
        for module in quantized_modules:
            parent, _, leaf = module.rpartition(".")
            for group in SHARED_INPUT_GROUPS:
                members = tuple(f"{parent}.{g}" for g in group)
                if leaf in group and all(m in quantized_modules for m in members):
                    self._group_of[module] = members
        if set(self._quantizer_cfg["block_sizes"].values()) != {block}:
            raise ValueError(
                f"checkpoint weight_block_size [{block}, {block}] differs from modelopt's recipe "
                f"{self._quantizer_cfg['block_sizes']}: re-export it with export_fp8_checkpoint"
            )

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> Fp8SyncConverter:
        """Read the engines' export: which modules are fp8, the block size, the dtype of the rest."""
        from safetensors import safe_open

        qc = read_quant_config(checkpoint_dir)
        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{checkpoint_dir}: no *.safetensors files")
        quantized: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names = f.keys()  # safe_open is not a dict: no `in f`
                quantized.update(k.removesuffix(".weight_scale_inv") for k in names if k.endswith(".weight_scale_inv"))
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return cls(
            quantized_modules=quantized,
            dtype=dtype,
            block=int(qc["weight_block_size"][0]),
            ignored_layers=list(qc.get("ignored_layers") or []),
        )

    def convert(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each quantized `<m>.weight` becomes fp8 `<m>.weight` + `<m>.weight_scale_inv`; others are cast to dtype."""
        pending: dict[tuple[str, ...], dict[str, nn.Module]] = {}  # group -> arrived members, in arrival order
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or module not in self.quantized_modules:
                yield name, tensor.detach().to(self.dtype)
                continue
            holder = _calibrated(tensor, dtype=self.dtype, quantizer_cfg=self._quantizer_cfg)
            group = self._group_of.get(module)
            if group is None:
                yield from self._emit({module: holder})
                continue
            arrived = pending.setdefault(group, {})
            arrived[module] = holder
            if len(arrived) == len(group):
                del pending[group]
                yield from self._emit(arrived, fuse=True)
        for arrived in pending.values():  # a stream without every member of a group (not a full sync)
            yield from self._emit(arrived)

    def _emit(self, holders: dict[str, nn.Module], *, fuse: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if fuse:
            from modelopt.torch.export.quant_utils import preprocess_linear_fusion

            preprocess_linear_fusion(list(holders.values()))  # no-op unless every member is one block
        for module, holder in holders.items():
            fp8, scale_inv = _export(holder, self.dtype)
            yield f"{module}.weight", fp8
            yield f"{module}.weight_scale_inv", scale_inv

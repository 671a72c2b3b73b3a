"""The model's dimensions for the memory plan, and where they come from.

    dims = model_dims_for(cfg)        # ModelDims; dims.source says which file (or config keys) it read

Three sources, in this order (the first that exists wins):
  1. <model.path>/config.json: the checkpoint the run will load (the truth).
  2. tiny.enabled: the embedded default's Qwen2, built at run time from the tiny.* keys
     (dapo_megatron/data/tiny_model.py) with its byte-level vocabulary padded to 320 rows.
  3. a committed copy of the config.json of a known checkpoint, found by the directory name of
     model.path (`/shared/models/Qwen2.5-32B` -> memplan/models/Qwen2.5-32B.json): the presets name
     checkpoints on a cluster's shared filesystem that this machine does not have, so `plan` reads
     the shape fields copied from the public config.json (each file names its source URL).
Only what shapes memory is read: no transformers import, no download.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_megatron.data.tiny_tokenizer import SPECIAL_TOKENS, padded_vocab_size

KNOWN_MODELS_DIR = Path(__file__).parent / "models"
SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")  # what actor/model.py builds


class UnsupportedModel(ValueError):
    """config.json names an architecture the plan does not model (the launch hooks warn and go on)."""


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    hidden: int  # h
    ffn: int  # F (SwiGLU: fc1 has 2F rows)
    layers: int  # L
    heads: int  # query heads
    kv_heads: int  # key/value heads (GQA groups)
    head_dim: int  # d
    vocab: int  # V (the actor builds the LM head without vocab padding: actor.py)
    tied: bool  # tie_word_embeddings
    qkv_bias: bool
    dtype_bytes: int  # bytes of one weight in the checkpoint's torch_dtype (the engines serve this dtype)
    name: str
    source: str
    qk_norm: bool = False  # Qwen3: RMSNorm of every query and key head (q_layernorm / k_layernorm, d weights each)
    # mixture of experts (Qwen3-MoE, actor/moe.py): experts per sparse layer, experts per token, each expert's
    # SwiGLU width, and which layers are sparse (the others keep a dense MLP of width `ffn`)
    num_experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    sparse_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        return self.is_moe and self.sparse_layers[layer]

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers) if self.is_moe else 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def describe(self) -> str:
        tie = "tied" if self.tied else "untied"
        moe = (
            f", {self.num_sparse_layers} MoE layers of {self.num_experts} experts (width {self.moe_ffn}, "
            f"top-{self.topk})"
            if self.is_moe
            else ""
        )
        ffn = f", dense ffn {self.ffn}" if not self.is_moe or self.num_sparse_layers < self.layers else ""
        return (
            f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.heads}/{self.kv_heads} heads of "
            f"{self.head_dim}{' with QK-norm' if self.qk_norm else ''}{ffn}{moe}, vocab {self.vocab}, "
            f"{tie} embeddings"
        )


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def dims_from_hf_config(config: dict[str, Any], *, name: str, source: str) -> ModelDims:
    """ModelDims from the fields of a HF config.json (a dict). ValueError names the missing field."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"{source}: model_type {model_type!r} is not modelled by the memory plan "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ValueError(f"{source}: '{key}' must be a positive integer, got {config.get(key)!r}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", False))  # model.py has_qkv_bias
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    moe = _moe_fields(config, source=source)
    return ModelDims(
        model_type=model_type,
        hidden=config["hidden_size"],
        ffn=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        name=name,
        source=source,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe,  # actor/model.py has_qk_norm
    )


def _moe_fields(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE config.json, by the rules of actor/moe.py moe_shape_of (which layers
    are sparse: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    # the public checkpoints write num_experts; transformers 5 writes its attribute_map's target num_local_experts
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if config.get("model_type") != "qwen3_moe" or not num_experts:
        return {}
    config = {**config, "num_experts": num_experts}
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedModel(
            f"{source}: shared experts (shared_expert_intermediate_size) are not modelled "
            "(Qwen3-MoE has none; the actor does not build them either)"
        )
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ValueError(f"{source}: '{key}' must be a positive integer, got {config.get(key)!r}")
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(config["num_hidden_layers"]))
    return dict(
        num_experts=config["num_experts"],
        topk=config["num_experts_per_tok"],
        moe_ffn=config["moe_intermediate_size"],
        sparse_layers=sparse,
    )


def known_models() -> dict[str, Path]:
    """Lower-cased checkpoint directory name -> committed config.json copy."""
    return {path.stem.lower(): path for path in sorted(KNOWN_MODELS_DIR.glob("*.json"))}


def _tiny_dims(cfg) -> ModelDims:
    tn = cfg.tiny
    # the tiny tokenizer: 5 special tokens + 256 byte symbols, padded like build_tiny_model does
    vocab = padded_vocab_size(len(SPECIAL_TOKENS) + 256)
    config = {
        "model_type": tn.arch,
        "hidden_size": tn.hidden_size,
        "intermediate_size": tn.intermediate_size,
        "num_hidden_layers": tn.num_layers,
        "num_attention_heads": tn.num_heads,
        "num_key_value_heads": tn.num_kv_heads,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if tn.arch == "qwen3_moe":  # what tiny.build_tiny_model writes: every layer sparse, head_dim = hidden / heads
        config.update(
            head_dim=tn.hidden_size // tn.num_heads,
            num_experts=tn.num_experts,
            num_experts_per_tok=tn.num_experts_per_tok,
            moe_intermediate_size=tn.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return dims_from_hf_config(
        config,
        name=f"tiny {tn.arch}",
        source="tiny.* config keys (built at run time, dapo_megatron/data/tiny_model.py)",
    )


def model_dims_for(cfg) -> ModelDims:
    """The dims of the model cfg trains (see the module docstring for the order of sources)."""
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is not None and (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"model.path: {path / 'config.json'} is not valid JSON: {err}") from None
        return dims_from_hf_config(config, name=path.name, source=str(path / "config.json"))
    if cfg.tiny.enabled:
        return _tiny_dims(cfg)
    if path is None:
        raise ValueError("config key 'model.path' is empty: name a HF checkpoint directory (or set tiny.enabled=true)")
    known = known_models()
    copy = known.get(path.name.lower())
    if copy is None:
        names = ", ".join(p.stem for p in known.values())
        raise ValueError(
            f"model.path: {path}/config.json not found, and '{path.name}' is not one of the committed "
            f"architectures ({names}, in {KNOWN_MODELS_DIR}); point model.path at a HF checkpoint "
            f"directory, or add its config.json there as <directory name>.json"
        )
    config = json.loads(copy.read_text())
    where = config.get("_source", "")
    return dims_from_hf_config(
        config,
        name=copy.stem,
        source=f"committed copy {copy.name} of {where.split(' ')[0]} ({path}/config.json is not on this machine)",
    )

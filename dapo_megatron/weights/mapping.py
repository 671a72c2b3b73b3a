"""HF <-> megatron-core parameter names and shard layouts for Qwen2/Qwen2.5, Llama, Qwen3 and Qwen3-MoE.

Every megatron parameter is one of seven layouts ("kinds"); the maths of each, for TP size t and
TP rank r (full tensors are HF's, shards are megatron's local parameter):

  replicated  norms: every rank holds the full HF tensor.
  vocab       embedding / output rows: pad V rows with zeros to V_pad = padded_vocab_size(V, tp=t),
              rank r holds rows [r*V_pad/t, (r+1)*V_pad/t).
  row         linear_proj (o_proj), linear_fc2 (down_proj): columns split, rank r holds
              [:, r*I/t : (r+1)*I/t].
  qkv         linear_qkv weight/bias: megatron interleaves per query group g (ng groups, each with
              p = heads/ng query heads of size d): [q_g (p*d rows); k_g (d rows); v_g (d rows)] for
              g = 0..ng-1; rank r holds the contiguous groups [r*ng/t, (r+1)*ng/t).
  fc1         linear_fc1 (SwiGLU): rank r holds [gate rows r*F/t..(r+1)*F/t ; up rows same], i.e.
              each shard is its own [gate_shard; up_shard], NOT a slice of cat(gate, up).
  expert_fc1  one expert's linear_fc1: fc1's maths with the expert width F_e (moe_intermediate_size)
              over the EXPERT tensor-parallel group (size etp, rank r_e) instead of the TP group.
  expert_row  one expert's linear_fc2: row's maths with F_e over the expert TP group.

Experts (Qwen3-MoE): the router `mlp.router.weight` [E, H] is replicated (HF `mlp.gate.weight`).
Megatron holds E / ep experts per expert-parallel rank: local expert j of EP rank q is global expert
e = q * E / ep + j, HF `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (the public
checkpoint layout, which transformers' save_pretrained also writes; the fused in-memory layout of
transformers 5 is read by weights/hf_layout.py). Local-spec names
`mlp.experts.local_experts.{j}.linear_fc{1,2}.weight` (SequentialMLP), TE grouped-GEMM names
`mlp.experts.linear_fc{1,2}.weight{j}` (TEGroupedMLP).

The same megatron parameter has two names depending on the layer spec: the local spec keeps
separate norms (`input_layernorm.weight`), the TE spec fuses them into the next linear
(`self_attention.linear_qkv.layer_norm_weight`). Both are listed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dapo_megatron.weights.hf_config import (
    MoEShape,
    has_qk_norm,
    has_qkv_bias,
    head_dim_of,
    model_type_of,
    moe_shape_of,
    padded_vocab_size,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# (megatron local-spec suffix, TE-spec suffix, HF templates, kind) for the parameters of one layer.
_LAYER_PARAMS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        ("model.layers.{i}.input_layernorm.weight",),
        "replicated",
    ),
    (
        "self_attention.q_layernorm.weight",
        "self_attention.q_layernorm.weight",
        ("model.layers.{i}.self_attn.q_norm.weight",),
        "replicated",
    ),
    (
        "self_attention.k_layernorm.weight",
        "self_attention.k_layernorm.weight",
        ("model.layers.{i}.self_attn.k_norm.weight",),
        "replicated",
    ),
    (
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.weight",
        (
            "model.layers.{i}.self_attn.q_proj.weight",
            "model.layers.{i}.self_attn.k_proj.weight",
            "model.layers.{i}.self_attn.v_proj.weight",
        ),
        "qkv",
    ),
    (
        "self_attention.linear_qkv.bias",
        "self_attention.linear_qkv.bias",
        (
            "model.layers.{i}.self_attn.q_proj.bias",
            "model.layers.{i}.self_attn.k_proj.bias",
            "model.layers.{i}.self_attn.v_proj.bias",
        ),
        "qkv",
    ),
    (
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.weight",
        ("model.layers.{i}.self_attn.o_proj.weight",),
        "row",
    ),
    (
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        "replicated",
    ),
    (
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "fc1",
    ),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row"),
    ("mlp.router.weight", "mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated"),
)

# One expert's matrices: (local-spec regex, TE grouped-GEMM regex) over the layer-relative suffix,
# HF templates with {i} = layer and {e} = global expert, kind.
_EXPERT_PARAMS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight",
        r"mlp\.experts\.linear_fc1\.weight(\d+)",
        ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
        "expert_fc1",
    ),
    (
        r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight",
        r"mlp\.experts\.linear_fc2\.weight(\d+)",
        ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
        "expert_row",
    ),
)

# (megatron name, HF name, kind) outside the layers. Qwen2 and Llama share these HF names.
_TOP_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab"),
    ("decoder.final_layernorm.weight", "model.norm.weight", "replicated"),
    ("output_layer.weight", "lm_head.weight", "vocab"),
)


@dataclass(frozen=True)
class Dims:
    """The sizes the shard maths needs, read from the HF config."""

    hidden: int
    num_heads: int
    num_groups: int  # key/value heads
    head_dim: int
    ffn: int
    vocab: int
    num_layers: int
    qkv_bias: bool
    tied: bool
    qk_norm: bool = False
    moe: MoEShape | None = None

    @staticmethod
    def from_hf(hf_config: PretrainedConfig) -> Dims:
        model_type_of(hf_config)
        return Dims(
            hidden=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_groups=hf_config.num_key_value_heads,
            head_dim=head_dim_of(hf_config),
            ffn=hf_config.intermediate_size,
            vocab=hf_config.vocab_size,
            num_layers=hf_config.num_hidden_layers,
            qkv_bias=has_qkv_bias(hf_config),
            tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qk_norm=has_qk_norm(hf_config),
            moe=moe_shape_of(hf_config),
        )

    @property
    def experts(self) -> MoEShape:
        """The MoE shape; asking a dense model for it is a bug (callers hold an expert parameter)."""
        if self.moe is None:
            raise ValueError("a dense model has no experts")
        return self.moe

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    def ffn_of(self, kind: str) -> int:
        """The MLP width a kind splits: an expert's for expert kinds, the dense MLP's otherwise."""
        return self.experts.ffn if kind.startswith("expert") else self.ffn


@dataclass(frozen=True)
class ParamMap:
    """One megatron parameter and the HF tensors it is made of."""

    mcore_name: str  # name inside the (unwrapped) GPTModel chunk, local layer index
    hf_names: tuple[str, ...]
    kind: str
    global_layer: int | None = None
    local_expert: int | None = None  # expert kinds: index among this EP rank's experts

    @property
    def is_expert(self) -> bool:
        return self.kind.startswith("expert")


def expected_hf_shapes(dims: Dims) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds (lm_head only when untied), in streaming
    order: embedding, layers 0..L-1, final norm, lm_head."""
    h, d, f = dims.hidden, dims.head_dim, dims.ffn
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (dims.vocab, h)}
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (dims.num_heads * d, h),
                p + "self_attn.k_proj.weight": (dims.num_groups * d, h),
                p + "self_attn.v_proj.weight": (dims.num_groups * d, h),
                p + "self_attn.o_proj.weight": (h, dims.num_heads * d),
            }
        )
        if dims.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if dims.is_sparse(i):
            fe = dims.experts.ffn
            shapes[p + "mlp.gate.weight"] = (dims.experts.num_experts, h)
            for e in range(dims.experts.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update(
                    {q + "gate_proj.weight": (fe, h), q + "up_proj.weight": (fe, h), q + "down_proj.weight": (h, fe)}
                )
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                }
            )
        if dims.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (dims.num_heads * d,),
                    p + "self_attn.k_proj.bias": (dims.num_groups * d,),
                    p + "self_attn.v_proj.bias": (dims.num_groups * d,),
                }
            )
    shapes["model.norm.weight"] = (h,)
    if not dims.tied:
        shapes["lm_head.weight"] = (dims.vocab, h)
    return shapes


def hf_names_in_order(dims: Dims) -> list[str]:
    """The order iter_hf_weights streams tensors in: embedding, layers 0..L-1, final norm, head."""
    return list(expected_hf_shapes(dims))


def map_param(mcore_name: str, *, layer_offset: int, dims: Dims, expert_offset: int = 0) -> ParamMap:
    """The HF tensors behind one megatron parameter name of a chunk whose first layer is global
    layer `layer_offset`; expert parameters are this EP rank's, whose first expert is global expert
    `expert_offset` (ep_rank * num_experts / ep). Raises ValueError for a name no mapping covers."""
    for name, hf_name, kind in _TOP_PARAMS:
        if mcore_name == name:
            if name == "output_layer.weight" and dims.tied:
                hf_name = "model.embed_tokens.weight"  # tied: the head is the embedding
            return ParamMap(mcore_name, (hf_name,), kind)
    prefix = "decoder.layers."
    if mcore_name.startswith(prefix):
        local_index, _, suffix = mcore_name[len(prefix) :].partition(".")
        if local_index.isdigit():
            layer = layer_offset + int(local_index)
            for local_suffix, te_suffix, templates, kind in _LAYER_PARAMS:
                if suffix in (local_suffix, te_suffix):
                    return ParamMap(mcore_name, tuple(t.format(i=layer) for t in templates), kind, layer)
            for local_re, te_re, templates, kind in _EXPERT_PARAMS:
                match = re.fullmatch(local_re, suffix) or re.fullmatch(te_re, suffix)
                if match:
                    j = int(match.group(1))
                    names = tuple(t.format(i=layer, e=expert_offset + j) for t in templates)
                    return ParamMap(mcore_name, names, kind, layer, local_expert=j)
    raise ValueError(f"megatron parameter {mcore_name!r} has no HF mapping (supported: qwen2, llama, qwen3, qwen3_moe)")


# --- shard maths ----------------------------------------------------------------------------------


def _interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims) -> torch.Tensor:
    """Full HF q/k/v (weight [n*d, H] or bias [n*d]) -> megatron's per-group interleaved rows."""
    ng = dims.num_groups
    per_group = [t.reshape(ng, -1, *t.shape[1:]) for t in (q, k, v)]  # [ng, rows_per_group, ...]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def _deinterleave_qkv(full: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
    ng, d = dims.num_groups, dims.head_dim
    q_rows = dims.num_heads // ng * d
    grouped = full.reshape(ng, q_rows + 2 * d, *full.shape[1:])
    q, k, v = torch.split(grouped, [q_rows, d, d], dim=1)
    return [t.reshape(-1, *full.shape[1:]).contiguous() for t in (q, k, v)]


def shard_for_rank(
    kind: str,
    hf_tensors: Sequence[torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    dims: Dims,
    vocab_rows: int | None = None,
) -> torch.Tensor:
    """Megatron's local shard on TP rank `tp_rank` from the full HF tensors. vocab_rows: the
    model's padded vocabulary (all ranks), when it was built with another vocab_divisible_by."""
    if kind == "replicated":
        return hf_tensors[0]
    if kind == "vocab":
        full = hf_tensors[0]
        padded = full.new_zeros(vocab_rows or padded_vocab_size(dims.vocab, tp=tp_size), *full.shape[1:])
        padded[: dims.vocab] = full
        return padded.chunk(tp_size, dim=0)[tp_rank]
    if kind in ("row", "expert_row"):
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "qkv":
        q, k, v = hf_tensors
        return _interleave_qkv(q, k, v, dims).chunk(tp_size, dim=0)[tp_rank]
    if kind in ("fc1", "expert_fc1"):
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf_tensors)
        return torch.cat([gate, up], dim=0)
    raise AssertionError(f"unknown kind {kind}")


def merge_shards(kind: str, shards: Sequence[torch.Tensor], *, dims: Dims) -> list[torch.Tensor]:
    """Full HF tensors (in ParamMap.hf_names order) from all TP ranks' shards, rank order (expert
    kinds: the expert TP group's shards)."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "vocab":
        return [torch.cat(list(shards), dim=0)[: dims.vocab]]
    if kind in ("row", "expert_row"):
        return [torch.cat(list(shards), dim=1)]
    if kind == "qkv":
        return _deinterleave_qkv(torch.cat(list(shards), dim=0), dims)
    if kind in ("fc1", "expert_fc1"):
        halves = [s.chunk(2, dim=0) for s in shards]  # each shard = [gate_r; up_r]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise AssertionError(f"unknown kind {kind}")


def merge_shards_into(
    kind: str, shards: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *, dims: Dims
) -> None:
    """merge_shards written straight into `outputs` (the full HF tensors, e.g. views of a flat
    export bucket), shard by shard: no full-size temporary. Same values, bit for bit."""
    t = len(shards)
    if kind == "replicated":
        outputs[0].copy_(shards[0])
    elif kind == "vocab":
        rows = shards[0].shape[0]
        for r, shard in enumerate(shards):
            start, stop = r * rows, min((r + 1) * rows, dims.vocab)
            if start < stop:
                outputs[0][start:stop].copy_(shard[: stop - start])
    elif kind in ("row", "expert_row"):
        cols = shards[0].shape[1]
        for r, shard in enumerate(shards):
            outputs[0][:, r * cols : (r + 1) * cols].copy_(shard)
    elif kind in ("fc1", "expert_fc1"):
        half = shards[0].shape[0] // 2
        for r, shard in enumerate(shards):
            outputs[0][r * half : (r + 1) * half].copy_(shard[:half])
            outputs[1][r * half : (r + 1) * half].copy_(shard[half:])
    elif kind == "qkv":
        d, groups = dims.head_dim, dims.num_groups // t  # query groups per shard
        q_rows = dims.num_heads // dims.num_groups * d
        for r, shard in enumerate(shards):
            grouped = shard.reshape(groups, q_rows + 2 * d, *shard.shape[1:])
            q, k, v = torch.split(grouped, [q_rows, d, d], dim=1)
            g0 = r * groups
            for out, part, rows in ((outputs[0], q, q_rows), (outputs[1], k, d), (outputs[2], v, d)):
                out[g0 * rows : (g0 + groups) * rows].copy_(part.reshape(-1, *shard.shape[1:]))
    else:
        raise AssertionError(f"unknown kind {kind}")


def read_shard(
    kind: str,
    hf_names: Sequence[str],
    read_rows,
    *,
    tp_rank: int,
    tp_size: int,
    dims: Dims,
    vocab_rows: int | None = None,
) -> torch.Tensor:
    """Like shard_for_rank, but reads only the rows / columns this rank needs.

    read_rows(name, start, stop, dim) returns tensor[name] restricted to [start, stop) along dim
    (safetensors' get_slice does this without reading the rest of the file), so a TP rank reads
    1/tp of each split tensor instead of all of it. Same result as shard_for_rank, bit for bit
    (vocab_rows likewise: the model's padded vocabulary over all ranks, default padded_vocab_size).
    """
    t, r = tp_size, tp_rank
    if kind == "replicated":
        return read_rows(hf_names[0], None, None, 0)
    if kind == "vocab":
        rows = (vocab_rows or padded_vocab_size(dims.vocab, tp=t)) // t
        start, stop = r * rows, (r + 1) * rows
        real = read_rows(hf_names[0], min(start, dims.vocab), min(stop, dims.vocab), 0)
        shard = real.new_zeros(rows, dims.hidden)
        shard[: real.size(0)] = real
        return shard
    if kind in ("row", "expert_row"):
        cols = dims.num_heads * dims.head_dim if "o_proj" in hf_names[0] else dims.ffn_of(kind)
        return read_rows(hf_names[0], r * cols // t, (r + 1) * cols // t, 1)
    if kind in ("fc1", "expert_fc1"):
        ffn = dims.ffn_of(kind)
        return torch.cat([read_rows(n, r * ffn // t, (r + 1) * ffn // t, 0) for n in hf_names], dim=0)
    if kind == "qkv":
        groups = dims.num_groups // t  # this rank's query groups: [r*groups, (r+1)*groups)
        q_rows = dims.num_heads // dims.num_groups * dims.head_dim
        q = read_rows(hf_names[0], r * groups * q_rows, (r + 1) * groups * q_rows, 0)
        k, v = (read_rows(n, r * groups * dims.head_dim, (r + 1) * groups * dims.head_dim, 0) for n in hf_names[1:])
        local = Dims(**{**dims.__dict__, "num_groups": groups, "num_heads": dims.num_heads // t})
        return _interleave_qkv(q, k, v, local)
    raise AssertionError(f"unknown kind {kind}")

"""Stream full, HF-named tensors out of a TP x PP (x VPP) sharded Megatron model, and bucket them.

    for bucket in bucketize(iter_hf_weights(chunks, hf_config, layout=layout), max_bytes=512 << 20):
        engine.update_weights(bucket)          # list of (hf_name, tensor)

iter_hf_weights is a COLLECTIVE: every rank of the job must iterate it to the end, in step. For
each HF tensor (in a fixed order: embedding, layers 0..L-1, final norm, lm_head):
  1. the PP stage that owns it all-gathers the megatron shards over its TP group (the expert TP
     group for expert matrices) and merges them into full HF tensors (mapping.merge_shards:
     un-interleave QKV, split fc1, drop vocab padding);
  2. expert matrices: local expert j of every EP rank q (global expert q * E/ep + j) is all-gathered
     over the expert-parallel group, so the stage holds all E experts' tensors for index j;
  3. the owner broadcasts each full tensor over the PP group,
so EVERY rank yields every (hf_name, full tensor), identical across ranks (DP/CP replicas repeat
the same work in their own groups). Tensors keep the parameter dtype and device. Callers that
only need them on the driver simply ignore them elsewhere. Peak extra memory: one parameter's
full tensors (e.g. 7B QKV: 3584 x 4608 x 2 bytes = 33 MB; Qwen3-30B-A3B, EP=8: 8 experts' gate+up,
8 x 2 x 768 x 2048 x 2 bytes = 50 MB), not the model. Experts stream in the public per-expert
layout (`mlp.experts.{e}.gate_proj.weight`, ...), the names SGLang loads, grouped by local index
(EP=2, 4 experts: 0, 2, 1, 3).
Tied embeddings: no lm_head.weight is yielded (HF drops it from tied checkpoints too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.weights.load import chunk_param_maps, expert_offset, unwrap_model
from dapo_megatron.weights.mapping import Dims, ParamMap, expected_hf_shapes, merge_shards

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    tensor = tensor.detach().contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    coll.all_gather(out, tensor, group=group)
    return out


def _shard_all_gather(shard: torch.Tensor, pmap: ParamMap, layout: ParallelLayout) -> list[torch.Tensor]:
    """All ranks' shards of a split parameter: over the expert TP group for experts, TP otherwise."""
    if pmap.is_expert:
        return _all_gather(shard, layout.etp_group, layout.etp_size)
    return _all_gather(shard, layout.tp_group, layout.tp_size)


def _with_expert(names: Sequence[str], expert: int) -> tuple[str, ...]:
    return tuple(re.sub(r"\.experts\.\d+\.", f".experts.{expert}.", n) for n in names)


def _local_maps(model_chunks: Sequence[torch.nn.Module], dims: Dims) -> dict[str, tuple[ParamMap, torch.Tensor]]:
    """Key -> (mapping, parameter) for each parameter this rank holds. The key is the HF name of
    its first tensor, for experts as on EP rank 0 (local expert j -> expert j), so that every EP
    rank iterates the same keys in step.

    The output layer is skipped when tied (its HF tensor is the embedding's) and, on the last
    stage of a tied PP>1 model, would duplicate model.embed_tokens.weight.
    """
    local: dict[str, tuple[ParamMap, torch.Tensor]] = {}
    for chunk in model_chunks:
        for pmap, param in chunk_param_maps(unwrap_model(chunk), dims, first_expert=0):
            if pmap.mcore_name == "output_layer.weight" and dims.tied:
                continue
            local[pmap.hf_names[0]] = (pmap, param)
    return local


def _full_tensors(
    pmap: ParamMap, param: torch.Tensor, dims: Dims, layout: ParallelLayout
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of one local parameter; for an expert, of the same local expert on
    every EP rank (collective over the TP / expert-TP and EP groups)."""
    tensors = merge_shards(pmap.kind, _shard_all_gather(param.detach(), pmap, layout), dims=dims)
    ep = layout.ep_size if pmap.is_expert else 1
    local_expert = pmap.local_expert or 0  # set on every expert parameter (is_expert)
    if ep == 1:
        return list(
            zip(
                _with_expert(pmap.hf_names, expert_offset(dims, layout=layout) + local_expert)
                if pmap.is_expert
                else pmap.hf_names,
                tensors,
            )
        )
    per_rank = [_all_gather(t, layout.ep_group, ep) for t in tensors]  # [tensor k][ep rank q]
    num_local = dims.experts.num_experts // ep
    out: list = []
    for q in range(ep):
        names = _with_expert(pmap.hf_names, q * num_local + local_expert)
        out.extend(zip(names, (gathered[q] for gathered in per_rank)))
    return out


def iter_hf_weights(
    model_chunks: Iterable[torch.nn.Module], hf_config: PretrainedConfig, *, layout: ParallelLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every tensor of the HF checkpoint, on every rank (see top)."""
    chunks = list(model_chunks)
    dims = Dims.from_hf(hf_config)
    shapes = expected_hf_shapes(dims)
    local = _local_maps(chunks, dims)
    ep = layout.ep_size
    pp_size = layout.pp_size
    pp_group = layout.pp_group if pp_size > 1 else None
    # owner PP stage of every parameter (keyed by its first HF name): one small exchange up front
    owners: dict[str, int] = dict.fromkeys(local, 0)
    if pp_size > 1:
        gathered: list[list[str]] = [[] for _ in range(pp_size)]  # every stage's parameter names
        coll.all_gather_object(gathered, sorted(local), group=pp_group)
        owners = {name: stage for stage, names in enumerate(gathered) for name in names}
        pp_ranks = dist.get_process_group_ranks(pp_group)
    my_stage = layout.pp_rank
    reference = next(iter(local.values()))[1]  # any local parameter: dtype and device to use
    for first_name in [n for n in shapes if n in owners]:
        if first_name in local:
            pmap, param = local[first_name]
            names, tensors = zip(*_full_tensors(pmap, param, dims, layout))
        else:
            names, tensors = _names_owned_with(first_name, dims, ep=ep), None
        for j, name in enumerate(names):
            if pp_size > 1:
                owner = owners[first_name]
                if my_stage == owner:
                    assert tensors is not None  # the owner holds the parameter
                    tensor = tensors[j].contiguous()
                else:
                    tensor = torch.empty(shapes[name], dtype=reference.dtype, device=reference.device)
                coll.broadcast(tensor, src=pp_ranks[owner], group=pp_group)
            else:
                assert tensors is not None  # one stage: this rank holds every parameter
                tensor = tensors[j]
            yield name, tensor


def _names_owned_with(first_name: str, dims: Dims, *, ep: int) -> tuple[str, ...]:
    """HF names the owner of first_name's parameter yields, in its order (q -> q, k, v; gate ->
    gate, up; local expert j -> the same matrices of experts q * E/ep + j for every EP rank q), for
    ranks that do not hold the parameter and must know what the owner broadcasts."""
    names: tuple[str, ...] = (first_name,)
    for first, rest in ((".q_proj.", (".k_proj.", ".v_proj.")), (".gate_proj.", (".up_proj.",))):
        if first in first_name:
            names = (first_name, *(first_name.replace(first, r) for r in rest))
            break
    match = re.search(r"\.experts\.(\d+)\.", first_name)
    if match is None:
        return names
    num_local = dims.experts.num_experts // ep
    return tuple(n for q in range(ep) for n in _with_expert(names, q * num_local + int(match.group(1))))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive (name, tensor) pairs into lists of at most max_bytes in total.

    Order is kept. A tensor larger than max_bytes on its own is yielded alone (never split).
    """
    if max_bytes <= 0:
        raise ValueError(f"rollout.weight_bucket_mb: bucket bound must be positive, got {max_bytes} bytes")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

"""Stream full, HF-named tensors out of a TP x PP (x VPP) sharded Megatron model, and bucket them.

    for bucket in bucketize(iter_hf_weights(chunks, hf_config), max_bytes=512 << 20):
        engine.update_weights(bucket)          # list of (hf_name, tensor)

iter_hf_weights is a COLLECTIVE: every rank of the job must iterate it to the end, in step. For
each HF tensor (in a fixed order: embedding, layers 0..L-1, final norm, lm_head):
  1. the PP stage that owns it all-gathers the megatron shards over its TP group and merges them
     into full HF tensors (mapping.merge_shards: un-interleave QKV, split fc1, drop vocab padding);
  2. the owner broadcasts each full tensor over the PP group,
so EVERY rank yields every (hf_name, full tensor), identical across ranks (DP/CP replicas repeat
the same work in their own groups). Tensors keep the parameter dtype and device. Callers that
only need them on the driver simply ignore them elsewhere. Peak extra memory: one parameter's
full tensors (e.g. 7B QKV: 3584 x 4608 x 2 bytes = 33 MB), not the model.
Tied embeddings: no lm_head.weight is yielded (HF drops it from tied checkpoints too).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from dapo_megatron.weights.load import chunk_param_maps, unwrap_model
from dapo_megatron.weights.mapping import Dims, ParamMap, expected_hf_shapes, merge_shards


def _tp_all_gather(shard: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return [shard]
    shard = shard.detach().contiguous()
    out = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(out, shard, group=parallel_state.get_tensor_model_parallel_group())
    return out


def _local_maps(model_chunks: Sequence[Any], dims: Dims) -> dict[str, tuple[ParamMap, torch.Tensor]]:
    """HF name of the first tensor of each parameter this rank holds -> (mapping, parameter).

    The output layer is skipped when tied (its HF tensor is the embedding's) and, on the last
    stage of a tied PP>1 model, would duplicate model.embed_tokens.weight.
    """
    local: dict[str, tuple[ParamMap, torch.Tensor]] = {}
    for chunk in model_chunks:
        for pmap, param in chunk_param_maps(unwrap_model(chunk), dims):
            if pmap.mcore_name == "output_layer.weight" and dims.tied:
                continue
            local[pmap.hf_names[0]] = (pmap, param)
    return local


def iter_hf_weights(model_chunks: Iterable[Any], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every tensor of the HF checkpoint, on every rank (see top)."""
    from megatron.core import parallel_state

    chunks = list(model_chunks)
    dims = Dims.from_hf(hf_config)
    shapes = expected_hf_shapes(dims)
    local = _local_maps(chunks, dims)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group() if pp_size > 1 else None
    # owner PP stage of every parameter (keyed by its first HF name): one small exchange up front
    owners: dict[str, int] = {name: 0 for name in local}
    if pp_size > 1:
        gathered: list[Any] = [None] * pp_size
        dist.all_gather_object(gathered, sorted(local), group=pp_group)
        owners = {name: stage for stage, names in enumerate(gathered) for name in names}
        pp_ranks = dist.get_process_group_ranks(pp_group)
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    reference = next(iter(local.values()))[1]  # any local parameter: dtype and device to use
    for first_name in [n for n in shapes if n in owners]:
        if first_name in local:
            pmap, param = local[first_name]
            names = pmap.hf_names
            tensors = merge_shards(pmap.kind, _tp_all_gather(param.detach()), dims=dims)
        else:
            names, tensors = _names_owned_with(first_name, shapes), None
        for j, name in enumerate(names):
            if pp_size > 1:
                owner = owners[first_name]
                tensor = tensors[j].contiguous() if my_stage == owner else torch.empty(
                    shapes[name], dtype=reference.dtype, device=reference.device)
                dist.broadcast(tensor, src=pp_ranks[owner], group=pp_group)
            else:
                tensor = tensors[j]
            yield name, tensor


def _names_owned_with(first_name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """HF names that travel with first_name in one megatron parameter (q -> q, k, v; gate -> gate,
    up), for ranks that do not hold the parameter and must know what the owner broadcasts."""
    for first, rest in ((".q_proj.", (".k_proj.", ".v_proj.")), (".gate_proj.", (".up_proj.",))):
        if first in first_name:
            return (first_name, *(first_name.replace(first, r) for r in rest))
    return (first_name,)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
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

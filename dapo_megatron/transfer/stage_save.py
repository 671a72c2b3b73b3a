"""The HF checkpoint written by the pipeline stages themselves: each stage's exporter streams its
own safetensors shards, global rank 0 adds one model.safetensors.index.json, config.json and the
tokenizer files, and renames the directory into place.

    save_hf_by_stage(StageExporter(chunks, hf_config, layout, bucket_bytes=512 << 20), hf_config, out_dir,
                     max_shard_bytes=5 << 30, copy_from=hf_dir)            # collective, every rank

Shards are groups of consecutive export buckets of at most max_shard_bytes (a bigger bucket
alone), so the exporter holds export buckets (hundreds of MB), never a 5 GB shard: a shard file's
header is written from the manifest before its first bucket arrives (every name, dtype and shape is
known up front), then each bucket's tensors are appended as they come. Files are numbered over
all stages (stage 0's first), `model-0000k-of-0000n.safetensors` as transformers writes them.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dapo_megatron.transfer.stage_export import ExportItem, StageExporter, gather_manifests, plan_buckets
from dapo_megatron.weights.save import finish_hf_dir, shard_file_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_files(buckets: Sequence[Sequence[ExportItem]], max_bytes: int) -> list[list[int]]:
    """Bucket indices of each shard file: consecutive, at most max_bytes of tensors per file."""
    files: list[list[int]] = []
    size = 0
    for index, items in enumerate(buckets):
        nbytes = sum(item.nbytes for item in items)
        if files and size + nbytes <= max_bytes:
            files[-1].append(index)
            size += nbytes
        else:
            files.append([index])
            size = nbytes
    return files


def safetensors_header(items: Sequence[ExportItem]) -> bytes:
    """The 8-byte length + JSON header of a file holding these items' tensors back to back (the
    safetensors format: offsets relative to the data section, no holes, header padded to 8 bytes)."""
    header: dict[str, dict[str, object]] = {"__metadata__": {"format": "pt"}}  # name -> dtype, shape, offsets
    offset = 0
    for item in items:
        for name, shape, size in zip(item.names, item.shapes, item.sizes()):
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[item.dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_tensor(handle, tensor: torch.Tensor) -> None:
    handle.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)


def save_hf_by_stage(
    exporter: StageExporter,
    hf_config: PretrainedConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 << 30,
    copy_from: str | os.PathLike | None = None,
) -> Path:
    """Collective over the world (module docstring). Returns out_dir on every rank."""
    stage = exporter.layout.pp_rank
    out_dir = Path(out_dir).absolute()
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-stages")
    manifests = gather_manifests(exporter)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
    dist.barrier()
    files_per_stage: list[list[list[int]]] = []  # the driver's and the exporters' (they hold manifests)
    if manifests is not None:
        files_per_stage = [plan_files(plan_buckets(m, exporter.bucket_bytes), max_shard_bytes) for m in manifests]
        total = sum(len(f) for f in files_per_stage)
        first = sum(len(f) for f in files_per_stage[:stage])
        bucket_file = {b: k for k, bs in enumerate(files_per_stage[stage]) for b in bs}
    handle, current = None, -1
    try:
        for index, bucket in enumerate(exporter.buckets()):
            if exporter.is_exporter:
                k = bucket_file[index]
                if k != current:  # a new shard file: its header first, from the plan
                    if handle is not None:
                        handle.close()
                    handle, current = open(tmp_dir / shard_file_name(first + k, total), "wb"), k  # noqa: SIM115 - open across buckets
                    members = [exporter.plan[b] for b in files_per_stage[stage][k]]
                    handle.write(safetensors_header([item for items in members for item in items]))
                for _, tensor in bucket.named:
                    _write_tensor(handle, tensor)
            del bucket
    finally:
        if handle is not None:
            handle.close()
    dist.barrier()
    if dist.get_rank() == 0:
        assert manifests is not None, "gather_manifests gives the driver every stage's"
        weight_map, size = {}, 0
        for stage, manifest in enumerate(manifests):
            buckets = plan_buckets(manifest, exporter.bucket_bytes)
            offset = sum(len(f) for f in files_per_stage[:stage])
            for k, file_buckets in enumerate(files_per_stage[stage]):
                for item in (item for b in file_buckets for item in buckets[b]):
                    weight_map.update({name: shard_file_name(offset + k, total) for name in item.names})
                    size += item.nbytes
        finish_hf_dir(
            tmp_dir, out_dir, weight_map=weight_map, total_size=size, hf_config=hf_config, copy_from=copy_from
        )
    dist.barrier()
    return out_dir

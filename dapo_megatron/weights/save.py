"""Write HF-named tensors as a Hugging Face checkpoint directory (sharded safetensors + index +
config.json), atomically: everything goes to a temporary sibling directory that is renamed into
place at the end, so an interrupted save never leaves a half-written checkpoint under out_dir.

    save_hf_checkpoint(iter_hf_weights(chunks, hf_config, layout=layout), hf_config, "/ckpt/step_100_hf")
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dapo_megatron.weights.export import bucketize, tensor_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Files copied next to the weights when `copy_from` is given (tokenizer, generation defaults).
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "added_tokens.json",
)


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config: PretrainedConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 << 30,
    copy_from: str | os.PathLike | None = None,
) -> Path:
    """Write model-0000k-of-0000n.safetensors shards of at most max_shard_bytes (a bigger tensor
    gets its own shard), model.safetensors.index.json and config.json into out_dir; returns it.

    An existing out_dir is replaced only after the new one is complete. `copy_from`: a HF directory
    whose tokenizer / generation files are copied along.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        shard_names: list[list[str]] = []
        total = 0
        for k, bucket in enumerate(bucketize(named_tensors, max_shard_bytes)):
            # clone: tensors that share storage (tied embeddings) cannot go into one safetensors file
            tensors = {name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format) for name, t in bucket}
            save_file(tensors, str(tmp_dir / f"shard-{k}.tmp"), metadata={"format": "pt"})
            shard_names.append(list(tensors))
            total += sum(tensor_bytes(t) for t in tensors.values())
        if not shard_names:
            raise ValueError("save_hf_checkpoint: no tensors to save")
        n = len(shard_names)
        weight_map = {}
        for k, names in enumerate(shard_names):
            file_name = shard_file_name(k, n)
            os.replace(tmp_dir / f"shard-{k}.tmp", tmp_dir / file_name)
            weight_map.update(dict.fromkeys(names, file_name))
        finish_hf_dir(
            tmp_dir, out_dir, weight_map=weight_map, total_size=total, hf_config=hf_config, copy_from=copy_from
        )
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def finish_hf_dir(
    tmp_dir: Path,
    out_dir: Path,
    *,
    weight_map: dict[str, str],
    total_size: int,
    hf_config: PretrainedConfig,
    copy_from: str | os.PathLike | None,
) -> None:
    """Index, config and tokenizer files into tmp_dir, then tmp_dir becomes out_dir (an existing
    out_dir is replaced only now)."""
    with open(tmp_dir / "model.safetensors.index.json", "w", encoding="utf-8") as handle:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, handle, indent=2)
    hf_config.save_pretrained(str(tmp_dir))
    if copy_from is not None:
        for name in AUX_FILES:
            src = Path(copy_from) / name
            if src.exists():
                shutil.copy2(src, tmp_dir / name)
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
        os.replace(tmp_dir, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, out_dir)

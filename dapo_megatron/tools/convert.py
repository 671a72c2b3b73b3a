"""`dapo-megatron convert`: HF checkpoint <-> Megatron distributed checkpoint (dist_checkpointing); its
command line and examples: tools/convert_args.py (which imports no torch, so `convert --help` answers at once).

hf-to-mcore builds the model in the given layout, loads the safetensors into the shards
(weights/load.py) and saves the model's sharded state dict with megatron's dist_checkpointing
under the key "model" (one chunk) or "model0".. (VPP), the keys Actor.save uses, plus config.json
and convert_meta.json. Megatron's distributed format is layout-independent, so mcore-to-hf may run
with ANY TP/PP/VPP/EP/ETP (expert tensors are stored per global expert): it reads the embedding's padded row count and
dtype from the checkpoint
metadata (converted checkpoints pad to 128 x tp, Actor checkpoints not at all), builds the model in
that layout, loads the model part of a converted or an
Actor checkpoint (optimizer and RNG entries are ignored), streams full tensors out
(iter_hf_weights) and writes sharded safetensors + index + config.json + tokenizer files on
global rank 0. Both outputs are written to a temporary sibling and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_megatron.actor.model import build_model_chunks, padded_vocab_size
from dapo_megatron.actor.parallel import init_distributed, model_parallel
from dapo_megatron.tools.convert_args import parse
from dapo_megatron.weights.export import iter_hf_weights
from dapo_megatron.weights.load import load_hf_into_model
from dapo_megatron.weights.save import save_hf_checkpoint

_DTYPE_TO_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _precision_of(hf_config: object, requested: str | None) -> str:
    if requested:
        return requested
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return _DTYPE_TO_PRECISION.get(dtype, "fp32")


def _state_key(index: int, num_chunks: int) -> str:
    return "model" if num_chunks == 1 else f"model{index}"


def _barrier() -> None:
    dist.barrier()


def hf_to_mcore(
    *,
    hf_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    vpp: int | None,
    precision: str | None,
    vocab_divisible_by: int = 128,
    ep: int = 1,
    etp: int | None = None,
) -> Path:
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    final = Path(out_dir).absolute()
    tmp = final.with_name(final.name + ".tmp")
    with model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp) as layout:
        chunks = build_model_chunks(
            hf_config,
            attention_backend="torch",
            precision=_precision_of(hf_config, precision),
            vocab_divisible_by=vocab_divisible_by,
        )
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = {_state_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
        dist_checkpointing.save(state, str(tmp))
        _barrier()
    if dist.get_rank() == 0:
        hf_config.save_pretrained(str(tmp))
        meta = {
            "source": str(Path(hf_dir).absolute()),
            "layout": {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "etp": etp},
        }
        (tmp / "convert_meta.json").write_text(json.dumps(meta, indent=2))
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _checkpoint_vocab_and_dtype(mcore_dir: str) -> tuple[int, torch.dtype]:
    """Padded vocabulary rows and parameter dtype of the embedding stored in a checkpoint."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(mcore_dir)
    for key, tensor in metadata.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(tensor.global_shape[0]), tensor.dtype
    raise ValueError(f"--mcore {mcore_dir}: no embedding.word_embeddings.weight in the checkpoint")


def _vocab_divisible_by_for(rows: int, vocab: int, tp: int, mcore_dir: str) -> int:
    """The vocab_divisible_by that rebuilds `rows` padded rows at this TP size."""
    for candidate in (1, 128, rows // tp):
        if candidate >= 1 and rows % tp == 0 and padded_vocab_size(vocab, tp=tp, divisible_by=candidate) == rows:
            return candidate
    raise ValueError(
        f"--mcore {mcore_dir}: its embedding has {rows} rows; vocabulary {vocab} cannot be padded to that at --tp {tp}"
    )


def mcore_to_hf(
    *,
    mcore_dir: str,
    hf_config_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    vpp: int | None,
    precision: str | None,
    ep: int = 1,
    etp: int | None = None,
) -> Path:
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    if not (Path(mcore_dir) / "metadata.json").exists():
        raise ValueError(f"--mcore {mcore_dir}: not a Megatron distributed checkpoint (no metadata.json)")
    hf_config = AutoConfig.from_pretrained(hf_config_dir)
    # rebuild the checkpoint's own vocabulary padding and dtype (Actor checkpoints use no padding)
    rows, dtype = _checkpoint_vocab_and_dtype(mcore_dir)
    divisible_by = _vocab_divisible_by_for(rows, hf_config.vocab_size, tp, mcore_dir)
    with model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp) as layout:
        chunks = build_model_chunks(
            hf_config,
            attention_backend="torch",
            precision=precision or _DTYPE_TO_PRECISION.get(dtype, "fp32"),
            vocab_divisible_by=divisible_by,
        )
        state = {_state_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
        loaded = dist_checkpointing.load(state, mcore_dir)
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[_state_key(i, len(chunks))], strict=False)
        tensors = iter_hf_weights(chunks, hf_config, layout=layout)
        if dist.get_rank() == 0:
            save_hf_checkpoint(tensors, hf_config, out_dir, copy_from=hf_config_dir)
        else:
            for _ in tensors:  # a collective: every rank streams, only the driver writes
                pass
        _barrier()
    return Path(out_dir)


def main(argv: Sequence[str]) -> int:
    """Entry point of `dapo-megatron convert` (see the module docstring); run under torchrun."""
    args = parse(argv)
    created = not dist.is_initialized()
    init_distributed()
    try:
        if args.direction == "hf-to-mcore":
            out = hf_to_mcore(
                hf_dir=args.hf,
                out_dir=args.out,
                tp=args.tp,
                pp=args.pp,
                vpp=args.vpp,
                precision=args.precision,
                vocab_divisible_by=args.vocab_divisible_by,
                ep=args.ep,
                etp=args.etp,
            )
        else:
            out = mcore_to_hf(
                mcore_dir=args.mcore,
                hf_config_dir=args.hf_config,
                out_dir=args.out,
                tp=args.tp,
                pp=args.pp,
                vpp=args.vpp,
                precision=args.precision,
                ep=args.ep,
                etp=args.etp,
            )
        if dist.get_rank() == 0:
            print(f"convert {args.direction}: wrote {out}", flush=True)
    finally:
        if created:
            dist.destroy_process_group()
    return 0

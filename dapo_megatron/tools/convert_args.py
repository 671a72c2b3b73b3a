"""`dapo-megatron convert`: HF checkpoint <-> Megatron distributed checkpoint (dist_checkpointing).

    torchrun --nproc-per-node 4 -m dapo_megatron.cli convert hf-to-mcore --hf /ckpt/Qwen2.5-7B \
        --out /ckpt/qwen7b_mcore --tp 2 --pp 2
    torchrun --nproc-per-node 2 -m dapo_megatron.cli convert mcore-to-hf --mcore /runs/x/ckpt/step_100 \
        --hf-config /ckpt/Qwen2.5-7B --out /ckpt/step_100_hf --tp 2
    torchrun --nproc-per-node 8 -m dapo_megatron.cli convert hf-to-mcore --hf /ckpt/Qwen3-30B-A3B \
        --out /ckpt/qwen3moe_mcore --tp 2 --ep 4 --etp 1

What each direction does: tools/convert.py. This module imports no torch: `convert --help` answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True)
    to_mcore.add_argument("--out", required=True)
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    to_hf.add_argument("--mcore", required=True)
    to_hf.add_argument("--hf-config", required=True, help="HF directory with config.json (and tokenizer files)")
    to_hf.add_argument("--out", required=True)
    to_mcore.add_argument(
        "--vocab-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x tp (Megatron-LM's default 128; the actor uses 1)",
    )
    for p in (to_mcore, to_hf):
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--vpp", type=int, default=None)
        p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
        p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
        p.add_argument(
            "--precision",
            choices=["fp32", "bf16", "fp16"],
            default=None,
            help="parameter dtype (default: the HF config's dtype / the checkpoint's)",
        )
    return parser.parse_args(list(argv))

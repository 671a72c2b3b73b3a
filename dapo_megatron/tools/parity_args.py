"""`dapo-megatron check-parity`: do Megatron (this TP x PP x CP layout) and transformers agree on the
per-token log-probs of a HF checkpoint? Run it before a long job on a new model.

    torchrun --nproc-per-node 2 -m dapo_megatron.cli check-parity --model /ckpt/Qwen2.5-7B --tp 2 --pp 1
    torchrun --nproc-per-node 4 -m dapo_megatron.cli check-parity --model DIR --tp 2 --pp 2 --seqs 4 --seq-len 64
    torchrun --nproc-per-node 4 -m dapo_megatron.cli check-parity --model DIR --tp 2 --cp 2
    torchrun --nproc-per-node 2 -m dapo_megatron.cli check-parity --model DIR --tp 2 --sequence-parallel --fused-logprob
    torchrun --nproc-per-node 2 -m dapo_megatron.cli check-parity --model /ckpt/Qwen3-30B-A3B --ep 2   # MoE

How it compares, and the measured differences: tools/parity.py. This module imports no torch:
`check-parity --help` answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron check-parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (sequences padded to 2*cp)")
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (--tp > 1)")
    parser.add_argument(
        "--fused-logprob",
        action="store_true",
        help="score through the actor's LM head and dapo_kernels' fused log-prob/entropy kernel "
        "(Triton; interpreted on CPU): log-probs and entropies vs transformers, head "
        "gradients vs the plain-torch head",
    )
    parser.add_argument(
        "--vocab-divisible-by",
        type=int,
        default=128,
        help="Megatron pads the vocabulary to a multiple of this x tp (Megatron-LM's 128; the "
        "actor uses 1); padding rows are excluded from the softmax",
    )
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument(
        "--grad-tolerance",
        type=float,
        default=1e-4,
        help="--fused-logprob: max |fused - torch| / max |torch| of the head's gradients",
    )
    parser.add_argument("--seqs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--attention-backend", choices=["torch", "te"], default="torch")
    parser.add_argument(
        "--reference-dtype",
        choices=["auto", "same", "fp64"],
        default="auto",
        help="transformers' dtype: that of --precision (same), or float64 (then the diff is "
        "Megatron's own rounding, without transformers' fp32 rounding on top); auto: "
        "float64 without CUDA, same on GPUs",
    )
    args = parser.parse_args(list(argv))
    if args.seq_len < 2 or args.seqs < 1:
        raise ValueError(f"--seq-len must be >= 2 and --seqs >= 1 (got {args.seq_len}, {args.seqs})")
    for name in ("tp", "pp", "cp", "vocab_divisible_by"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.sequence_parallel and args.tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1")
    return args

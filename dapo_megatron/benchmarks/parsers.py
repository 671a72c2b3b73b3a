"""The command lines of the benchmarks that import torch: here, without torch, so that `dapo-megatron bench
NAME --help` answers at once (benchmarks/run.py asks this module first; each benchmark parses with the
same parser). What each benchmark measures: its own module's docstring.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dapo_megatron.benchmarks.run import add_output_args

ACTOR_SHAPES = ("qwen2.5-1.5b", "tiny")  # benchmarks/actor.py's SHAPES, in this order
# bench dataplane's default layouts: WORLD:PARTS
DEFAULT_LAYOUTS = ("2:dp2", "2:tp2", "2:pp2", "4:dp4", "4:tp2,dp2", "4:pp2,dp2", "4:tp2,pp2", "4:cp2,dp2")


def _new(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"dapo-megatron bench {name}",
        description=f"{description} (dapo_megatron/benchmarks/{name.replace('-', '_')}.py says how)",
    )


def actor() -> argparse.ArgumentParser:
    parser = _new("actor", "Actor training throughput, MFU and peak memory of a model with random weights")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens per micro-batch")
    parser.add_argument("--shape", choices=sorted(ACTOR_SHAPES), default="qwen2.5-1.5b")
    parser.add_argument(
        "--attention-kernel",
        nargs="+",
        choices=["sdpa", "flex", "varlen"],
        default=["sdpa"],
        help="actor.attention_kernel of the torch backend (flex, varlen: CUDA only); several: one row each, "
        "measured on the same built model one after the other",
    )
    parser.add_argument(
        "--packing",
        choices=["equal", "dapo"],
        default="equal",
        help="equal: --seqs-per-mb sequences of equal length; dapo: 14 sequences of 256 to 8,192 tokens at "
        "24,576 (DAPO_PACKING_24K, scaled to --tokens)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak of one device for MFU (default: 989, H100 bf16, on CUDA; none on CPU)",
    )
    parser.add_argument("--seqs-per-mb", type=int, default=2)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompt length of every sequence (default min(256, half the sequence))",
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per DP rank per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (after one warm-up step)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--attention", choices=["torch", "te"], default="torch")
    parser.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="actor.recompute; the presets use full where selective does not fit (16K+ tokens at 1.5B)",
    )
    parser.add_argument(
        "--count-syncs",
        action="store_true",
        help="CUDA: run the measured steps under torch.cuda.set_sync_debug_mode('warn') and count "
        "the host syncs (column host_syncs; the most frequent call sites are printed)",
    )
    parser.add_argument("--checkpoint-dir", default="", help="reuse / write the random HF checkpoint here")
    add_output_args(parser, name="actor")
    return parser


def dataplane() -> argparse.ArgumentParser:
    parser = _new("dataplane", "The data plane of one DAPO step at the 32B preset's shape, on gloo ranks here")
    parser.add_argument(
        "--layouts",
        default=";".join(DEFAULT_LAYOUTS),
        help="';'-separated WORLD:PARTS, parts tpN/ppN/cpN/dpN (default: %(default)s)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (the 32B preset: 512)")
    parser.add_argument("--n", type=int, default=16, help="responses per prompt")
    parser.add_argument("--bucket-mb", type=int, default=32, help="weight bucket bound (rollout.weight_bucket_mb)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a layout's ranks")
    parser.add_argument("--results-dir", default="results", help="rows go to DIR/dataplane.csv (default ./results)")
    parser.add_argument("--csv", default=None, help="append to this CSV file instead")
    return parser


def rollout() -> argparse.ArgumentParser:
    ap = _new("rollout", "Generation throughput of a random Qwen2 behind serve-rollout, and weight-sync bandwidth")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    add_output_args(ap, name="rollout")
    return ap


def rollout_quant() -> argparse.ArgumentParser:
    ap = _new("rollout-quant", "bf16 vs modelopt FP8 rollout on this machine's CPU engine")
    ap.add_argument("--model", default="", help="HF model directory with a tokenizer (default: a random Qwen2)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=16, help="concurrent requests (synthetic addition prompts)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap, name="rollout_quant")
    return ap


def overlap() -> argparse.ArgumentParser:
    ap = _new("overlap", "The embedded task at rollout.max_staleness 0 and 1, alternating: step time, hidden share")
    ap.add_argument("--config", default="configs/runs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (default: at the end)")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (staleness 0, then 1)")
    ap.add_argument("--first", type=int, choices=(0, 1), default=0, help="which staleness runs first in each pair")
    ap.add_argument(
        "--engine-cores",
        default="",
        help="CPU cores of the engine, e.g. 0 (rollout.cpu_engine_cores; default: not pinned)",
    )
    ap.add_argument(
        "--actor-cores",
        default="",
        help="CPU cores of the actor ranks, e.g. 1 (actor.cpu_cores). With "
        "--engine-cores: each side on cores of its own, as disaggregated engines on GPUs of their own",
    )
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run")
    add_output_args(ap, name="overlap")
    return ap


def engine_abuse() -> argparse.ArgumentParser:
    ap = _new("engine-abuse", "A CPU engine (serve-rollout) under hostile input: 5xx count, peak RSS")
    ap.add_argument("--model", default="", help="HF checkpoint the engine serves (default: a tiny random Qwen2)")
    ap.add_argument("--bodies-per-endpoint", type=int, default=300)
    ap.add_argument("--big-mb", type=int, default=50)
    ap.add_argument(
        "--max-request-mb", type=int, default=0, help="the server's --max-request-bytes in MB (0 = default)"
    )
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap, name="engine_abuse")
    return ap


def engine_health() -> argparse.ArgumentParser:
    ap = _new("engine-health", "How long a CPU engine takes to answer /health while it parses large bodies")
    ap.add_argument("--bodies", type=int, default=5, help="bodies of each kind, posted one after another")
    ap.add_argument("--body-mb", type=float, default=16.7, help="size of each body in MB (the limit is 16.78 MB)")
    ap.add_argument("--kinds", default="idle,generate-input-ids,generate-flat-ids,update-tensor-string")
    ap.add_argument("--label", default="", help="free text stored with the rows (e.g. the commit measured)")
    add_output_args(ap, name="engine_health")
    return ap


RESHARD_SHAPES = ("tiny", "100m")  # benchmarks/reshard.py's SHAPES, in this order
# bench reshard's layouts of 2 ranks: NAME -> the sizes that are not 1
RESHARD_LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}


def reshard() -> argparse.ArgumentParser:
    ap = _new(
        "reshard",
        "An actor checkpoint's save and load seconds and peak memory, saved under one layout, loaded under another",
    )
    ap.add_argument("--shape", choices=RESHARD_SHAPES, default="tiny", help="tiny Qwen2 shape or ~100M parameters")
    ap.add_argument("--save", choices=sorted(RESHARD_LAYOUTS), default="tp1", help="layout of the save (tp1: DP=2)")
    ap.add_argument("--load", choices=sorted(RESHARD_LAYOUTS), default="tp2", help="layout of the load")
    ap.add_argument("--work-dir", default=None, help="where the checkpoints go (kept); default a removed temp dir")
    add_output_args(ap, name="reshard")
    return ap


# `bench NAME` -> its parser (run.py: `bench NAME --help` is answered from here)
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "actor": actor,
    "dataplane": dataplane,
    "rollout": rollout,
    "rollout-quant": rollout_quant,
    "overlap": overlap,
    "engine-abuse": engine_abuse,
    "engine-health": engine_health,
    "reshard": reshard,
}

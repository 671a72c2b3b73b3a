"""Benchmark: LM-head log-prob + entropy, providers side by side (needs a CUDA GPU).

    python -m dapo_kernels.bench.bench_logprob --n 4096,16384 --models 7b --tp 1,8
    dapo-megatron bench kernels --kernels logprob --n 4096 --providers fused,chunked

Providers: fused (dapo_kernels.linear_logprob_entropy, blocked backward: the default), fused_rowchunk
(the same forward, the first backward schedule: backward="row_chunked"; kept until a GPU run has
measured both), fused_cublas (logits="cublas": fp32 logit chunks from cuBLAS read by Triton
epilogues, blocked backward), fused_tma (logits="tma": the persistent TMA-fed Triton kernels of
logprob_persistent.py, blocked backward), torch (eager on materialized fp32 logits:
the reference), chunked (the reference over row chunks under activation checkpointing: bounded
memory, plain torch), liger (LigerFusedLinearCrossEntropyLoss, reduction="none", when importable:
cross entropy = -logprob, NO entropy, and it computes its gradient inside the forward call, so its
"fwd" row already contains the backward work). Modes: fwd (no autograd) and fwd_bwd (backward of
sum(logprob) + sum(entropy)). TP shard widths are single-GPU runs on V_local = V / tp rows (the
per-token all_gather / all-reduce of the vocab-parallel path is not included).
Metrics per (provider, mode, shape): ms (p50/p20/p80 of CUDA-event times), TFLOP/s (2NHV fwd,
8NHV fwd+bwd), percent of a bf16 cuBLAS matmul [N,H]x[H,V_local] timed in the same run, and
peak extra memory (GB above the inputs), and for fwd_bwd rows the extra memory predicted by
kernels/bench/memory_model.py (model_GB; fused, fused_rowchunk and liger), so a GPU run checks the formula.
"""

from __future__ import annotations

import argparse
import re

import torch
from torch.utils.checkpoint import checkpoint

from dapo_kernels import linear_logprob_entropy, linear_logprob_entropy_reference
from dapo_kernels import logprob as logprob_mod
from dapo_kernels.bench import memory_model
from dapo_kernels.bench.common import CsvWriter, PeakMemory, bf16_matmul_tflops, is_oom, print_table, time_calls

MODELS = memory_model.MODELS  # Qwen2.5: (hidden, vocab)
PROVIDERS = ("fused", "fused_cublas", "fused_tma", "fused_rowchunk", "torch", "chunked", "liger")
MEMORY_MODEL = {
    "fused": memory_model.fused_blocked_bytes,
    "fused_rowchunk": memory_model.fused_row_chunked_bytes,
    "fused_cublas": memory_model.fused_cublas_bytes,
    "fused_tma": memory_model.fused_blocked_bytes,  # the blocked backward's workspace, the same plan
    "liger": memory_model.liger_bytes,
}
CHUNK_ROWS = 4096


def _liger_loss():
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="none")


def _chunked_torch(hidden, weight, targets):
    """Plain torch with bounded memory: reference per row chunk, logits recomputed in backward."""
    lps, ents = [], []
    for r0 in range(0, hidden.shape[0], CHUNK_ROWS):
        lp, ent = checkpoint(
            linear_logprob_entropy_reference,
            hidden[r0 : r0 + CHUNK_ROWS],
            weight,
            targets[r0 : r0 + CHUNK_ROWS],
            use_reentrant=False,
        )
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def make_call(provider: str, hidden, weight, targets, *, backward: bool):
    if provider == "liger":
        liger = _liger_loss()
        if liger is None:
            return None

        def run_liger():
            loss = liger(weight, hidden, targets)
            if backward:
                loss.sum().backward()

        return run_liger
    op = {
        "fused": linear_logprob_entropy,
        "torch": linear_logprob_entropy_reference,
        "chunked": _chunked_torch,
        "fused_rowchunk": lambda *a: linear_logprob_entropy(*a, backward="row_chunked"),
        "fused_cublas": lambda *a: linear_logprob_entropy(*a, logits="cublas"),
        "fused_tma": lambda *a: linear_logprob_entropy(*a, logits="tma"),
    }[provider]

    def run():
        if not backward:
            with torch.no_grad():
                op(hidden, weight, targets)
            return
        lp, ent = op(hidden, weight, targets)
        (lp.sum() + ent.sum()).backward()

    return run


def bench_shape(out: CsvWriter, table: list, *, n, h, v, tp, providers, modes, repeats, device="cuda"):
    x = f"N={n},H={h},V={v},tp={tp}"
    if logprob_mod.BACKWARD_WORKSPACE_BYTES != 256 << 20:
        x += f",bwd_ws={logprob_mod.BACKWARD_WORKSPACE_BYTES >> 20}MiB"
    v_local = v // tp
    matmul = bf16_matmul_tflops(n, h, v_local, repeats=repeats, device=device)
    out.add("cublas_bf16_matmul", "fwd", "tflops", "TFLOP/s", x, matmul)
    table.append({"provider": "cublas_matmul", "mode": "fwd", "shape": x, "tflops": f"{matmul:.0f}"})
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v_local, h, device=device, generator=gen) * h**-0.5 * 4).to(torch.bfloat16)
    targets = torch.randint(0, v_local, (n,), device=device, generator=gen)
    for mode in modes:
        backward = mode == "fwd_bwd"
        hidden.requires_grad_(backward)
        weight.requires_grad_(backward)
        flops = (8 if backward else 2) * n * h * v_local

        def reset(hidden=hidden, weight=weight):
            hidden.grad = None
            weight.grad = None

        for provider in providers:
            call = make_call(provider, hidden, weight, targets, backward=backward)
            if call is None:
                print(f"skip {provider}: not importable")
                continue
            try:
                reset()
                with PeakMemory(device) as peak:
                    p50, p20, p80 = time_calls(call, repeats=repeats, reset=reset, device=device)
            except Exception as err:  # noqa: BLE001 - an OOM is a result; anything else is re-raised
                if not is_oom(err):
                    raise
                reset()
                torch.cuda.empty_cache()
                out.add(provider, mode, "ms", "ms", x, "oom")
                table.append({"provider": provider, "mode": mode, "shape": x, "ms": "oom"})
                continue
            tflops = flops / (p50 * 1e-3) / 1e12
            out.add(provider, mode, "ms", "ms", x, p50, p20, p80)
            out.add(
                provider, mode, "tflops", "TFLOP/s", x, tflops, flops / (p80 * 1e-3) / 1e12, flops / (p20 * 1e-3) / 1e12
            )
            out.add(provider, mode, "pct_of_matmul", "%", x, 100 * tflops / matmul)
            row = {
                "provider": provider,
                "mode": mode,
                "shape": x,
                "ms": f"{p50:.2f}",
                "tflops": f"{tflops:.0f}",
                "%matmul": f"{100 * tflops / matmul:.0f}",
            }
            if peak.extra_bytes is not None:
                out.add(provider, mode, "peak_extra_mem", "GB", x, peak.extra_bytes / 2**30)
                row["peak_GB"] = f"{peak.extra_bytes / 2**30:.2f}"
            if backward and provider in MEMORY_MODEL:
                model_gb = MEMORY_MODEL[provider](n, h, v_local) / 2**30
                out.add(provider, mode, "extra_mem_model", "GB", x, model_gb)
                row["model_GB"] = f"{model_gb:.2f}"
            table.append(row)
    del hidden, weight, targets
    if device == "cuda":
        torch.cuda.empty_cache()


def model_shape(name: str) -> tuple[int, int]:
    """(H, V) of a named model, or of an explicit HxV such as 4096x128256."""
    if name in MODELS:
        return MODELS[name]
    match = re.fullmatch(r"(\d+)x(\d+)", name)
    if not match:
        raise ValueError(f"--models: unknown {name!r}; choose from {sorted(MODELS)} or give HxV (e.g. 4096x128256)")
    return int(match[1]), int(match[2])


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="4096,16384,32768,65536", help="token counts, comma-separated")
    parser.add_argument("--models", default="7b,32b", help=f"subset of {sorted(MODELS)}, or HxV shapes")
    parser.add_argument("--tp", default="1,4,8", help="vocab shard widths V/tp")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument(
        "--bwd-workspace-mb",
        type=int,
        default=None,
        help="fused backward's dL/dlogits chunk budget (default 256): larger chunks mean fewer "
        "fp32 grad_weight read-modify-writes",
    )


def run(args) -> list[dict]:
    if args.bwd_workspace_mb is not None:
        logprob_mod.BACKWARD_WORKSPACE_BYTES = args.bwd_workspace_mb << 20
    out = CsvWriter(args.csv, "linear_logprob_entropy")
    table: list[dict] = []
    providers = [p for p in args.providers.split(",") if p]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        raise ValueError(f"--providers: unknown {sorted(unknown)}; choose from {list(PROVIDERS)}")
    for model in args.models.split(","):
        h, v = model_shape(model)
        for tp in (int(t) for t in args.tp.split(",")):
            for n in (int(s) for s in args.n.split(",")):
                bench_shape(
                    out,
                    table,
                    n=n,
                    h=h,
                    v=v,
                    tp=tp,
                    providers=providers,
                    modes=args.modes.split(","),
                    repeats=args.repeats,
                    device=args.device,
                )
                out.flush()
    print_table(table, ["provider", "mode", "shape", "ms", "tflops", "%matmul", "peak_GB", "model_GB"])
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv", default=None, help="results CSV (default ./results/kernels.csv)")
    args = parser.parse_args(argv)
    args.device = "cuda"
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (dapo-megatron bench kernels runs the interpreter correctness pass)")
        return 1
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every candidate LM-head kernel of ONE shape, timed in one call (issue 41 item 5), so each lent GPU
compares several designs instead of one:

    python -m dapo_kernels.bench.variants_logprob --model 32b --n 65536 --tp 1 --csv OUT/variants.csv
    python -m dapo_kernels.bench.variants_logprob --model 7b --n 16384 --tp 8 --variants tma,liger
    python -m dapo_kernels.bench.variants_logprob --cpu-dry-run --csv /tmp/v.csv   # the code, on CPU

Variants (bf16, V_local = V / tp rows, collectives excluded as in bench_logprob):
- fused: the tl.dot kernels (logprob.py, autotuned over its four Hopper tiles), blocked backward;
- fused_rowchunk, fused_cublas: the other schedules of bench_logprob;
- tma<i>_<tiles>: the persistent TMA-fed kernels (logprob_persistent.py) with hopper_configs()[i] pinned;
- liger: Liger's fused linear cross entropy (no entropy; its backward runs inside its forward).
The bf16 cuBLAS matmul of the same [N, H] x [H, V_local] shape is timed first: %matmul is against it.
Each of our variants' log-probs is checked against plain torch in float32 on the same bf16 inputs (row
chunks of 4096; max |difference| in the `vs_ref` column; a miss above 1e-3 prints MISMATCH: a fast wrong
kernel is not a candidate), so no Triton kernel is compiled before the first variant is timed.
Order (issue 49): the comparison the GPU call is for comes first, fused_tma's default tiles then Liger,
then the other TMA tiles, then the older schedules, and each variant's rows are appended to the CSV
(kernel linear_logprob_entropy_variants, with device and date, as bench_logprob's) the moment it
finishes: a call cut off at its budget keeps every variant that ran, and a variant that raises gets an
`error` row and its traceback while the others still run (exit 1). The GPU plan runs it with
DAPO_KERNELS_AUTOTUNE=0 (fused / fused_cublas / fused_rowchunk on their first tile config, one compile
each instead of four; the tma variants pin their tiles anyway).
"""

from __future__ import annotations

import argparse
import traceback

import torch

from dapo_kernels import linear_logprob_entropy
from dapo_kernels import logprob_persistent as persistent
from dapo_kernels.bench.bench_logprob import make_call, model_shape
from dapo_kernels.bench.common import CsvWriter, bf16_matmul_tflops, is_oom, print_table, time_calls

BASE_VARIANTS = ("fused", "fused_rowchunk", "fused_cublas", "liger")
AGREEMENT = 1e-3  # the fused op's log-prob accuracy target
REFERENCE_CHUNK_ROWS = 4096  # float32 logits of one chunk: 4096 x V_local x 4 bytes (2.5 GB at V 152,064)


def tma_variants() -> dict[str, dict]:
    """{name: TILES} for every Hopper config of the persistent kernels."""
    out = {}
    for i, cfg in enumerate(persistent.hopper_configs()):
        split = "h" if cfg["SPLIT_EPILOGUE"] else "w"
        out[f"tma{i}_{cfg['BLOCK_N']}x{cfg['BLOCK_V']}x{cfg['BLOCK_K']}{split}"] = cfg
    return out


def default_variants() -> list[str]:
    """The order the GPU call runs them in: fused_tma's default tiles (tma0, persistent.TILES on Hopper),
    Liger, the other TMA tiles, then fused, fused_cublas, fused_rowchunk."""
    tma = list(tma_variants())
    return [*tma[:1], "liger", *tma[1:], "fused", "fused_cublas", "fused_rowchunk"]


def _select(names: str) -> list[str]:
    """Variant names from a comma list; "tma" stands for every tma<i> variant."""
    known = [*BASE_VARIANTS, *tma_variants()]
    chosen: list[str] = []
    for name in (n for n in names.split(",") if n):
        expanded = list(tma_variants()) if name == "tma" else [name]
        unknown = [k for k in expanded if k not in known]
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; choose from {known} or 'tma'")
        chosen += [k for k in expanded if k not in chosen]
    return chosen


def reference_logprob(hidden, weight, targets) -> torch.Tensor:
    """log softmax(hidden @ weight^T)[target] in float32 from the bf16 inputs, REFERENCE_CHUNK_ROWS rows at a time."""
    out = []
    with torch.no_grad():
        w = weight.float()
        for r0 in range(0, hidden.shape[0], REFERENCE_CHUNK_ROWS):
            logits = hidden[r0 : r0 + REFERENCE_CHUNK_ROWS].float() @ w.T
            rows = targets[r0 : r0 + REFERENCE_CHUNK_ROWS, None]
            out.append((logits.gather(1, rows) - torch.logsumexp(logits, dim=1, keepdim=True)).squeeze(1))
            del logits
    return torch.cat(out)


def _logprob(variant: str, hidden, weight, targets) -> torch.Tensor | None:
    if variant == "liger":
        return None  # cross entropy only: no entropy, a different op to compare
    kw = {"fused_rowchunk": {"backward": "row_chunked"}, "fused_cublas": {"logits": "cublas"}}.get(variant, {})
    if variant.startswith("tma"):
        kw = {"logits": "tma"}
    with torch.no_grad():
        return linear_logprob_entropy(hidden, weight, targets, **kw)[0]


def _time_variant(variant: str, inputs, *, backward: bool, repeats: int, device: str):
    """(p50, p20, p80) ms, or None when the provider is not importable; "oom" when it ran out of memory."""
    hidden, weight, targets = inputs
    provider = "fused_tma" if variant.startswith("tma") else variant
    call = make_call(provider, hidden, weight, targets, backward=backward)
    if call is None:
        return None

    def reset():
        hidden.grad = None
        weight.grad = None

    try:
        reset()
        return time_calls(call, repeats=repeats, reset=reset, device=device)
    except Exception as err:  # noqa: BLE001 - an OOM is a result; anything else is re-raised
        if not is_oom(err):
            raise
        reset()
        torch.cuda.empty_cache()
        return "oom"


def _inputs(n: int, h: int, v_local: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v_local, h, device=device, generator=gen) * h**-0.5 * 4).to(torch.bfloat16)
    targets = torch.randint(0, v_local, (n,), device=device, generator=gen)
    return hidden, weight, targets


def run_variants(*, n: int, h: int, v: int, tp: int, variants: list[str], repeats: int, csv, device: str):
    x = f"N={n},H={h},V={v},tp={tp}"
    v_local = v // tp
    out = CsvWriter(csv, "linear_logprob_entropy_variants")
    matmul = bf16_matmul_tflops(n, h, v_local, repeats=repeats, device=device)
    out.add("cublas_bf16_matmul", "fwd", "tflops", "TFLOP/s", x, matmul)
    table = [{"variant": "cublas_matmul", "mode": "fwd", "tflops": f"{matmul:.0f}"}]
    inputs = _inputs(n, h, v_local, device)
    reference = reference_logprob(*inputs)
    saved_tiles = persistent.TILES
    tiles = tma_variants()
    try:
        for variant in variants:
            persistent.TILES = tiles.get(variant, saved_tiles)
            try:
                lp = _logprob(variant, *inputs)
                agree = "" if lp is None else f"{(lp - reference).abs().max().item():.1e}"
                if lp is not None and not (lp - reference).abs().max().item() <= AGREEMENT:
                    agree += " MISMATCH"
                for mode in ("fwd", "fwd_bwd"):
                    _add_row(out, table, variant, mode, x, agree, matmul, inputs, repeats=repeats, device=device)
            except Exception:  # noqa: BLE001 - a variant's bug: named, and the others still run (one GPU call)
                traceback.print_exc()
                out.add(variant, "fwd", "ms", "ms", x, "error")
                table.append({"variant": variant, "mode": "fwd", "ms": "error"})
            out.flush()  # this variant's rows are on disk before the next one compiles
    finally:
        persistent.TILES = saved_tiles
    print_table(table, ["variant", "mode", "ms", "tflops", "%matmul", "vs_ref"])
    return table


def _add_row(out, table, variant, mode, x, agree, matmul, inputs, *, repeats, device):
    backward = mode == "fwd_bwd"
    hidden, weight, _ = inputs
    hidden.requires_grad_(backward)
    weight.requires_grad_(backward)
    times = _time_variant(variant, inputs, backward=backward, repeats=repeats, device=device)
    if times is None:
        print(f"skip {variant}: not importable")
        return
    if times == "oom":
        out.add(variant, mode, "ms", "ms", x, "oom")
        table.append({"variant": variant, "mode": mode, "ms": "oom"})
        return
    p50, p20, p80 = times
    n, h = hidden.shape
    flops = (8 if backward else 2) * n * h * weight.shape[0]
    tflops = flops / (p50 * 1e-3) / 1e12
    out.add(variant, mode, "ms", "ms", x, p50, p20, p80)
    out.add(variant, mode, "tflops", "TFLOP/s", x, tflops, flops / (p80 * 1e-3) / 1e12, flops / (p20 * 1e-3) / 1e12)
    pct = 100 * tflops / matmul
    table.append(
        {"variant": variant, "mode": mode, "ms": f"{p50:.2f}", "tflops": f"{tflops:.0f}", "%matmul": f"{pct:.0f}"}
        | {"vs_ref": agree}
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="32b", help="7b, 32b, ... or HxV (bench_logprob.model_shape)")
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--variants", default=None, help="comma list (default: default_variants()'s order)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shape on CPU in the interpreter")
    parser.add_argument(
        "--quick", action="store_true", help="the GPU plan's call 1: 7B at tp 8, N 16384 (a row Liger led on the H100)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.n, args.tp = "7b", 16384, 8
    variants = _select(args.variants) if args.variants else default_variants()
    if args.cpu_dry_run:
        if not args.csv:
            raise ValueError("--cpu-dry-run needs --csv: the default results/kernels.csv keeps GPU measurements only")
        table = run_variants(n=20, h=32, v=260, tp=2, variants=variants, repeats=1, csv=args.csv, device="cpu")
        return 1 if any(r.get("ms") == "error" for r in table) else 0
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time (use --cpu-dry-run to run the code in the interpreter)")
        return 1
    h, v = model_shape(args.model)
    table = run_variants(
        n=args.n, h=h, v=v, tp=args.tp, variants=variants, repeats=args.repeats, csv=args.csv, device="cuda"
    )
    return 1 if any(r.get("ms") == "error" for r in table) else 0  # the step fails, every variant's rows kept


if __name__ == "__main__":
    raise SystemExit(main())

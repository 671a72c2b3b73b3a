"""The LM head + DAPO loss, forward + backward, of ONE shape, every candidate in one call (issue 53 item 4):

    python -m dapo_kernels.bench.variants_head_loss --model 32b --n 65536 --tp 1 --csv OUT/kernels.csv
    python -m dapo_kernels.bench.variants_head_loss --quick --csv OUT/kernels.csv     # 7B, tp 8, N 16384
    python -m dapo_kernels.bench.variants_head_loss --cpu-dry-run --csv /tmp/v.csv    # the code, on CPU

Variants (bf16, V_local = V / tp rows; collectives excluded, as in bench_logprob):
- one_pass: dapo_kernels.head_loss.linear_dapo_loss (gradients computed in the forward: 3 GEMMs, 6NHV);
- one_pass_tma: the same with logits="tma" (the forward's logits kernel loads its operand tiles by TMA,
  kernels/head_loss_tma.py; nothing else differs: the row measures the forward GEMM's operand path);
- one_pass_ws2g: the same with a 2 GiB chunk workspace instead of 512 MiB (4x the rows per chunk: 4x fewer
  read-modify-writes of the fp32 grad_weight accumulator, for more memory);
- today: linear_logprob_entropy (default: tl.dot kernels, blocked backward; entropy computed as a metric)
  then policy_loss: what the actor runs, 8NHV;
- today_tma: the same with logits="tma" (the persistent TMA-fed kernels);
- liger: LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0, no reference model) over [N / 1024, 1024, H]
  sequences (its clip-higher loss; no dual clip, no entropy: the closest peer op), when importable;
- cublas_3gemm: the three bf16 GEMMs of the one-pass design alone (logits [N,H]x[H,V], dlogits x W,
  dlogits^T x hidden): the floor a one-pass kernel approaches.
Rows (kernel linear_dapo_loss_variants, appended to the CSV as each variant finishes, with device and date):
ms (p50/p20/p80 of forward + backward), TFLOP/s on the 6NHV count (peers' convention), peak extra GB above
the inputs. The one_pass variants and today_tma are checked against today on the same inputs (max |logp difference| and
the loss's relative difference in `vs_today`; MISMATCH above 1e-3), so a fast wrong kernel is not a candidate.
A variant that raises gets an `error` row and its traceback; the others still run (exit 1).
"""

from __future__ import annotations

import argparse
import traceback

import torch

from dapo_kernels import head_loss, linear_logprob_entropy, policy_loss
from dapo_kernels.bench.bench_logprob import model_shape
from dapo_kernels.bench.common import CsvWriter, PeakMemory, bf16_matmul_tflops, is_oom, print_table, time_calls
from dapo_kernels.head_loss import linear_dapo_loss

VARIANTS = ("one_pass", "one_pass_tma", "liger", "today", "one_pass_ws2g", "today_tma", "cublas_3gemm")
WORKSPACE = {"one_pass_ws2g": 2 << 30}  # head_loss.WORKSPACE_BYTES per variant (default: the module's)
ONE_PASS_LOGITS = {"one_pass_tma": "tma"}  # linear_dapo_loss's logits= per variant (default: "triton")
LOSS_KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
AGREEMENT = 1e-3
LIGER_SEQ = 1024  # liger's GRPO loss takes [B, T, H] sequences


def _inputs(n: int, h: int, v_local: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v_local, h, device=device, generator=gen) * h**-0.5 * 4).to(torch.bfloat16)
    targets = torch.randint(0, v_local, (n,), device=device, generator=gen)
    old = -torch.rand(n, device=device, generator=gen) * 8  # ratios from ~e^-8 to far past the clips
    adv = torch.randn(n, device=device, generator=gen)
    mask = (torch.rand(n, device=device, generator=gen) > 0.1).float()
    return hidden, weight, targets, old, adv, mask


def _today(hidden, weight, targets, old, adv, mask, *, denom, logits="triton"):
    lp, _ent = linear_logprob_entropy(hidden, weight, targets, logits=logits)
    loss, _ = policy_loss(lp, old, adv, mask, **LOSS_KW, loss_denominator=denom)
    return loss, lp


def _liger_call(hidden, weight, targets, old, adv, mask):
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    n, h = hidden.shape
    if n % LIGER_SEQ:
        return None
    b = n // LIGER_SEQ
    op = LigerFusedLinearGRPOLoss(
        beta=0.0,
        use_ref_model=False,
        loss_type="dapo",
        epsilon_low=LOSS_KW["eps_low"],
        epsilon_high=LOSS_KW["eps_high"],
    )
    seq_adv = adv.view(b, LIGER_SEQ)[:, 0].contiguous()

    def run():
        out = op(
            hidden.view(b, LIGER_SEQ, h),
            weight,
            targets.view(b, LIGER_SEQ),
            mask.view(b, LIGER_SEQ),
            seq_adv,
            old_per_token_logps=old.view(b, LIGER_SEQ),
        )
        (out[0] if isinstance(out, tuple) else out).backward()

    return run


def make_call(variant: str, inputs, *, denom: float):
    hidden, weight, targets, old, adv, mask = inputs
    if variant == "liger":
        return _liger_call(*inputs)
    if variant == "cublas_3gemm":

        def gemms():
            logits = hidden @ weight.t()
            hidden.grad = logits @ weight
            weight.grad = logits.t() @ hidden

        return gemms

    def run():
        if variant.startswith("one_pass"):
            logits = ONE_PASS_LOGITS.get(variant, "triton")
            loss = linear_dapo_loss(
                hidden, weight, targets, old, adv, mask, **LOSS_KW, loss_denominator=denom, logits=logits
            )[0]
        else:
            loss = _today(*inputs, denom=denom, logits="tma" if variant == "today_tma" else "triton")[0]
        loss.backward()

    return run


def agreement(variant: str, inputs, *, denom: float, today) -> str:
    """max |logp - today's logp| and |loss - today's| / |today's| (no grad), '' for the peers."""
    if not (variant.startswith("one_pass") or variant == "today_tma"):
        return ""
    with torch.no_grad():
        if variant.startswith("one_pass"):
            logits = ONE_PASS_LOGITS.get(variant, "triton")
            loss, lp, _, _ = linear_dapo_loss(*inputs, **LOSS_KW, loss_denominator=denom, logits=logits)
        else:
            loss, lp = _today(*inputs, denom=denom, logits="tma")
    d_lp = (lp - today[1]).abs().max().item()
    d_loss = abs(loss.item() - today[0].item()) / max(abs(today[0].item()), 1e-12)
    bad = not (d_lp <= AGREEMENT and d_loss <= AGREEMENT)
    return f"{d_lp:.1e}/{d_loss:.1e}" + (" MISMATCH" if bad else "")


def run_variants(*, n: int, h: int, v: int, tp: int, variants: list[str], repeats: int, csv, device: str):
    x = f"N={n},H={h},V={v},tp={tp}"
    v_local = v // tp
    out = CsvWriter(csv, "linear_dapo_loss_variants")
    matmul = bf16_matmul_tflops(n, h, v_local, repeats=repeats, device=device)
    out.add("cublas_bf16_matmul", "fwd", "tflops", "TFLOP/s", x, matmul)
    table = [{"variant": "cublas_matmul", "tflops": f"{matmul:.0f}"}]
    inputs = _inputs(n, h, v_local, device)
    denom = float(n)
    with torch.no_grad():
        today = _today(*inputs, denom=denom)
    flops = 6 * n * h * v_local
    hidden, weight = inputs[0], inputs[1]

    def reset():
        hidden.grad = None
        weight.grad = None

    saved_workspace = head_loss.WORKSPACE_BYTES
    for variant in variants:
        head_loss.WORKSPACE_BYTES = WORKSPACE.get(variant, saved_workspace)
        try:
            agree = agreement(variant, inputs, denom=denom, today=today)
            hidden.requires_grad_(variant != "cublas_3gemm")
            weight.requires_grad_(variant != "cublas_3gemm")
            call = make_call(variant, inputs, denom=denom)
            if call is None:
                print(f"skip {variant}: not importable (or N not a multiple of {LIGER_SEQ})")
                continue
            reset()
            with PeakMemory(device) as peak:
                p50, p20, p80 = time_calls(call, repeats=repeats, reset=reset, device=device)
            tflops = flops / (p50 * 1e-3) / 1e12
            out.add(variant, "fwd_bwd", "ms", "ms", x, p50, p20, p80)
            out.add(variant, "fwd_bwd", "tflops_6nhv", "TFLOP/s", x, tflops)
            row = {"variant": variant, "ms": f"{p50:.2f}", "tflops": f"{tflops:.0f}", "vs_today": agree}
            if peak.extra_bytes is not None:
                out.add(variant, "fwd_bwd", "peak_extra", "GB", x, peak.extra_bytes / 1e9)
                row["extra_GB"] = f"{peak.extra_bytes / 1e9:.2f}"
            table.append(row)
        except Exception as err:  # noqa: BLE001 - a variant's failure is named; the others still run
            if is_oom(err):
                out.add(variant, "fwd_bwd", "ms", "ms", x, "oom")
                table.append({"variant": variant, "ms": "oom"})
                torch.cuda.empty_cache()
            else:
                traceback.print_exc()
                out.add(variant, "fwd_bwd", "ms", "ms", x, "error")
                table.append({"variant": variant, "ms": "error"})
        finally:
            reset()
            head_loss.WORKSPACE_BYTES = saved_workspace
        out.flush()
    print_table(table, ["variant", "ms", "tflops", "extra_GB", "vs_today"])
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="32b", help="7b, 32b, ... or HxV (bench_logprob.model_shape)")
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list from " + ",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shape on CPU in the interpreter")
    parser.add_argument("--quick", action="store_true", help="7B at tp 8, N 16384")
    args = parser.parse_args(argv)
    variants = [name for name in args.variants.split(",") if name]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.quick:
        args.model, args.n, args.tp = "7b", 16384, 8
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
    return 1 if any(r.get("ms") == "error" for r in table) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`dapo-megatron bench kernels [flags]`: the kernel benchmarks, or a correctness pass without a GPU.

    dapo-megatron bench kernels                               # everything (about 10+ min on an H100)
    dapo-megatron bench kernels --quick                       # 7B, N 4K/16K, TP 1/8, loss at 4M tokens
    dapo-megatron bench kernels --kernels logprob --n 16384 --models 32b --tp 8 --providers fused,liger
    python -m dapo_kernels.bench.run --correctness            # the no-GPU pass, on any machine

With a CUDA GPU: bench_logprob and bench_policy_loss (see their docstrings), each printing a table
and appending to <--results-dir>/kernels.csv (default ./results/kernels.csv) or --csv FILE. Without
one it says so and runs a tiny correctness pass in the Triton interpreter (max errors against the
float64 reference; no timings), re-executing itself with TRITON_INTERPRET=1 when the variable was
not set before dapo_kernels was imported.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

# the package (its kernels decorated) is imported before this module runs anyway: it is this module's package;
# --cpu-check re-executes in a fresh process with TRITON_INTERPRET=1
from dapo_kernels.bench import bench_logprob, bench_policy_loss

# --quick: the side-by-side of issue 27 (new kernels, the first ones, Liger) at the shapes of its
# profile, and the policy loss at one micro-batch (64K: host cost) and 16M tokens (bandwidth)
QUICK = {
    "n": "4096,16384",
    "models": "7b",
    "tp": "1,8",
    "providers": "fused,fused_cublas,fused_tma,fused_rowchunk,liger",
    "tokens": "65536,16777216",
    "loss_providers": "fused,fused_two_launch,torch",
    "repeats": 3,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", default="logprob,policy_loss", help="subset of logprob,policy_loss")
    parser.add_argument("--quick", action="store_true", help=f"a subset that fits a 10-minute GPU call: {QUICK}")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point (median, p20, p80)")
    parser.add_argument("--results-dir", default=None, help="rows go to DIR/kernels.csv (default ./results)")
    parser.add_argument("--csv", default=None, help="append to this CSV file instead (overrides --results-dir)")
    parser.add_argument("--correctness", action="store_true", help="run the interpreter correctness pass only")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the benchmark code on CPU in the interpreter (tests; times are meaningless; "
        "needs --csv or --results-dir)",
    )
    bench_logprob.add_args(parser)
    bench_policy_loss.add_args(parser)
    return parser


def correctness_pass() -> int:
    """Tiny shapes in the interpreter: print max errors of the fused ops against float64."""
    from dapo_kernels import (
        linear_logprob_entropy,
        linear_logprob_entropy_reference,
        policy_loss,
        policy_loss_reference,
    )

    ok = True
    gen = torch.Generator().manual_seed(0)
    n, h, v = 33, 48, 301
    print(f"linear_logprob_entropy, N={n} H={h} V={v} T=0.8 (vocab tile 64, so V is ragged):")
    for dtype, grad_tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 * torch.finfo(torch.bfloat16).eps)):
        hidden = torch.randn(n, h, generator=gen).to(dtype)
        weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
        targets = torch.randint(0, v, (n,), generator=gen)
        results = []
        for fn, cast in ((linear_logprob_entropy, dtype), (linear_logprob_entropy_reference, torch.float64)):
            hd = hidden.detach().to(cast).requires_grad_()
            wd = weight.detach().to(cast).requires_grad_()
            lp, ent = fn(hd, wd, targets, temperature=0.8)
            (lp.sum() + 0.5 * ent.sum()).backward()
            assert hd.grad is not None and wd.grad is not None
            results.append((lp.detach().double(), ent.detach().double(), hd.grad.double(), wd.grad.double()))
        (lp, ent, gh, gw), (lp64, ent64, gh64, gw64) = results
        errs = {
            "logprob max abs": (lp - lp64).abs().max().item(),
            "entropy max abs": (ent - ent64).abs().max().item(),
            "grad_hidden max rel": ((gh - gh64).abs().max() / gh64.abs().max()).item(),
            "grad_weight max rel": ((gw - gw64).abs().max() / gw64.abs().max()).item(),
        }
        good = errs["logprob max abs"] < 2e-5 and errs["entropy max abs"] < 2e-5 and bool((lp <= 0).all())
        good = good and errs["grad_hidden max rel"] < grad_tol and errs["grad_weight max rel"] < grad_tol
        ok &= good
        print(
            f"  {str(dtype):15s} " + "  ".join(f"{k} {e:.2e}" for k, e in errs.items()) + ("  ok" if good else "  FAIL")
        )

    num = 2000
    logprob = -torch.rand(num, generator=gen) * 3
    old = logprob + torch.randn(num, generator=gen) * 0.5
    adv = torch.randn(num, generator=gen)
    mask = torch.rand(num, generator=gen) > 0.25
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, loss_denominator=1500.0)
    outs = []
    for fn, dtype in ((policy_loss, torch.float32), (policy_loss_reference, torch.float64)):
        lp = logprob.detach().to(dtype).requires_grad_()
        loss, stats = fn(lp, old.to(dtype), adv.to(dtype), mask, **kw)
        loss.backward()
        assert lp.grad is not None
        outs.append((loss.item(), lp.grad.double(), {k: s.item() for k, s in stats.items()}))
    (loss, grad, stats), (loss64, grad64, stats64) = outs
    stat_err = max(abs(stats[k] - stats64[k]) for k in stats)
    good = abs(loss - loss64) < 1e-6 and (grad - grad64).abs().max().item() < 1e-7 and stat_err < 1e-5
    ok &= good
    print(
        f"policy_loss, T={num}: loss abs err {abs(loss - loss64):.2e}  grad max abs err "
        f"{(grad - grad64).abs().max().item():.2e}  stats max abs err {stat_err:.2e}" + ("  ok" if good else "  FAIL")
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.csv is None and args.results_dir:
        args.csv = os.path.join(args.results_dir, "kernels.csv")
    if args.cpu_dry_run or args.correctness or not torch.cuda.is_available():
        if args.cpu_dry_run and not args.csv:
            raise ValueError(
                "--cpu-dry-run needs --csv or --results-dir: the default results/kernels.csv keeps GPU "
                "measurements only"
            )
        if not (args.correctness or args.cpu_dry_run):
            print(
                "no CUDA GPU on this machine: no timings. Running the tiny correctness pass in the Triton interpreter."
            )
            argv = ["--correctness"]
        import dapo_kernels

        if not dapo_kernels.INTERPRET:  # the kernels were decorated for compiled mode: start over
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.call([sys.executable, "-m", "dapo_kernels.bench.run", *argv], env=env)
        if not args.cpu_dry_run:
            return correctness_pass()
    args.device = "cpu" if args.cpu_dry_run else "cuda"
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    kernels = set(args.kernels.split(","))
    unknown = kernels - {"logprob", "policy_loss"}
    if unknown:
        raise ValueError(f"--kernels: unknown {sorted(unknown)}; choose from logprob, policy_loss")
    if "logprob" in kernels:
        bench_logprob.run(args)
    if "policy_loss" in kernels:
        bench_policy_loss.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

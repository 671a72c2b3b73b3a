"""Benchmark: DAPO policy loss forward+backward, providers side by side (needs a CUDA GPU).

    python -m dapo_kernels.bench.bench_policy_loss --tokens 1048576,4194304,16777216

Providers: fused (dapo_kernels.policy_loss: one kernel writes loss partials, stats and the
gradient), torch (kernels/reference.py, eager fp32), algo (dapo_megatron.algo.policy_loss when
importable). Mode fwd_bwd: loss + stats + backward to logprob. Effective bandwidth counts the
fewest bytes any implementation must move: read logprob, old_logprob, advantages (fp32) and the
bool mask, write the fp32 gradient = 17 + 4 = 21 bytes per token; reported as GB/s and as percent
of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from dapo_kernels import policy_loss, policy_loss_reference
from dapo_kernels.bench.common import CsvWriter, copy_bandwidth_gbs, is_oom, print_table, time_cuda

PROVIDERS = ("fused", "torch", "algo")
BYTES_PER_TOKEN = 4 * 3 + 1 + 4
KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)


def _provider(name):
    if name == "fused":
        return policy_loss
    if name == "torch":
        return policy_loss_reference
    try:
        from dapo_megatron.algo.policy_loss import policy_loss as algo_policy_loss
    except ImportError:
        return None
    return lambda *a, **kw: algo_policy_loss(*a, agg_mode="token-mean", **kw)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="1048576,4194304,16777216", help="token counts, comma-separated")
    parser.add_argument("--loss-providers", default=",".join(PROVIDERS))


def run(args) -> list[dict]:
    out = CsvWriter(args.csv, "policy_loss")
    table: list[dict] = []
    copy_gbs = copy_bandwidth_gbs()
    out.add("device_copy", "copy", "bandwidth", "GB/s", "2GiB", copy_gbs)
    table.append({"provider": "device_copy", "tokens": "2GiB", "GB/s": f"{copy_gbs:.0f}"})
    for num in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logprob = -torch.rand(num, device="cuda", generator=gen) * 3
        old = logprob + torch.randn(num, device="cuda", generator=gen) * 0.3
        adv = torch.randn(num, device="cuda", generator=gen)
        mask = torch.rand(num, device="cuda", generator=gen) > 0.2
        logprob.requires_grad_()
        x = f"T={num}"
        for name in args.loss_providers.split(","):
            fn = _provider(name)
            if fn is None:
                print(f"skip {name}: not importable")
                continue

            def call(fn=fn):
                loss, _ = fn(logprob, old, adv, mask, **KW, loss_denominator=float(num))
                loss.backward()

            def reset():
                logprob.grad = None

            try:
                p50, p20, p80 = time_cuda(call, repeats=args.repeats, warmup=2, reset=reset)
            except Exception as err:  # noqa: BLE001
                if not is_oom(err):
                    raise
                out.add(name, "fwd_bwd", "ms", "ms", x, "oom")
                continue
            gbs = BYTES_PER_TOKEN * num / (p50 * 1e-3) / 1e9
            out.add(name, "fwd_bwd", "ms", "ms", x, p50, p20, p80)
            out.add(name, "fwd_bwd", "bandwidth", "GB/s", x, gbs)
            out.add(name, "fwd_bwd", "pct_of_copy", "%", x, 100 * gbs / copy_gbs)
            table.append({"provider": name, "tokens": num, "ms": f"{p50:.3f}", "GB/s": f"{gbs:.0f}",
                          "%copy": f"{100 * gbs / copy_gbs:.0f}"})
        out.flush()
    print_table(table, ["provider", "tokens", "ms", "GB/s", "%copy"])
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 1
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: DAPO policy loss forward+backward, providers side by side (needs a CUDA GPU).

    python -m dapo_kernels.bench.bench_policy_loss --tokens 1048576,4194304,16777216

Providers: fused (dapo_kernels.policy_loss: ONE launch writes the gradient and, in its last-arriving
program, the loss and stats), fused_two_launch (the first design: a second launch reduces the
partials, one_pass=False; kept until a GPU run has measured both), persistent
(kernels/policy_loss_persistent.py: persistent grid, group partials), torch (kernels/reference.py,
eager fp32; dapo_megatron.algo.policy_loss runs the same formula, and dapo_kernels imports nothing
from dapo_megatron). Modes: fwd (the loss call: for fused that is the whole one-kernel job, gradient
included) and fwd_bwd (plus loss.backward(): for fused one extra multiply by the upstream grad). Effective bandwidth
counts the
fewest bytes any implementation must move: read logprob, old_logprob, advantages (fp32) and the
bool mask, write the fp32 gradient = 17 + 4 = 21 bytes per token; reported as GB/s and as percent
of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from dapo_kernels import policy_loss, policy_loss_reference
from dapo_kernels.bench.common import CsvWriter, copy_bandwidth_gbs, is_oom, print_table, time_calls
from dapo_kernels.policy_loss_persistent import policy_loss_persistent

PROVIDERS = ("fused", "fused_two_launch", "persistent", "torch")
BYTES_PER_TOKEN = 4 * 3 + 1 + 4
KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)


def _provider(name):
    if name == "fused":
        return policy_loss
    if name == "fused_two_launch":
        return lambda *a, **kw: policy_loss(*a, one_pass=False, **kw)
    if name == "persistent":  # kernels/policy_loss_persistent.py (kernels/bench/variants_policy_loss.py: its schedules)
        return policy_loss_persistent
    if name == "torch":
        return policy_loss_reference
    return None


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", default="1048576,4194304,16777216", help="token counts, comma-separated")
    parser.add_argument("--loss-providers", default=",".join(PROVIDERS))
    parser.add_argument(
        "--loss-modes",
        default="fwd,fwd_bwd",
        help="fwd: the loss call (the fused one also writes the gradient); fwd_bwd: plus backward",
    )


def run(args) -> list[dict]:
    out = CsvWriter(args.csv, "policy_loss")
    table: list[dict] = []
    device = args.device
    copy_bytes = 2 << 30 if device == "cuda" else 1 << 20
    copy_gbs = copy_bandwidth_gbs(device=device, num_bytes=copy_bytes)
    label = f"{copy_bytes / 2**20:.0f}MiB"
    out.add("device_copy", "copy", "bandwidth", "GB/s", label, copy_gbs)
    table.append({"provider": "device_copy", "tokens": label, "GB/s": f"{copy_gbs:.0f}"})
    for num in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator(device=device).manual_seed(0)
        logprob = -torch.rand(num, device=device, generator=gen) * 3
        old = logprob + torch.randn(num, device=device, generator=gen) * 0.3
        adv = torch.randn(num, device=device, generator=gen)
        mask = torch.rand(num, device=device, generator=gen) > 0.2
        logprob.requires_grad_()
        x = f"T={num}"
        for name in args.loss_providers.split(","):
            fn = _provider(name)
            if fn is None:
                print(f"skip {name}: not importable")
                continue
            for mode in args.loss_modes.split(","):

                def call(fn=fn, backward=mode == "fwd_bwd", logprob=logprob, old=old, adv=adv, mask=mask, num=num):
                    loss, _ = fn(logprob, old, adv, mask, **KW, loss_denominator=float(num))
                    if backward:
                        loss.backward()

                def reset(logprob=logprob):
                    logprob.grad = None

                try:
                    p50, p20, p80 = time_calls(call, repeats=args.repeats, warmup=2, reset=reset, device=device)
                except Exception as err:  # noqa: BLE001
                    if not is_oom(err):
                        raise
                    out.add(name, mode, "ms", "ms", x, "oom")
                    continue
                out.add(name, mode, "ms", "ms", x, p50, p20, p80)
                row = {"provider": name, "mode": mode, "tokens": num, "ms": f"{p50:.3f}"}
                # Bandwidth only where the 21 bytes/token are really the job: fwd_bwd for everyone,
                # and the fused forward (its one kernel already writes the gradient).
                if mode == "fwd_bwd" or name.startswith("fused"):
                    gbs = BYTES_PER_TOKEN * num / (p50 * 1e-3) / 1e9
                    out.add(name, mode, "bandwidth", "GB/s", x, gbs)
                    out.add(name, mode, "pct_of_copy", "%", x, 100 * gbs / copy_gbs)
                    row.update({"GB/s": f"{gbs:.0f}", "%copy": f"{100 * gbs / copy_gbs:.0f}"})
                table.append(row)
        out.flush()
    print_table(table, ["provider", "mode", "tokens", "ms", "GB/s", "%copy"])
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--csv", default=None, help="results CSV (default ./results/kernels.csv)")
    args = parser.parse_args(argv)
    args.device = "cuda"
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 1
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

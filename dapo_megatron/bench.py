"""`dapo-megatron bench kernels | reward [args]`: the project's benchmarks, each printing a table and
appending rows to its CSV (speed is measured here, never asserted in tests)."""

from __future__ import annotations

import importlib

BENCHES = {
    "kernels": "dapo_kernels.bench.run",  # fused log-prob/entropy + policy loss vs torch / Liger
    "reward": "dapo_megatron.reward.bench",  # math_dapo scoring throughput on 20K-token responses
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: dapo-megatron bench {{{' | '.join(BENCHES)}}} [args]")
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)

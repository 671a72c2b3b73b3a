"""Extra memory of one LM-head fwd+bwd (bytes above the inputs), by formula, for every benchmark row:
our two backward schedules and Liger's fused linear cross entropy. No GPU needed.

    python -m dapo_kernels.bench.memory_model                      # the default benchmark rows
    python -m dapo_kernels.bench.memory_model --models 7b --tp 1 --n 4096,65536

Terms (bf16, element size e = 2; N tokens, H hidden, V = vocab rows of the shard):
- both providers return grad_hidden (e N H) and grad_weight (e V H): counted, as the benchmark's
  peak-memory column counts them;
- fused, blocked (the default): + blocked_workspace_bytes = R (Vc e + 4 H) with
  R, Vc = blocked_plan(N, H, V): <= min(256 MiB, 3 N H);
- fused, logits="cublas" (blocked backward): max(forward fp32 logits chunk C_f V 4 with
  C_f = logprob_cublas.chunk_rows(N, H, V), the two gradients + blocked_workspace_bytes(cublas=True));
- fused, row_chunked (the first schedule): + C V e (dL/dlogits chunk, C = 256 MiB / (V e) rows) +
  4 V H (fp32 grad_weight accumulator, when N > C);
- Liger (LigerFusedLinearCrossEntropyLoss, reduction="none"): + 2 C_L V e with
  C_L = min(N, next_pow2(ceil(N / ceil(V / H)))): its logits chunk plus the per-token-scaled gradient
  chunk. Checked against the six rows measured on an H100 on 2026-11-25 (1.12, 1.42, 0.53, 4.40,
  0.63, 1.97 GiB): the formula gives 1.11, 1.41, 0.53, 4.40, 0.63, 1.97 GiB.
Per-token vectors (a few x 4 N bytes) and cuBLAS's workspace (32 MiB, both providers) are left out.
"""

from __future__ import annotations

import argparse

from dapo_kernels import logprob as logprob_mod
from dapo_kernels import logprob_cublas

MODELS = {"7b": (3584, 152064), "32b": (5120, 152064)}  # Qwen2.5: (hidden, vocab)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def grads_bytes(n: int, h: int, v: int, e: int = 2) -> int:
    return e * (n + v) * h


def fused_blocked_bytes(n: int, h: int, v: int, e: int = 2) -> int:
    return grads_bytes(n, h, v, e) + logprob_mod.blocked_workspace_bytes(n, h, v, e)


def fused_cublas_bytes(n: int, h: int, v: int, e: int = 2) -> int:
    forward = logprob_cublas.chunk_rows(n, h, v) * v * 4
    return max(forward, grads_bytes(n, h, v, e) + logprob_mod.blocked_workspace_bytes(n, h, v, e, cublas=True))


def fused_row_chunked_bytes(n: int, h: int, v: int, e: int = 2) -> int:
    chunk = logprob_mod._chunk_rows(n, v, e)
    acc = 4 * v * h if chunk < n else 0
    return grads_bytes(n, h, v, e) + min(chunk, n) * v * e + acc


def liger_bytes(n: int, h: int, v: int, e: int = 2) -> int:
    inc = -(-v // h)
    chunk = min(n, _next_pow2(-(-n // inc)))
    return grads_bytes(n, h, v, e) + 2 * chunk * v * e


def rows(models, tps, ns):
    out = []
    for model in models:
        h, v_full = MODELS[model]
        for tp in tps:
            v = v_full // tp
            for n in ns:
                out.append(
                    {
                        "model": model,
                        "tp": tp,
                        "N": n,
                        "blocked_GiB": fused_blocked_bytes(n, h, v) / 2**30,
                        "cublas_GiB": fused_cublas_bytes(n, h, v) / 2**30,
                        "row_chunked_GiB": fused_row_chunked_bytes(n, h, v) / 2**30,
                        "liger_GiB": liger_bytes(n, h, v) / 2**30,
                    }
                )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="7b,32b")
    parser.add_argument("--tp", default="1,4,8")
    parser.add_argument("--n", default="4096,16384,32768,65536")
    args = parser.parse_args(argv)
    table = rows(args.models.split(","), [int(t) for t in args.tp.split(",")], [int(n) for n in args.n.split(",")])
    print(
        "| model | tp | N | fused (blocked) GiB | fused_cublas GiB | fused_rowchunk GiB | Liger GiB | "
        "blocked, cublas <= Liger |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        ok = "/".join("yes" if r[k] <= r["liger_GiB"] else "NO" for k in ("blocked_GiB", "cublas_GiB"))
        print(
            f"| {r['model']} | {r['tp']} | {r['N']} | {r['blocked_GiB']:.2f} | {r['cublas_GiB']:.2f} | "
            f"{r['row_chunked_GiB']:.2f} | {r['liger_GiB']:.2f} | {ok} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

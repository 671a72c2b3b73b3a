"""The logits of linear_logprob_entropy from cuBLAS instead of tl.dot (logits="cublas"): each chunk of
logits is one torch matmul with an fp32 result, then a Triton epilogue reads it once
(forward: the per-row softmax statistics, as Liger's cross-entropy kernel does after its matmul;
backward: dL/dlogits). The softmax maths are the fused kernels' own (_softmax_tiles.py).

Why fp32 logits: rounding them to bf16 (Liger's choice) moves a log-prob by up to 2^-9 |z| (~0.03 at
|z| = 16), 30x the 1e-3 the fused op guarantees. Price: the chunk is written and read once in fp32,
8 bytes per logit, against 2H flops per logit of the matmul (H = 3584: 896 flop/byte, above an H100's
~330 flop/byte balance point), so the matmul's speed should carry over. Unmeasured on a GPU so far:
the benchmark's fused_cublas provider is this path.

Memory: forward chunk rows = min(FORWARD_LOGITS_BYTES, 3 N H) / (4 V_local), freed before the backward; the
blocked backward's plan charges 4 more bytes per dL/dlogits element (logprob.blocked_plan(cublas=True)).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ._runtime import INTERPRET
from ._softmax_tiles import dz_tile, split_columns, split_stats, store_stats

# fp32 logits chunk of the forward (bytes): at most 256 MiB (441 rows at V = 152064, rounded to 128:
# 384) and at most BUDGET_PER_NH * N * H, as the blocked backward's workspace (small batches, small chunk)
FORWARD_LOGITS_BYTES = 256 << 20
BUDGET_PER_NH = 3
EPILOGUE_BLOCK_N = 16 if INTERPRET else 32
EPILOGUE_BLOCK_V = 64 if INTERPRET else 1024
NUM_SPLITS = 2 if INTERPRET else 8
ROW_ALIGN = 16 if INTERPRET else 128


@triton.jit
def _read_logits(src, rows, v0, cols, col_ok, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE):
    """split_stats's tile producer for _stats_epilogue_kernel: the chunk's fp32 logits (src: row pointers, row_ok)."""
    row_base, row_ok = src
    return tl.load(row_base + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _stats_epilogue_kernel(
    z_ptr,
    tgt_ptr,
    stats_ptr,
    N,
    V,
    stride_zn,
    stats_stride,
    num_splits,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Partial (m, s, t, zt) of rows [pid_n * BLOCK_N, ...) over vocab split pid_s of the fp32 logits
    chunk z [N, V]; stats [num_splits, 4, stats_stride] (row r of this chunk at column r)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    v_begin, v_end = split_columns(pid_s, V, num_splits, BLOCK_V)
    src = (z_ptr + rows.to(tl.int64)[:, None] * stride_zn, row_ok)
    m, s, t, zt = split_stats(_read_logits, src, rows, tgt, v_begin, v_end, inv_temp, BLOCK_N, BLOCK_V)
    store_stats(stats_ptr, pid_s, stats_stride, rows, row_ok, m, s, t, zt)


@triton.jit
def _dlogits_epilogue_kernel(
    z_ptr,
    tgt_ptr,
    max_ptr,
    logs_ptr,
    meanc_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    N,
    V,
    stride_zn,
    stride_dzn,
    inv_temp,
    col0,
    HAS_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + rows.to(tl.int64)[:, None] * stride_zn + cols[None, :], mask=ok, other=0.0) * inv_temp
    dz = dz_tile(
        z, rows, row_ok, cols, col_ok, tgt_ptr, max_ptr, logs_ptr, meanc_ptr, glp_ptr, gent_ptr, inv_temp, col0, HAS_ENT
    )
    tl.store(dz_ptr + rows.to(tl.int64)[:, None] * stride_dzn + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


_OUT_DTYPE_ADDMM = True  # torch.addmm(..., out_dtype=float32) on CUDA (torch >= 2.9); probed on first use


def mm_fp32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (fp32, may be a row-strided view) = a @ b without rounding the product to a's 16-bit dtype."""
    global _OUT_DTYPE_ADDMM
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
        return
    if not a.is_cuda:
        torch.mm(a.float(), b.float(), out=out)
        return
    if _OUT_DTYPE_ADDMM:
        try:  # beta = 0: out's old contents (uninitialized) are ignored, NaNs included
            torch.addmm(out, a, b, beta=0, out_dtype=torch.float32, out=out)
            return
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError) as err:
            _OUT_DTYPE_ADDMM = False
            warnings.warn(
                f"torch.addmm(out_dtype=float32) is unavailable ({err}); logits='cublas' rounds "
                "the logits to 16 bits (log-probs off by up to ~2^-9 |z|)",
                stacklevel=2,
            )
    out.copy_(a @ b)


def chunk_rows(n: int, h: int, v: int) -> int:
    """Rows of the forward's fp32 logits chunk (a multiple of ROW_ALIGN, at most n)."""
    rows = min(FORWARD_LOGITS_BYTES, BUDGET_PER_NH * n * h) // max(1, 4 * v)
    return min(n, max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN))


def forward_split_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets_local: torch.Tensor, inv_temp: float
) -> torch.Tensor:
    """[splits, 4, N] partial statistics (logprob.merge_stats merges them): per chunk of rows, logits
    = hidden[chunk] @ weight.T in fp32 (cuBLAS), then the stats epilogue."""
    n, h = hidden.shape
    v = weight.shape[0]
    splits = max(1, min(NUM_SPLITS, triton.cdiv(v, EPILOGUE_BLOCK_V)))
    stats = torch.empty((splits, 4, n), device=hidden.device, dtype=torch.float32)
    chunk = chunk_rows(n, h, v)
    logits = torch.empty((chunk, v), device=hidden.device, dtype=torch.float32)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        z = logits[: r1 - r0]
        mm_fp32_into(z, hidden[r0:r1], weight.t())
        grid = (triton.cdiv(r1 - r0, EPILOGUE_BLOCK_N), splits)
        _stats_epilogue_kernel[grid](
            z,
            targets_local[r0:r1],
            stats[:, :, r0:],
            r1 - r0,
            v,
            z.stride(0),
            n,
            splits,
            inv_temp,
            BLOCK_N=EPILOGUE_BLOCK_N,
            BLOCK_V=EPILOGUE_BLOCK_V,
        )
    return stats


def dlogits_into(
    dz: torch.Tensor,
    logits: torch.Tensor,
    hidden_rows: torch.Tensor,
    weight_rows: torch.Tensor,
    tgt,
    big_m,
    log_s,
    mean_c,
    g_lp,
    g_ent,
    *,
    has_ent: bool,
    inv_temp: float,
    col0: int,
) -> None:
    """dz [R, Vc] = dL/dlogits of hidden_rows @ weight_rows.T (weight_rows = the shard's rows from col0 on;
    tgt: shard-local target ids); logits: an fp32 [R, Vc] scratch."""
    rows, cols = dz.shape
    mm_fp32_into(logits, hidden_rows, weight_rows.t())
    grid = (triton.cdiv(rows, EPILOGUE_BLOCK_N), triton.cdiv(cols, EPILOGUE_BLOCK_V))
    _dlogits_epilogue_kernel[grid](
        logits,
        tgt,
        big_m,
        log_s,
        mean_c,
        g_lp,
        g_ent,
        dz,
        rows,
        cols,
        logits.stride(0),
        dz.stride(0),
        inv_temp,
        col0,
        HAS_ENT=has_ent,
        BLOCK_N=EPILOGUE_BLOCK_N,
        BLOCK_V=EPILOGUE_BLOCK_V,
    )

"""Per-tile softmax maths shared by the fused-GEMM kernels (logprob.py: the logit tile comes from
tl.dot; logprob_persistent.py: from a TMA-fed tl.dot) and the epilogue kernels (logprob_cublas.py: the
logit tile is read from an fp32 chunk that cuBLAS wrote). One copy of the formulas and of the forward's
online-softmax loop (`split_stats`, which takes the tile producer as a function argument);
@triton.jit helpers are inlined where they are called."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_columns(pid_s, V, num_splits, BLOCK_V: tl.constexpr):
    """[v_begin, v_end) of vocab split pid_s: whole BLOCK_V tiles, the splits as even as tiles allow."""
    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), num_splits)
    v_begin = pid_s * tiles_per_split * BLOCK_V
    return v_begin, tl.minimum(V, v_begin + tiles_per_split * BLOCK_V)


@triton.jit
def empty_stats(BLOCK_N: tl.constexpr):
    """(m, s, t, zt) of rows that have seen no logit yet: m = -inf, the sums 0."""
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    return (
        m,
        tl.zeros([BLOCK_N], dtype=tl.float32),
        tl.zeros([BLOCK_N], dtype=tl.float32),
        tl.zeros([BLOCK_N], dtype=tl.float32),
    )


@triton.jit
def store_stats(stats_ptr, pid_s, stride, rows, row_ok, m, s, t, zt):
    """Split pid_s's partial statistics into stats [num_splits, 4, stride] (row r at column r)."""
    out = stats_ptr + pid_s * 4 * stride + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride, s, mask=row_ok)
    tl.store(out + 2 * stride, t, mask=row_ok)
    tl.store(out + 3 * stride, zt, mask=row_ok)


@triton.jit
def online_update(m, s, t, zt, z, cols, col_ok, tgt):
    """Fold a [BLOCK_N, BLOCK_V] tile of scaled logits z into the running per-row statistics
    (m = max, s = sum exp(z - m), t = sum exp(z - m) (z - m), zt = target logit), see logprob.py.
    When the max rises from m to m', alpha = exp(m - m') and
        s' = alpha s + sum exp(z - m'),  t' = alpha (t + (m - m') s) + sum p (z - m')."""
    z = tl.where(col_ok[None, :], z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = tl.exp(m - m_new)
    # s == 0 only before the first tile, where m = -inf: keep -inf * 0 out of the arithmetic.
    shift = (tl.where(s > 0, m, m_new) - m_new) * s
    zc = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)  # finite everywhere: no 0 * -inf
    p = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
    t = alpha * (t + shift) + tl.sum(p * zc, axis=1)
    s = alpha * s + tl.sum(p, axis=1)
    # col_ok: a target owned by another rank may fall on this tile's padding columns
    zt += tl.sum(tl.where((cols[None, :] == tgt[:, None]) & col_ok[None, :], z, 0.0), axis=1)
    return m_new, s, t, zt


@triton.jit
def split_stats(
    logits_tile: tl.constexpr,
    src,
    rows,
    tgt,
    v_begin,
    v_end,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr = 0,
    CAST_F32: tl.constexpr = False,
    IEEE: tl.constexpr = False,
    SPLIT_EPILOGUE: tl.constexpr = False,
):
    """(m, s, t, zt) of `rows` over vocab columns [v_begin, v_end): the online-softmax loop of every
    forward kernel. logits_tile(src, rows, v0, cols, col_ok, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE)
    -> the fp32 [BLOCK_N, BLOCK_V] logits of columns cols = v0 + arange(BLOCK_V) before the temperature.
    src: the producer's runtime arguments, a tuple; the constexprs travel one by one (a tuple element
    loses its constexpr-ness in compiled Triton 3.7); a producer ignores those it does not use.
    SPLIT_EPILOGUE: fold the tile as two [BLOCK_N, BLOCK_V / 2] halves (fewer live temporaries: without
    it ptxas spills the 128x256 epilogue of the TMA kernel, kernels/bench/NOTES.md)."""
    m, s, t, zt = empty_stats(BLOCK_N)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = logits_tile(src, rows, v0, cols, col_ok, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE) * inv_temp
        if SPLIT_EPILOGUE:
            z_lo, z_hi = tl.split(tl.permute(tl.reshape(z, [BLOCK_N, 2, BLOCK_V // 2]), [0, 2, 1]))
            half = v0 + tl.arange(0, BLOCK_V // 2)
            m, s, t, zt = online_update(m, s, t, zt, z_lo, half, half < v_end, tgt)
            half += BLOCK_V // 2
            m, s, t, zt = online_update(m, s, t, zt, z_hi, half, half < v_end, tgt)
        else:
            m, s, t, zt = online_update(m, s, t, zt, z, cols, col_ok, tgt)
    return m, s, t, zt


@triton.jit
def dz_tile(
    z,
    rows,
    row_ok,
    cols,
    col_ok,
    tgt_ptr,
    max_ptr,
    logs_ptr,
    meanc_ptr,
    glp_ptr,
    gent_ptr,
    inv_temp,
    col0,
    HAS_ENT: tl.constexpr,
):
    """dL/dlogits of a tile of scaled logits z, with p = exp((z - m) - log s):
        dL/dz_k = (g_lp (1[k = target] - p_k) + g_ent p_k (E_p[z] - z_k)) / T.
    cols count from the block's first vocab row; col0 is that row's index in the shard (targets are)."""
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - col0
    # Relative to the row max m: z - m is exact (Sterbenz), so p = exp((z - m) - log s) sums to 1
    # even at +-1e4 logits, where lse = m + log s would round by ~2^-11 in fp32.
    zc = z - tl.load(max_ptr + rows, mask=row_ok, other=0.0)[:, None]
    zc = tl.where(col_ok[None, :], zc, 0.0)  # padding columns: finite filler, never stored
    log_s = tl.load(logs_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(zc - log_s[:, None])
    dz = g_lp[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if HAS_ENT:  # E_p[z] - z_k = E_p[z - m] - (z_k - m)
        mean_c = tl.load(meanc_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        dz += g_ent[:, None] * p * (mean_c[:, None] - zc)
    return dz * inv_temp

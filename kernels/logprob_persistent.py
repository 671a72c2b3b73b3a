"""The logit tiles of linear_logprob_entropy from a persistent, TMA-fed GEMM (logits="tma", bench provider
fused_tma): a third way to produce the same tiles as logprob.py's tl.dot loop (logits="triton") and
logprob_cublas.py's cuBLAS chunks (logits="cublas"); the softmax maths are the shared ones
(_softmax_tiles.py), so the statistics, the merge over vocab splits and TP ranks, and the backward
schedule (logprob._backward_blocked) are today's.

What differs from logprob.py's kernels (issue 41 item 3):
- Persistent grid: min(work items, PROGRAMS_PER_SM x SMs) programs, each walking work items
  pid, pid + P, pid + 2P, ... The items in flight at any moment are a contiguous range of the grouped
  order (GROUP_N row blocks x all vocab splits), so the weight tiles they read are shared through L2.
- TMA: hidden and weight are read through host tensor descriptors (triton.tools.tensor_descriptor):
  the copy engine moves [BLOCK_N, BLOCK_K] / [BLOCK_V, BLOCK_K] boxes into shared memory, zero-filled
  out of bounds, so the K loop computes no addresses and no masks (registers left to the epilogue).
- The online (m, s, t, z_target) statistics are the epilogue of each [BLOCK_N, BLOCK_V] tile, as before.
Forward work item = (row block, vocab split): the split's tiles fold into one running set of statistics
(one [4, N] partial per split, merged by logprob.merge_stats). Backward work item = one
(row block, vocab block) tile of dL/dlogits (dz_tile), stored with a masked store (the dZ block's row
stride, Vc elements, need not be 16-byte aligned); grad_hidden and grad_weight are then the blocked
schedule's GEMMs, each output tile owned by one GEMM program (no split-K atomics in our code).

TMA needs 16-byte aligned bases and row strides (H * element size % 16 == 0: every real model);
`tma_ok` says whether a problem qualifies, and logprob.py falls back to the tl.dot kernels when not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._runtime import INTERPRET, cast_dot_inputs_to_fp32, num_sms
from ._softmax_tiles import dz_tile, split_columns, split_stats, store_stats

# Programs per SM of the persistent grid (one 128x256 tile with 3 stages of TMA buffers fills an SM's
# shared memory); the interpreter runs 3 programs so that each walks several work items.
PROGRAMS_PER_SM = 1
INTERPRET_PROGRAMS = 3
NUM_SPLITS_GPU = 16
NUM_SPLITS_INTERPRET = 2
# Interpreter tiles: small, so that the tiny test shapes cross every tile edge and run several tiles.
INTERPRET_TILES = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32, "SPLIT_EPILOGUE": True}


@triton.jit
def _logits_tile_tma(
    h_desc,
    w_desc,
    row0,
    col0,
    H,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_V] tile hidden[row0:] @ weight[col0:].T; boxes past N, V or H read zeros."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = h_desc.load([row0, k0])
        b = w_desc.load([col0, k0])
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b.T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _tma_logits(
    src,
    rows,
    v0,
    cols,
    col_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    """split_stats's tile producer for _fwd_persistent_kernel (src: the descriptors, the first row, H)."""
    h_desc, w_desc, row0, H = src
    return _logits_tile_tma(h_desc, w_desc, row0, v0, H, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE)


@triton.jit
def _fwd_persistent_kernel(
    h_desc,
    w_desc,
    tgt_ptr,
    stats_ptr,
    N,
    V,
    H,
    num_splits,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr = False,
):
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * num_splits
    for item in range(tl.program_id(0), num_n * num_splits, tl.num_programs(0)):
        # the grouped order of logprob._fwd_kernel: GROUP_N consecutive row blocks x all splits
        first_n = (item // per_group) * GROUP_N
        group_size = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + (item % per_group) % group_size
        pid_s = (item % per_group) // group_size
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        v_begin, v_end = split_columns(pid_s, V, num_splits, BLOCK_V)
        src = (h_desc, w_desc, pid_n * BLOCK_N, H)
        m, s, t, zt = split_stats(
            _tma_logits,
            src,
            rows,
            tgt,
            v_begin,
            v_end,
            inv_temp,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
            CAST_F32,
            IEEE,
            SPLIT_EPILOGUE,
        )
        store_stats(stats_ptr, pid_s, N, rows, row_ok, m, s, t, zt)


@triton.jit
def _dlogits_persistent_kernel(
    h_desc,
    w_desc,
    tgt_ptr,
    max_ptr,
    logs_ptr,
    meanc_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    N,
    V,
    H,
    stride_dzn,
    inv_temp,
    col0,
    HAS_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr = False,
):
    # Row blocks vary fastest (as logprob._dlogits_kernel): the tiles in flight share weight tiles.
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_n * tl.cdiv(V, BLOCK_V), tl.num_programs(0)):
        pid_n = tile % num_n
        pid_v = tile // num_n
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        z = (
            _logits_tile_tma(
                h_desc, w_desc, pid_n * BLOCK_N, pid_v * BLOCK_V, H, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE
            )
            * inv_temp
        )
        args = (tgt_ptr, max_ptr, logs_ptr, meanc_ptr, glp_ptr, gent_ptr, dz_ptr, V, stride_dzn, inv_temp, col0)
        if SPLIT_EPILOGUE:  # two [BLOCK_N, BLOCK_V / 2] halves: half the epilogue's temporaries live
            z_lo, z_hi = tl.split(tl.permute(tl.reshape(z, [BLOCK_N, 2, BLOCK_V // 2]), [0, 2, 1]))
            cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V // 2)
            _store_dz(z_lo, rows, row_ok, cols, args, HAS_ENT)
            _store_dz(z_hi, rows, row_ok, cols + BLOCK_V // 2, args, HAS_ENT)
        else:
            _store_dz(z, rows, row_ok, pid_v * BLOCK_V + tl.arange(0, BLOCK_V), args, HAS_ENT)


@triton.jit
def _store_dz(z, rows, row_ok, cols, args, HAS_ENT: tl.constexpr):
    """dz_ptr[rows, cols] = dL/dlogits of the scaled logits z (args: the kernel's pointers and scalars)."""
    tgt_ptr, max_ptr, logs_ptr, meanc_ptr, glp_ptr, gent_ptr, dz_ptr, V, stride_dzn, inv_temp, col0 = args
    col_ok = cols < V
    dz = dz_tile(
        z, rows, row_ok, cols, col_ok, tgt_ptr, max_ptr, logs_ptr, meanc_ptr, glp_ptr, gent_ptr, inv_temp, col0, HAS_ENT
    )
    out = dz_ptr + rows.to(tl.int64)[:, None] * stride_dzn + cols[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def hopper_configs(*, every: bool = True) -> list[dict]:
    """Tile candidates: 128x256x64 (the wgmma sweet spot, 3 x 48 KiB TMA stages) first; 128x128 leaves more
    registers to the epilogue. SPLIT_EPILOGUE: the epilogue runs on two [BLOCK_N, BLOCK_V / 2] halves of
    the logit tile; without it ptxas spills the 128x256 epilogue to local memory (kernels/bench/NOTES.md,
    SASS facts). every=False: the first only."""
    shapes = [(128, 256, 64, 8, 3, True), (128, 128, 64, 8, 4, False), (128, 256, 64, 8, 3, False)]
    shapes = shapes if every else shapes[:1]
    return [
        {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "SPLIT_EPILOGUE": split, "num_warps": warps, "num_stages": stages}
        for bn, bv, bk, warps, stages, split in shapes
    ]


# The tiles every 16-bit launch uses (the variants script and the tests swap them): the first Hopper
# config until a GPU run ranks them (autotune would rebuild the descriptors per config).
TILES = INTERPRET_TILES if INTERPRET else hopper_configs()[0]
# fp32 inputs (exact IEEE dot, a test path, not a speed path): the 16-bit tiles' 2 stages of fp32 boxes
# take 256 KiB of shared memory (> 227 KiB: no launch) and ptxas spills ~20K instructions' worth; 64x64x32
# with 4 warps still spills (376 LDL/STL), with 8 none (kernels/bench/NOTES.md).
FP32_HOPPER_TILES = dict(BLOCK_N=64, BLOCK_V=64, BLOCK_K=32, SPLIT_EPILOGUE=False, num_warps=8, num_stages=2)
TILES_FP32 = INTERPRET_TILES if INTERPRET else FP32_HOPPER_TILES


def _tiles(dtype: torch.dtype) -> tuple[dict, dict]:
    """(kernel meta-parameters, launch options) for inputs of this dtype."""
    tiles = dict(TILES_FP32 if dtype == torch.float32 else TILES)
    launch = {"num_warps": tiles.pop("num_warps", 4), "num_stages": tiles.pop("num_stages", 1)}
    return tiles, launch


def tma_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA's rules: 16-byte aligned bases, unit inner stride, 16-byte aligned row strides."""
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
        for t in (hidden, weight)
    )


def _descriptors(hidden: torch.Tensor, weight: torch.Tensor, tiles: dict):
    h_desc = TensorDescriptor.from_tensor(hidden, [tiles["BLOCK_N"], tiles["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(weight, [tiles["BLOCK_V"], tiles["BLOCK_K"]])
    return h_desc, w_desc


def _programs(device: torch.device, items: int) -> int:
    limit = INTERPRET_PROGRAMS if INTERPRET else PROGRAMS_PER_SM * num_sms(device)
    return max(1, min(items, limit))


def _flags(dtype: torch.dtype) -> dict:
    return {"CAST_F32": cast_dot_inputs_to_fp32(dtype), "IEEE": dtype == torch.float32}


def num_splits(v: int, dtype: torch.dtype) -> int:
    """Vocab splits of the forward (one [4, N] partial each) for a shard of v rows."""
    splits = NUM_SPLITS_INTERPRET if INTERPRET else NUM_SPLITS_GPU
    return max(1, min(splits, triton.cdiv(v, _tiles(dtype)[0]["BLOCK_V"])))


def forward_split_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets_local: torch.Tensor,
    inv_temp: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[splits, 4, N] partial statistics of softmax(hidden @ weight.T * inv_temp) (logprob.merge_stats).
    out: the fp32 [num_splits(V), 4, N] buffer to fill (tests pass one full of NaN: every entry is written)."""
    n, h = hidden.shape
    v = weight.shape[0]
    tiles, launch = _tiles(hidden.dtype)
    splits = num_splits(v, hidden.dtype)
    stats = torch.empty((splits, 4, n), device=hidden.device, dtype=torch.float32) if out is None else out
    if stats.shape != (splits, 4, n) or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(
            f"out must be a contiguous fp32 [{splits}, 4, {n}] tensor; got {stats.dtype} {list(stats.shape)}"
        )
    h_desc, w_desc = _descriptors(hidden, weight, tiles)
    items = triton.cdiv(n, tiles["BLOCK_N"]) * splits
    grid = (_programs(hidden.device, items),)
    _fwd_persistent_kernel[grid](
        h_desc,
        w_desc,
        targets_local,
        stats,
        n,
        v,
        h,
        splits,
        inv_temp,
        GROUP_N=8,
        **tiles,
        **_flags(hidden.dtype),
        **launch,
    )
    return stats


def dlogits_into(
    dz: torch.Tensor,
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
    """dz [R, Vc] = dL/dlogits of hidden_rows @ weight_rows.T (weight_rows: the shard's rows from col0 on;
    tgt and the per-row tensors: the R rows' own)."""
    rows, cols = dz.shape
    tiles, launch = _tiles(hidden_rows.dtype)
    h_desc, w_desc = _descriptors(hidden_rows, weight_rows, tiles)
    items = triton.cdiv(rows, tiles["BLOCK_N"]) * triton.cdiv(cols, tiles["BLOCK_V"])
    grid = (_programs(dz.device, items),)
    _dlogits_persistent_kernel[grid](
        h_desc,
        w_desc,
        tgt,
        big_m,
        log_s,
        mean_c,
        g_lp,
        g_ent,
        dz,
        rows,
        cols,
        hidden_rows.shape[1],
        dz.stride(0),
        inv_temp,
        col0,
        HAS_ENT=has_ent,
        **tiles,
        **_flags(hidden_rows.dtype),
        **launch,
    )

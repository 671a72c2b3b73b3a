"""The one-pass forward's logits + statistics kernel with hidden and weight tiles loaded by TMA
(linear_dapo_loss(..., logits="tma"), bench variant one_pass_tma): the same work as
head_loss._logits_stats_kernel (each chunk's logits GEMM once, the scaled fp32 tile stored to the chunk
workspace, the online softmax statistics folded per tile), with the K loop of
logprob_persistent._logits_tile_tma instead of logprob._logits_tile.

Why (kernels/bench/NOTES.md, issue 53): the tl.dot forward computes an address and a mask per element of
every [BLOCK, BLOCK_K] operand tile (cp.async); the predicted ~480 TFLOP/s of that GEMM is the largest gap to
QuACK at 32B. Here the copy engine moves [BLOCK_N, BLOCK_K] / [BLOCK_V, BLOCK_K] boxes of host tensor
descriptors (triton.tools.tensor_descriptor) into shared memory, zero-filled past the chunk's rows, the
shard's real vocabulary rows and H: no address arithmetic and no masks in the K loop, registers left to the
epilogue (the fp32 workspace store + the statistics).

Grid and work split are head_loss's (row blocks fastest x vocab splits; not persistent, so that the two
kernels differ only in how the operands arrive: a GPU row compares exactly that). The workspace tile is
still stored from registers with a masked store (the workspace's row stride, V_local fp32, need not be
16-byte aligned, and one_pass_bytes counts it unpadded).

TMA's rules (logprob_persistent.tma_ok: 16-byte aligned bases and row strides) fail for odd H; head_loss
then runs its tl.dot kernel for that chunk (same results to fp32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._runtime import INTERPRET, autotune_every_config
from ._softmax_tiles import split_columns, split_stats, store_stats
from .logprob_persistent import _logits_tile_tma

# Interpreter tiles: head_loss.INTERPRET_TILES (tests pin both kernels to the same tiles).
INTERPRET_TILES = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}


@triton.jit
def _store_logits_tile_tma(
    src, rows, v0, cols, col_ok, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """split_stats's tile producer: the TMA-fed logits tile, whose scaled copy acc * inv_temp is also stored
    in the workspace (split_stats scales the returned tile by the same fp32 multiply: the statistics and
    head_loss._dz_kernel see bit-identical logits)."""
    h_desc, w_desc, row0, H, row_ok, ws_ptr, stride_ws, inv_temp = src
    acc = _logits_tile_tma(h_desc, w_desc, row0, v0, H, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE)
    out = ws_ptr + rows.to(tl.int64)[:, None] * stride_ws + cols[None, :]
    tl.store(out, acc * inv_temp, mask=row_ok[:, None] & col_ok[None, :])
    return acc


@triton.jit
def _logits_stats_tma_kernel(
    h_desc,
    w_desc,
    tgt_ptr,
    ws_ptr,
    stats_ptr,
    N,
    V,
    H,
    stride_ws,
    num_splits,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
):
    """One program: BLOCK_N rows x one vocab split (head_loss._logits_stats_kernel's work item)."""
    pid = tl.program_id(0)
    pid_n = pid % tl.cdiv(N, BLOCK_N)  # row blocks fastest: programs in flight share weight tiles
    pid_s = pid // tl.cdiv(N, BLOCK_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    v_begin, v_end = split_columns(pid_s, V, num_splits, BLOCK_V)
    src = (h_desc, w_desc, pid_n * BLOCK_N, H, row_ok, ws_ptr, stride_ws, inv_temp)
    m, s, t, zt = split_stats(
        _store_logits_tile_tma, src, rows, tgt, v_begin, v_end, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32,
        IEEE, SPLIT_EPILOGUE,
    )  # fmt: skip
    store_stats(stats_ptr, pid_s, N, rows, row_ok, m, s, t, zt)


def _set_boxes(nargs: dict) -> None:
    """Autotune pre-hook: the descriptors' boxes follow the configuration being run."""
    nargs["h_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_V"], nargs["BLOCK_K"]]


# (BLOCK_N, BLOCK_V, BLOCK_K, warps, stages): the sm_90 builds that spill nothing
# (kernels/bench/compile_check_head_loss.py, tests/kernels/test_head_loss_sass.py).
HOPPER_SHAPES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 5)]
# fp32 inputs (exact IEEE dot, a test path, not a speed path): 16-bit tiles of fp32 boxes overflow shared
# memory; logprob_persistent.FP32_HOPPER_TILES's shape.
FP32_HOPPER_SHAPES = [(64, 64, 32, 8, 2)]


def hopper_configs(*, fp32: bool = False, every: bool = True) -> list:
    """The compiled kernel's autotune list; every=False: the first only (DAPO_KERNELS_AUTOTUNE=0)."""
    shapes = FP32_HOPPER_SHAPES if fp32 else HOPPER_SHAPES
    shapes = shapes if every else shapes[:1]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st, pre_hook=_set_boxes)
        for bn, bv, bk, w, st in shapes
    ]


if INTERPRET:
    _KERNELS = {False: _logits_stats_tma_kernel, True: _logits_stats_tma_kernel}
else:  # pragma: no cover - compiled path, exercised by tests/gpu

    def _tuned(fp32: bool):
        configs = hopper_configs(fp32=fp32, every=autotune_every_config())
        return triton.autotune(configs=configs, key=["V", "H", "CAST_F32", "IEEE"])(_logits_stats_tma_kernel)

    _KERNELS = {False: _tuned(False), True: _tuned(True)}


def logits_stats(
    hidden, weight, targets_local, ws, parts, *, splits: int, inv_temp: float, flags: dict, split_epilogue
):
    """Fill ws [C, V] with z = hidden @ weight.T * inv_temp and parts [splits, 4, C] with each vocab split's
    (m, s, t, zt) (head_loss._chunk_stats's launch, operands by TMA; hidden and weight must pass tma_ok)."""
    n, h = hidden.shape
    v = weight.shape[0]
    # boxes of the interpreter's tiles; compiled, the autotune pre-hook sets each configuration's
    box = INTERPRET_TILES if INTERPRET else {"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_K": 64}
    h_desc = TensorDescriptor.from_tensor(hidden, [box["BLOCK_N"], box["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(weight, [box["BLOCK_V"], box["BLOCK_K"]])
    meta = dict(INTERPRET_TILES) if INTERPRET else {}
    grid = lambda META: (triton.cdiv(n, META["BLOCK_N"]) * splits,)  # noqa: E731
    _KERNELS[hidden.dtype == torch.float32][grid](
        h_desc, w_desc, targets_local, ws, parts, n, v, h, ws.stride(0), splits, inv_temp,
        SPLIT_EPILOGUE=split_epilogue, **flags, **meta,
    )  # fmt: skip

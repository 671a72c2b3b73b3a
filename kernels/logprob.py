"""Fused LM-head log-prob + entropy: logprob[N], entropy[N] of softmax(hidden @ weight.T / T) at
the target tokens, without ever holding the [N, V] logits.

    from dapo_kernels import linear_logprob_entropy
    logprob, entropy = linear_logprob_entropy(hidden_NH, weight_VH, targets_N, temperature=1.0)
    (logprob * adv).sum().backward()     # grads for hidden and weight, entropy bonus allowed too

Forward (one Triton kernel, `_fwd_kernel`): each program owns BLOCK_N rows and one contiguous
vocab split; it walks its split in [BLOCK_N, BLOCK_V] logit tiles (tl.dot over H in BLOCK_K
steps) and keeps four running per-row statistics, all relative to the running max m:
    m  = max_j z_j
    s  = sum_j exp(z_j - m)
    t  = sum_j exp(z_j - m) * (z_j - m)          (shifted, so +-1e4 offsets do not cancel)
    zt = z_target                                 (0 when the target is not in this shard)
When a tile raises the max from m to m', alpha = exp(m - m') and
    s' = alpha * s + sum_tile exp(z - m'),   t' = alpha * (t + (m - m') * s) + sum_tile p * (z - m').
Splits (and, with tp_group, ranks) are merged with the same rule (`merge_stats`); the vocab-parallel
merge is ONE all_gather of 4 floats per token. Then
    lse = m + log s,  logprob = (zt - m) - log s <= 0,  entropy = log s - t / s >= 0.

Padded vocabularies (Megatron pads V to a multiple of divisible_by * tp with zero rows): with
vocab_size, rows at or past it on this shard are never read; they take no probability and get a zero
weight gradient (the kernels just see the shard's first `real` rows, a row-prefix view).

Backward: dL/dlogits is recomputed from the saved (m, log s, E_p[z - m]) per token, with
p = exp((z - m) - log s):
    dL/dz_k = g_lp * (1[k = target] - p_k) + g_ent * p_k * (E_p[z] - z_k)     (then / T)
(d entropy / dz_k = p_k (E[z] - z_k)), written in the input dtype, and cuBLAS does grad_hidden = dZ W
and grad_weight = dZ^T hidden. FLOPs: 2NHV forward + 6NHV backward = the 8NHV of a plain linear +
cross entropy. Two schedules (backward=...):
- "blocked" (default, `_backward_blocked`): row blocks of R rows x vocab blocks of Vc rows
  (`blocked_plan`). grad_weight[Vc] is produced by one GEMM per row block with K = R, rounded to the
  weight dtype once per row block (one pass when R = N); grad_hidden rows accumulate in fp32 over the
  vocab blocks (K = Vc, compute-bound) and are copied out (all-reduced over tp_group first) once per row
  block. Workspace `blocked_workspace_bytes` <= min(256 MiB, 3 N H bytes) whatever N is.
- "row_chunked" (the first schedule, `_backward_row_chunked`): chunks of C = 256 MiB / (V e) rows
  over the full vocab; grad_weight accumulated in an fp32 [V_local, H] buffer (N/C read-modify-write
  passes over 4VH bytes: the memory-bound 54 ms of the first H100 profile at 7B, N = 16K).
logits="cublas" (logprob_cublas.py) takes the logit tiles of the forward and of the blocked backward
from torch's matmul (fp32 chunks) instead of tl.dot; the softmax maths are the same (_softmax_tiles.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import logprob_cublas, logprob_persistent
from ._fp32_gemm import addmm_fp32_, mm_fp32
from ._runtime import INTERPRET, autotune_every_config, cast_dot_inputs_to_fp32, require_runnable
from ._softmax_tiles import dz_tile, split_columns, split_stats, store_stats
from .reference import check_logprob_args, check_targets_in_vocab, check_vocab_size, vocab_shard

# dL/dlogits chunk size bound for the backward (bytes): C = this // (V_local * element size).
BACKWARD_WORKSPACE_BYTES = 256 << 20
# Blocked backward (the default): vocab block width (Hopper: K = 4096 of the fp32 grad_hidden
# accumulation is compute-bound), and a workspace of at most this many bytes per token x hidden unit
# below the 256 MiB cap, so that small batches take little (Liger's transient logits are ~4-5 N H
# bytes; ours stay below them on every benchmark row: kernels/bench/NOTES.md).
VOCAB_BLOCK = 4096
BLOCKED_BUDGET_PER_NH = 3
BACKWARDS = ("blocked", "row_chunked")
# Where the logit tiles come from: "triton" (tl.dot inside the fused kernels), "cublas" (an fp32
# chunk from torch's matmul read by an epilogue kernel: logprob_cublas.py; blocked backward only) or
# "tma" (persistent TMA-fed kernels: logprob_persistent.py; "triton" where TMA's alignment rules fail).
LOGITS = ("triton", "cublas", "tma")
# Vocab splits per row block in the forward: enough programs to fill the GPU even at small N, and
# with GROUP_N row blocks x NUM_SPLITS programs in flight the hidden rows stay in L2 while each
# weight tile is read once per GROUP_N * BLOCK_N rows.
NUM_SPLITS_GPU = 16
NUM_SPLITS_INTERPRET = 2

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    row_ok,
    cols,
    col_ok,
    H,
    stride_hn,
    stride_wv,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_V] tile of hidden[rows] @ weight[cols].T (row strides given, k stride 1)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hn + offs_k[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wv + offs_k[:, None]
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k0 + offs_k[None, :] < H), other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[None, :] & (k0 + offs_k[:, None] < H), other=0.0)
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot_logits(
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
    """split_stats's tile producer for _fwd_kernel: _logits_tile with the kernel's arguments in src."""
    h_ptr, w_ptr, row_ok, H, stride_hn, stride_wv = src
    return _logits_tile(
        h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE
    )


@triton.jit
def _fwd_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    stats_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
    num_splits,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Grouped launch order: GROUP_N consecutive row blocks x all splits run side by side.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_N * num_splits
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_s = (pid % per_group) // group_size

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    v_begin, v_end = split_columns(pid_s, V, num_splits, BLOCK_V)
    src = (h_ptr, w_ptr, row_ok, H, stride_hn, stride_wv)
    m, s, t, zt = split_stats(
        _dot_logits, src, rows, tgt, v_begin, v_end, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE
    )
    store_stats(stats_ptr, pid_s, N, rows, row_ok, m, s, t, zt)


@triton.jit
def _dlogits_kernel(
    h_ptr,
    w_ptr,
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
    stride_hn,
    stride_wv,
    stride_dzn,
    inv_temp,
    col0,
    HAS_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Row blocks vary fastest: programs in flight share one weight tile (read once from HBM) and
    # the chunk's hidden rows stay in L2.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = pid % num_n
    pid_v = pid // num_n
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    z = (
        _logits_tile(
            h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE
        )
        * inv_temp
    )
    dz = dz_tile(
        z, rows, row_ok, cols, col_ok, tgt_ptr, max_ptr, logs_ptr, meanc_ptr, glp_ptr, gent_ptr, inv_temp, col0, HAS_ENT
    )
    out = dz_ptr + rows.to(tl.int64)[:, None] * stride_dzn + cols[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _hopper_configs(with_group: bool, *, every: bool = True):
    # (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages): 128x256 with 8 warps is the usual Hopper
    # wgmma sweet spot; 128x128 variants trade tile reuse for registers left to the epilogue.
    # every=False: only that first one (DAPO_KERNELS_AUTOTUNE=0, _runtime.autotune_every_config).
    shapes = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4)]
    shapes = shapes if every else shapes[:1]
    configs = []
    for bn, bv, bk, warps, stages in shapes:
        meta = {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}
        if with_group:
            meta["GROUP_N"] = 8
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    return configs


# Interpreter tiles. The interpreter runs every program instance op by op in numpy, so its cost is
# about the number of (program, tile) steps and hardly depends on the tile size (measured on the
# 2-core CI machine: N=200, V=300, H=64 forward 5.9 s with 16x64x32 tiles, 1.7 s with 64x256x64).
# Tiles therefore grow with the problem up to these caps; tests/kernels pin small caps to run several
# vocab tiles per program (the online rescaling) and partial tiles on every edge.
INTERPRET_TILE_CAPS = {"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_K": 64}
# Backward chunks are a multiple of this many rows (one row block of the compiled configurations).
CHUNK_ROW_ALIGN = 16 if INTERPRET else 128
if INTERPRET:
    _fwd = _fwd_kernel
    _dlogits = _dlogits_kernel
else:  # pragma: no cover - compiled path, exercised by tests/gpu
    _every = autotune_every_config()
    _fwd = triton.autotune(configs=_hopper_configs(True, every=_every), key=["V", "H", "CAST_F32", "IEEE"])(_fwd_kernel)
    _dlogits = triton.autotune(configs=_hopper_configs(False, every=_every), key=["V", "H", "HAS_ENT", "IEEE"])(
        _dlogits_kernel
    )


def _launch_meta(extra: dict, *, n: int, v: int, h: int) -> dict:
    """Compiled: {} (autotune picks the tiles). Interpreter: power-of-two tiles covering the problem,
    at least 16 (tl.dot's minimum), at most INTERPRET_TILE_CAPS."""
    if not INTERPRET:
        return {}
    size = {"BLOCK_N": n, "BLOCK_V": v, "BLOCK_K": h}
    meta = {key: min(cap, max(16, triton.next_power_of_2(size[key]))) for key, cap in INTERPRET_TILE_CAPS.items()}
    return {**meta, **extra}


def merge_stats(stats: torch.Tensor) -> torch.Tensor:
    """[R, 4, N] partial (m, s, t, zt) over disjoint vocab ranges -> [4, N], fixed summation order.

    Part r rescaled to the global max M: w_r = exp(m_r - M),
    S = sum_r w_r s_r,  T = sum_r w_r (t_r + (m_r - M) s_r),  ZT = sum_r zt_r.
    An empty part (m = -inf, s = 0) contributes nothing."""
    m, s, t, zt = stats.unbind(1)
    big_m = m.max(dim=0).values
    nonempty = s > 0
    w = torch.where(nonempty, torch.exp(m - big_m), 0.0)
    shift = torch.where(nonempty, (m - big_m) * s, 0.0)
    return torch.stack([big_m, (w * s).sum(0), (w * (t + shift)).sum(0), zt.sum(0)])


def _forward_stats(hidden, weight, targets_local, inv_temp: float, logits: str = "triton") -> torch.Tensor:
    n, h = hidden.shape
    v = weight.shape[0]
    if v == 0:  # a shard of vocabulary padding only: the empty part (m = -inf, s = 0) merge_stats skips
        stats = torch.zeros((4, n), device=hidden.device, dtype=torch.float32)
        stats[0] = float("-inf")
        return stats
    if logits == "cublas":
        return merge_stats(logprob_cublas.forward_split_stats(hidden, weight, targets_local, inv_temp))
    if logits == "tma" and logprob_persistent.tma_ok(hidden, weight):
        return merge_stats(logprob_persistent.forward_split_stats(hidden, weight, targets_local, inv_temp))
    splits = NUM_SPLITS_INTERPRET if INTERPRET else NUM_SPLITS_GPU
    splits = max(1, min(splits, triton.cdiv(v, 64)))
    stats = torch.empty((splits, 4, n), device=hidden.device, dtype=torch.float32)
    flags = {"CAST_F32": cast_dot_inputs_to_fp32(hidden.dtype), "IEEE": hidden.dtype == torch.float32}
    meta = _launch_meta({"GROUP_N": 2}, n=n, v=v, h=h)
    grid = lambda META: (triton.cdiv(n, META["BLOCK_N"]) * splits,)  # noqa: E731
    _fwd[grid](
        hidden,
        weight,
        targets_local,
        stats,
        n,
        v,
        h,
        hidden.stride(0),
        weight.stride(0),
        splits,
        inv_temp,
        **flags,
        **meta,
    )
    return merge_stats(stats)


def _gather_merge(local: torch.Tensor, tp_group) -> torch.Tensor:
    """The one collective of the forward: all_gather the [4, N] stats and merge in rank order."""
    world = dist.get_world_size(tp_group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return merge_stats(torch.stack(parts))


def _chunk_rows(n: int, v: int, element_size: int) -> int:
    rows = BACKWARD_WORKSPACE_BYTES // max(1, v * element_size)
    align = CHUNK_ROW_ALIGN
    return max(align, rows // align * align) if rows < n else n


@dataclasses.dataclass
class _BackwardJob:
    """What both backward schedules need: inputs, saved per-token stats, upstream grads, outputs
    (grad_h [N, H] or None; grad_w = the real rows of the weight gradient, [V, H], or None)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets_local: torch.Tensor
    big_m: torch.Tensor
    log_s: torch.Tensor
    mean_c: torch.Tensor
    g_lp: torch.Tensor
    g_ent: torch.Tensor
    has_ent: bool
    inv_temp: float
    tp_group: object
    grad_h: torch.Tensor | None
    grad_w: torch.Tensor | None
    shard_rows: int  # the weight shard's rows, vocab padding included (the same on every TP rank)
    logits: str = "triton"
    scratch: torch.Tensor | None = None  # logits="cublas": the fp32 logits block [R, Vc]

    def dlogits(self, dz: torch.Tensor, r0: int, r1: int, v0: int, v1: int) -> None:
        """dz[:r1-r0, :v1-v0] = dL/dlogits for rows [r0, r1) and vocab rows [v0, v1) (recomputed logits)."""
        rows, cols, h = r1 - r0, v1 - v0, self.hidden.shape[1]
        if rows == 0 or cols == 0:
            return
        if self.logits == "cublas":
            assert self.scratch is not None  # allocated with the cuBLAS path (_backward_blocked)
            logprob_cublas.dlogits_into(
                dz,
                _packed(self.scratch, rows, cols),
                self.hidden[r0:r1],
                self.weight[v0:v1],
                self.targets_local[r0:r1],
                self.big_m[r0:r1],
                self.log_s[r0:r1],
                self.mean_c[r0:r1],
                self.g_lp[r0:r1],
                self.g_ent[r0:r1],
                has_ent=self.has_ent,
                inv_temp=self.inv_temp,
                col0=v0,
            )
            return
        h_rows, w_rows = self.hidden[r0:r1], self.weight[v0:v1]
        if self.logits == "tma" and logprob_persistent.tma_ok(h_rows, w_rows):
            per_row = (self.targets_local, self.big_m, self.log_s, self.mean_c, self.g_lp, self.g_ent)
            logprob_persistent.dlogits_into(
                dz, h_rows, w_rows, *(t[r0:r1] for t in per_row), has_ent=self.has_ent, inv_temp=self.inv_temp, col0=v0
            )
            return
        flags = {"CAST_F32": cast_dot_inputs_to_fp32(self.hidden.dtype), "IEEE": self.hidden.dtype == torch.float32}
        meta = _launch_meta({}, n=rows, v=cols, h=h)

        def grid(META):
            return (triton.cdiv(rows, META["BLOCK_N"]) * triton.cdiv(cols, META["BLOCK_V"]),)

        _dlogits[grid](
            self.hidden[r0:r1],
            self.weight[v0:v1],
            self.targets_local[r0:r1],
            self.big_m[r0:r1],
            self.log_s[r0:r1],
            self.mean_c[r0:r1],
            self.g_lp[r0:r1],
            self.g_ent[r0:r1],
            dz,
            rows,
            cols,
            h,
            self.hidden.stride(0),
            self.weight.stride(0),
            dz.stride(0),
            self.inv_temp,
            v0,
            HAS_ENT=self.has_ent,
            **flags,
            **meta,
        )


def _packed(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view of the front of buf: a narrower last vocab block stays dense, so
    cuBLAS writes it in place (a row-strided `out` view can make torch stage the GEMM in a temporary)."""
    return buf.view(-1)[: rows * cols].view(rows, cols)


def _backward_row_chunked(job: _BackwardJob) -> None:
    """The first schedule (kept selectable: backward="row_chunked"): row chunks of C rows with the full
    vocab; grad_w += dZ^T h per chunk into an fp32 [V, H] accumulator when there is more than one chunk
    (N/C read-modify-write passes over 4VH bytes: memory-bound on an H100, see kernels/bench/NOTES.md)."""
    hidden, weight = job.hidden, job.weight
    n, v = hidden.shape[0], weight.shape[0]
    # planned from the shard's rows WITH padding (equal on every TP rank), not its real rows v: each chunk
    # all-reduces grad_hidden over tp_group, so every rank must cut the same chunks (real rows differ
    # between ranks under vocab padding: 3eb0efe's ranks issued different collectives and gloo aborted)
    chunk = _chunk_rows(n, job.shard_rows, hidden.element_size())
    workspace = torch.empty((min(chunk, n), v), device=hidden.device, dtype=hidden.dtype)
    acc_w = None
    if job.grad_w is not None and chunk < n:
        acc_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        dz = workspace[: r1 - r0]
        job.dlogits(dz, r0, r1, 0, v)
        if job.grad_h is not None:
            if job.tp_group is None:
                torch.mm(dz, weight, out=job.grad_h[r0:r1])
            else:  # each rank holds its vocab shard's share of dL/dhidden: sum them in fp32
                part = mm_fp32(dz, weight)
                dist.all_reduce(part, group=job.tp_group)
                job.grad_h[r0:r1].copy_(part)
        if job.grad_w is not None:
            if acc_w is None:
                torch.mm(dz.t(), hidden[r0:r1], out=job.grad_w)
            else:
                addmm_fp32_(acc_w, dz.t(), hidden[r0:r1])
    if acc_w is not None:
        assert job.grad_w is not None  # acc_w exists only for a weight gradient
        # copy_ converts in place: `grad_w[:] = acc_w.to(dtype)` held a third [V, H] (1039.5 MiB at
        # Qwen2.5-7B) next to the fp32 accumulator: the 1153 MiB "workspace" of the first H100 run.
        job.grad_w.copy_(acc_w)


def blocked_plan(
    n: int, h: int, v: int, element_size: int, *, tp: bool = False, cublas: bool = False
) -> tuple[int, int]:
    """(R, Vc) of the blocked backward: row blocks of R rows x vocab blocks of Vc rows, with
    R * (Vc * element_size + 4H [fp32 grad_hidden rows, when V > Vc or with TP]) <= the workspace
    budget min(BACKWARD_WORKSPACE_BYTES, BLOCKED_BUDGET_PER_NH * N * H). v is the shard's row count
    (padding included): every TP rank gets the same R, hence the same collectives. cublas: 4 more bytes
    per dL/dlogits element (the fp32 logits block the epilogue reads)."""
    cols = max(1, min(v, VOCAB_BLOCK))
    budget = min(BACKWARD_WORKSPACE_BYTES, BLOCKED_BUDGET_PER_NH * n * h)
    per_row = cols * (element_size + (4 if cublas else 0)) + (4 * h if v > cols or tp else 0)
    rows = budget // per_row
    align = CHUNK_ROW_ALIGN
    rows = max(align, rows // align * align)
    if rows >= n:
        return n, cols
    # Balanced row blocks (no thin last GEMM): the fewest blocks that fit, then their even size rounded
    # up to the alignment, which stays <= rows (rows is a multiple of align, >= the even size).
    blocks = -(-n // rows)
    even = -(-n // blocks)
    return -(-even // align) * align, cols


def blocked_workspace_bytes(
    n: int, h: int, v: int, element_size: int, *, tp: bool = False, cublas: bool = False
) -> int:
    """Bytes the blocked backward allocates besides its two outputs: the dL/dlogits block [R, Vc] and,
    with more than one vocab block (or TP), the fp32 grad_hidden rows [R, H]. At most
    max(BACKWARD_WORKSPACE_BYTES, one aligned row block) whatever N is."""
    rows, cols = blocked_plan(n, h, v, element_size, tp=tp, cublas=cublas)
    return rows * cols * (element_size + (4 if cublas else 0)) + (4 * rows * h if v > cols or tp else 0)


def _backward_blocked(job: _BackwardJob) -> None:
    """Row blocks of R rows (outer) x vocab blocks of Vc rows (inner), see blocked_plan. Per block:
    dZ = dL/dlogits [R, Vc] (Triton), grad_w[Vc] (+)= dZ^T h[R] (cuBLAS, K = R, fp32 inside, rounded to
    the weight dtype once per ROW block: one pass when R = N, a few at large N, instead of N/C fp32
    read-modify-writes of the whole [V, H]), grad_h[R] += dZ W[Vc] into fp32 rows [R, H] (K = Vc),
    copied out (all-reduced over tp_group first: one collective per row block) after the vocab loop."""
    hidden, weight = job.hidden, job.weight
    n, h = hidden.shape
    v = weight.shape[0]
    cublas = job.logits == "cublas"
    rows, cols = blocked_plan(n, h, job.shard_rows, hidden.element_size(), tp=job.tp_group is not None, cublas=cublas)
    dz_buf = torch.empty((rows, min(cols, v)), device=hidden.device, dtype=hidden.dtype)
    if cublas:
        job.scratch = torch.empty((rows, min(cols, v)), device=hidden.device, dtype=torch.float32)
    many_blocks = v > cols
    acc_h = None
    if job.grad_h is not None and (many_blocks or job.tp_group is not None):
        acc_h = torch.empty((rows, h), device=hidden.device, dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h_rows = hidden[r0:r1]
        if acc_h is not None:
            acc_h[: r1 - r0].zero_()
        for v0 in range(0, max(v, 1), cols):
            v1 = min(v, v0 + cols)
            dz = _packed(dz_buf, r1 - r0, v1 - v0)
            job.dlogits(dz, r0, r1, v0, v1)
            if job.grad_h is not None:
                if acc_h is None:  # one vocab block, no TP: K = V, written once
                    torch.mm(dz, weight[v0:v1], out=job.grad_h[r0:r1])
                else:
                    addmm_fp32_(acc_h[: r1 - r0], dz, weight[v0:v1])
            if job.grad_w is not None and v1 > v0:
                if r0 == 0:
                    torch.mm(dz.t(), h_rows, out=job.grad_w[v0:v1])
                else:
                    job.grad_w[v0:v1].addmm_(dz.t(), h_rows)
        if acc_h is not None:
            part = acc_h[: r1 - r0]
            if job.tp_group is not None:
                dist.all_reduce(part, group=job.tp_group)
            assert job.grad_h is not None  # acc_h exists only for a hidden gradient
            job.grad_h[r0:r1].copy_(part)


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, tp_group, return_entropy, vocab_size, backward, logits):
        vocab_start, vocab_local, _ = vocab_shard(weight, tp_group)
        real_rows = max(0, min(vocab_local, vocab_size - vocab_start))  # the rest of the shard is padding
        targets_local = (targets.long() - vocab_start).contiguous()
        inv_temp = 1.0 / float(temperature)
        stats = _forward_stats(hidden, weight[:real_rows], targets_local, inv_temp, logits)
        if tp_group is not None:
            stats = _gather_merge(stats, tp_group)
        big_m, s, t, zt = stats.unbind(0)
        log_s = torch.log(s)
        logprob = (zt - big_m) - log_s
        entropy = log_s - t / s
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets_local, big_m, log_s, t / s)
        ctx.inv_temp, ctx.tp_group, ctx.real_rows, ctx.backward = inv_temp, tp_group, real_rows, backward
        ctx.logits = logits
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight_shard, targets_local, big_m, log_s, mean_c = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprob is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None, None, None
        weight = weight_shard[: ctx.real_rows]  # padding rows: no logits, so no dL/dz and a zero gradient
        v = weight.shape[0]
        g_lp = torch.zeros_like(log_s) if grad_logprob is None else grad_logprob.float().contiguous()
        has_ent = grad_entropy is not None
        g_ent = grad_entropy.float().contiguous() if has_ent else g_lp  # placeholder pointer when unused
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_shard = None
        if need_w:
            padded = v < weight_shard.shape[0]
            grad_shard = torch.zeros_like(weight_shard) if padded else torch.empty_like(weight_shard)
        job = _BackwardJob(
            hidden,
            weight,
            targets_local,
            big_m,
            log_s,
            mean_c,
            g_lp,
            g_ent,
            has_ent,
            ctx.inv_temp,
            ctx.tp_group,
            grad_h,
            grad_shard[:v] if grad_shard is not None else None,  # allocated exactly when need_w
            weight_shard.shape[0],
            ctx.logits,
        )
        if ctx.backward == "row_chunked":
            _backward_row_chunked(job)
        else:
            _backward_blocked(job)
        return grad_h, grad_shard, None, None, None, None, None, None, None


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    return_entropy: bool = True,
    vocab_size: int | None = None,
    backward: str = "blocked",
    logits: str = "triton",
):
    """(logprob[N] fp32, entropy[N] fp32 or None) of softmax(hidden @ weight.T / temperature).

    hidden [N, H] and weight [V_local, H] in bf16/fp16/fp32 (same dtype); targets [N] GLOBAL token
    ids. With tp_group, rank r holds vocab rows [r*V_local, (r+1)*V_local): the forward does one
    all_gather of 4 floats per token, the hidden gradient is all-reduced over the group and the
    weight gradient stays local. Differentiable in hidden and weight through logprob AND entropy.
    vocab_size: the real vocabulary (default: all V_local * tp rows); global rows at or past it are
    padding: excluded from the softmax, zero weight gradient.
    backward: "blocked" (row blocks x vocab blocks, see _backward_blocked) or "row_chunked" (the first
    schedule: full-vocab row chunks into an fp32 [V, H] accumulator), kept until a GPU run compares them.
    logits: "triton" (tl.dot inside the fused kernels) or "cublas" (fp32 logit chunks from torch's matmul,
    read by Triton epilogues: logprob_cublas.py; needs backward="blocked") or "tma" (persistent, TMA-fed
    Triton kernels: logprob_persistent.py; the tl.dot kernels where TMA's 16-byte alignment fails).
    Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; anything else raises
    RuntimeError (use linear_logprob_entropy_reference there).
    """
    check_logprob_args(hidden, weight, targets, temperature)
    if hidden.dtype not in _SUPPORTED:
        raise ValueError(f"linear_logprob_entropy supports {_SUPPORTED}; got {hidden.dtype}")
    require_runnable(hidden, weight, targets, op="linear_logprob_entropy")
    _, _, vocab_rows = vocab_shard(weight, tp_group)
    vocab_size = check_vocab_size(vocab_size, vocab_rows)
    check_targets_in_vocab(targets, vocab_size)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}; got {backward!r}")
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS}; got {logits!r}")
    if logits == "cublas" and backward != "blocked":
        raise ValueError(
            "logits='cublas' needs backward='blocked' (the row_chunked schedule has no fp32 logits "
            "scratch in its workspace)"
        )
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + (hidden.sum() + weight.sum()) * 0
        return empty, (empty.clone() if return_entropy else None)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logprob, entropy = _LinearLogprobEntropy.apply(
        hidden, weight, targets, float(temperature), tp_group, bool(return_entropy), vocab_size, backward, logits
    )
    return logprob, (entropy if return_entropy else None)

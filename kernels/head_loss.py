"""The LM head and the DAPO loss in one pass: loss, per-token log-prob / entropy and the step's
statistics, with grad_hidden and grad_weight computed IN THE FORWARD (three N x H x V GEMMs, 6NHV
FLOPs, instead of the 8NHV of linear_logprob_entropy + policy_loss, whose backward recomputes the
logits).

    from dapo_kernels.head_loss import linear_dapo_loss
    loss, logprob, entropy, stats = linear_dapo_loss(
        hidden_NH, weight_VH, targets_N, old_logprob_N, advantages_N, loss_weight_N,
        eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, temperature=1.0, loss_denominator=D)
    loss.backward()     # multiplies the gradients stored by the forward by the incoming scalar

Why one pass works: DAPO's per-token loss depends on the logits only through logp_t, and everything
else (old log-prob, advantage, clip bounds, the global denominator D, the token's weight) is known
before the pass, so dL/dlogp_t = g_t is known the moment logp_t is. With z = logits / T and
p = softmax(z): dL/dlogits_k = g_t (1[k = target] - p_k) / T. The entropy is a metric here, not
differentiated (use linear_logprob_entropy for an entropy bonus).

Schedule, per chunk of C rows (C * V_local * (4 + e) bytes <= WORKSPACE_BYTES: the [N, V] logits never
exist beyond one chunk):
 1. `_logits_stats_kernel` (Triton, row blocks x vocab splits): the chunk's logits tiles by tl.dot,
    written once to an fp32 [C, V_local] workspace, and the online softmax statistics (m, s, t, zt)
    over the split's vocab tiles (_softmax_tiles.online_update); splits (and, with tp_group, the vocab
    shards: ONE all_gather of 4 floats per token) merged by logprob.merge_stats.
 2. logp = (zt - m) - log s, entropy = log s - t / s (per token, torch).
 3. `_dz_kernel` (Triton, row blocks x vocab tiles): g_t from the clipped loss (policy_loss's
    `_clipped_token_loss`: clip-higher + dual clip, torch's tie conventions, weight / D applied), then
    dlogits = g_t (onehot - exp(z - m - log s)) / T from the workspace tile, in the input dtype.
 4. grad_hidden[chunk] = dlogits @ W (all-reduced over tp_group), grad_weight (+)= dlogits^T hidden
    (torch matmul: cuBLAS on a GPU; fp32 accumulation over chunks when there are several).
After the chunks, policy_loss's one-pass kernel turns logp into the loss and the 7 statistics
(POLICY_LOSS_STAT_KEYS, means weighted by loss_weight) in one launch over N tokens.

Vocab-parallel (tp_group): rank r holds rows [r * V_local, (r + 1) * V_local); every rank gets the same
loss, logprob, entropy and stats; grad_hidden is summed over the group, grad_weight stays local.
vocab_size: the real vocabulary; rows at or past it are padding (no probability, zero gradient).
This is a first version for correctness (CPU interpreter) and the SASS read: the workspace round trip
(4 + 2e bytes per logit) is the obvious thing a GPU measurement may push into one persistent kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from . import head_loss_tma
from ._fp32_gemm import addmm_fp32_, mm_fp32
from ._runtime import INTERPRET, autotune_every_config, cast_dot_inputs_to_fp32, num_sms, require_runnable
from ._softmax_tiles import split_columns, split_stats, store_stats
from .logprob import _logits_tile, merge_stats
from .logprob_persistent import tma_ok
from .policy_loss import _BLOCK, _NUM_PARTIALS, _REDUCE_BLOCK, _clipped_token_loss, _counter, _fused_kernel
from .reference import (
    POLICY_LOSS_STAT_KEYS,
    check_logprob_args,
    check_policy_loss_args,
    check_targets_in_vocab,
    check_vocab_size,
    vocab_shard,
)

# Bound on the chunk's workspace (fp32 logits + dlogits in the input dtype), bytes.
WORKSPACE_BYTES = 512 << 20
COMPILED_CHUNK_ROW_ALIGN = 128  # the tuned BLOCK_N (the memory plan counts the GPU's chunks: one_pass_bytes)
CHUNK_ROW_ALIGN = 16 if INTERPRET else COMPILED_CHUNK_ROW_ALIGN
NUM_SPLITS = 2 if INTERPRET else 16
# Compiled: at least this many programs per SM in the logits launch. A chunk has few row blocks at a
# large vocabulary (512 rows at V 152,064 under the default workspace: 4 blocks x 16 splits = 64 programs
# on 132 SMs), so the vocab splits grow until the grid fills the GPU (tiles permitting).
PROGRAMS_PER_SM = 2
# Interpreter tiles (tests pin them smaller to span several vocab tiles and partial edges).
INTERPRET_TILES = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}
# Fold each logits tile into the statistics as two halves (compiled: fewer live registers, see
# kernels/bench/compile_check_head_loss.py; the interpreter runs the same code path).
SPLIT_EPILOGUE = True
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
# How the forward's logits kernel reads hidden and weight tiles: "triton" (tl.dot on pointer loads,
# _logits_stats_kernel) or "tma" (tensor descriptors, head_loss_tma.py; the tl.dot kernel for a chunk whose
# tensors break TMA's 16-byte rules). The rest of the pass is the same.
LOGITS = ("triton", "tma")


@triton.jit
def _store_logits_tile(
    src, rows, v0, cols, col_ok, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    CAST_F32: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """split_stats's tile producer: logprob._logits_tile, whose scaled tile z = acc * inv_temp is also
    stored in the workspace (split_stats scales the returned tile by the same fp32 multiply: the
    statistics and _dz_kernel see bit-identical logits)."""
    h_ptr, w_ptr, row_ok, H, stride_hn, stride_wv, ws_ptr, stride_ws, inv_temp = src
    acc = _logits_tile(
        h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_hn, stride_wv, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE
    )
    out = ws_ptr + rows.to(tl.int64)[:, None] * stride_ws + cols[None, :]
    tl.store(out, acc * inv_temp, mask=row_ok[:, None] & col_ok[None, :])
    return acc


@triton.jit
def _logits_stats_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    ws_ptr,
    stats_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_wv,
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
    """One program: BLOCK_N rows x one vocab split. Each scaled logit tile is stored in the workspace
    (read back by _dz_kernel: the logits GEMM runs once) and folded into the running statistics
    (SPLIT_EPILOGUE: as two halves, fewer live registers; kernels/bench/compile_check_head_loss.py)."""
    pid = tl.program_id(0)
    pid_n = pid % tl.cdiv(N, BLOCK_N)  # row blocks fastest: programs in flight share weight tiles
    pid_s = pid // tl.cdiv(N, BLOCK_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    v_begin, v_end = split_columns(pid_s, V, num_splits, BLOCK_V)
    src = (h_ptr, w_ptr, row_ok, H, stride_hn, stride_wv, ws_ptr, stride_ws, inv_temp)
    m, s, t, zt = split_stats(
        _store_logits_tile, src, rows, tgt, v_begin, v_end, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, CAST_F32, IEEE,
        SPLIT_EPILOGUE,
    )  # fmt: skip
    store_stats(stats_ptr, pid_s, N, rows, row_ok, m, s, t, zt)


@triton.jit
def _dz_kernel(
    ws_ptr,
    dz_ptr,
    tgt_ptr,
    max_ptr,
    logs_ptr,
    lp_ptr,
    old_ptr,
    adv_ptr,
    lw_ptr,
    N,
    V,
    stride_ws,
    stride_dz,
    eps_low,
    eps_high,
    clip_c,
    inv_denom,
    inv_temp,
    HAS_DUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """dL/dlogits of a [BLOCK_N, BLOCK_V] tile: g_t (1[k = target] - p_k) / T, with g_t = dL/dlogp_t of
    the clipped loss (weight / D applied) and p from the workspace's scaled logits."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    rows = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (pid // num_n) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    lp = tl.load(lp_ptr + rows, mask=row_ok, other=0.0)
    old = tl.load(old_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    lw = tl.load(lw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    _, g, _, _, _, _, _ = _clipped_token_loss(lp, old, adv, lw, eps_low, eps_high, clip_c, inv_denom, HAS_DUAL, BLOCK_N)
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(ws_ptr + rows.to(tl.int64)[:, None] * stride_ws + cols[None, :], mask=ok, other=0.0)
    # relative to the row max (exact, Sterbenz): p sums to 1 even at +-1e4 logits
    zc = tl.where(ok, z - tl.load(max_ptr + rows, mask=row_ok, other=0.0)[:, None], 0.0)
    p = tl.exp(zc - tl.load(logs_ptr + rows, mask=row_ok, other=0.0)[:, None])
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    dz = g[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p) * inv_temp
    tl.store(dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


def hopper_configs(*, every: bool = True) -> list:
    """(BLOCK_N, BLOCK_V, BLOCK_K, warps, stages) the compiled logits-stats kernel tunes over: the ones whose
    sm_90 build spills nothing (kernels/bench/compile_check_head_loss.py; 128x256 tiles, logprob.py's
    first choice, spill 200+ local loads here: the fp32 tile store on top of the softmax epilogue).
    every=False: the first only (DAPO_KERNELS_AUTOTUNE=0)."""
    shapes = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 5)]
    shapes = shapes if every else shapes[:1]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bv, bk, w, st in shapes
    ]


if INTERPRET:
    _logits_stats = _logits_stats_kernel
else:  # pragma: no cover - compiled path, exercised by tests/gpu
    _logits_stats = triton.autotune(
        configs=hopper_configs(every=autotune_every_config()), key=["V", "H", "CAST_F32", "IEEE"]
    )(_logits_stats_kernel)
_DZ_TILE = (16, 64) if INTERPRET else (64, 256)


def chunk_rows(n: int, v: int, element_size: int, *, row_align: int | None = None) -> int:
    """Rows per chunk: the fp32 logits + dlogits of a chunk fit WORKSPACE_BYTES (v: the shard's rows,
    padding included, so every TP rank cuts the same chunks and issues the same collectives); chunks are
    multiples of row_align (default CHUNK_ROW_ALIGN: this process's)."""
    align = CHUNK_ROW_ALIGN if row_align is None else row_align
    rows = WORKSPACE_BYTES // max(1, v * (4 + element_size))
    return n if rows >= n else max(align, rows // align * align)


def one_pass_bytes(
    n: int, h: int, v: int, element_size: int, *, tp: bool, weight_size: int | None = None, row_align: int | None = None
) -> dict:
    """What linear_dapo_loss allocates beyond its inputs for N = n tokens, hidden h and a vocab shard of v rows
    (hidden in `element_size` bytes, the weight in `weight_size`, default the same), in bytes:
      "workspace"  while the forward runs: the chunk's fp32 logits + dlogits in the input dtype
                   (min(n, chunk_rows) x v x (4 + e)), the fp32 grad_weight accumulator [v, h] when there
                   are several chunks, and with tp the chunk's fp32 grad_hidden partial [chunk, h]
      "saved"      kept for the backward (ctx.save_for_backward): grad_hidden [n, h] in the input dtype and
                   grad_weight [v, h] in the weight's; the backward's products by the loss scale are new
                   tensors of the same sizes, each gone once autograd has added it
    (per-token fp32 vectors, O(n), are left out: 4 x 4 n bytes, < 1 % of grad_hidden at h >= 1024).
    row_align: chunk_rows's (the memory plan passes COMPILED_CHUNK_ROW_ALIGN: the GPU's chunks)."""
    rows = min(n, chunk_rows(n, v, element_size, row_align=row_align))
    workspace = rows * v * (4 + element_size)
    if rows < n:
        workspace += v * h * 4
    if tp:
        workspace += rows * h * 4
    saved = n * h * element_size + v * h * (element_size if weight_size is None else weight_size)
    return {"workspace": workspace, "saved": saved}


def _chunk_stats(hidden, weight, targets_local, ws, inv_temp: float, logits: str = "triton") -> torch.Tensor:
    """[4, C] merged (m, s, t, zt) of the chunk over this shard's real rows; ws filled with z = logits / T
    (logits: LOGITS, the kernel that computes them)."""
    n, h = hidden.shape
    v = weight.shape[0]
    if v == 0:  # a shard of vocabulary padding only: the empty part merge_stats skips
        stats = torch.zeros((4, n), device=hidden.device, dtype=torch.float32)
        stats[0] = float("-inf")
        return stats
    splits = NUM_SPLITS
    if not INTERPRET:  # fill the GPU: row blocks of 128 (the tuned BLOCK_N) x splits >= PROGRAMS_PER_SM x SMs
        splits = max(splits, triton.cdiv(PROGRAMS_PER_SM * num_sms(hidden.device), triton.cdiv(n, 128)))
    splits = max(1, min(splits, triton.cdiv(v, 128 if not INTERPRET else 64)))  # >= one vocab tile each
    parts = torch.empty((splits, 4, n), device=hidden.device, dtype=torch.float32)
    flags = {"CAST_F32": cast_dot_inputs_to_fp32(hidden.dtype), "IEEE": hidden.dtype == torch.float32}
    if logits == "tma" and tma_ok(hidden, weight):
        head_loss_tma.logits_stats(
            hidden, weight, targets_local, ws, parts, splits=splits, inv_temp=inv_temp, flags=flags,
            split_epilogue=SPLIT_EPILOGUE,
        )  # fmt: skip
        return merge_stats(parts)
    meta = dict(INTERPRET_TILES) if INTERPRET else {}
    grid = lambda META: (triton.cdiv(n, META["BLOCK_N"]) * splits,)  # noqa: E731
    _logits_stats[grid](
        hidden, weight, targets_local, ws, parts, n, v, h, hidden.stride(0), weight.stride(0), ws.stride(0),
        splits, inv_temp, SPLIT_EPILOGUE=SPLIT_EPILOGUE, **flags, **meta,
    )  # fmt: skip
    return merge_stats(parts)


def _gather_merge(local: torch.Tensor, tp_group) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return merge_stats(torch.stack(parts))


def _loss_and_stats(logprob, old, adv, lw, *, eps_low, eps_high, clip_ratio_c, loss_denominator):
    """policy_loss's one-pass kernel over all N tokens: [loss, 7 stats] (its dL/dlogp output is unused:
    the gradient already went into grad_hidden / grad_weight chunk by chunk)."""
    num = logprob.numel()
    num_blocks = max(1, triton.cdiv(num, _BLOCK))
    grad = torch.empty_like(logprob)
    buf = torch.empty(1 + len(POLICY_LOSS_STAT_KEYS) + _NUM_PARTIALS * num_blocks, device=grad.device)
    out, partials = buf[:8], buf[8:]
    has_dual = clip_ratio_c is not None
    _fused_kernel[(num_blocks,)](
        logprob, old, adv, lw, grad, partials, num, num_blocks, float(eps_low), float(eps_high),
        float(clip_ratio_c) if has_dual else 0.0, 1.0 / loss_denominator, 1, _counter(grad.device), out,
        loss_denominator, HAS_DUAL=has_dual, BLOCK=_BLOCK, ADV_PER_ROW=False, ONE_PASS=True,
        REDUCE_BLOCK=_REDUCE_BLOCK,
    )  # fmt: skip
    return out


def _one_pass(
    hidden, weight_shard, targets, old, adv, lw, *, real_rows, vocab_start, tp_group, loss_kw, temperature, logits
):
    """Everything of the forward: (out [8] = loss + stats, logprob, entropy, grad_hidden, grad_weight)."""
    n, h = hidden.shape
    weight = weight_shard[:real_rows]
    v = weight.shape[0]
    inv_temp = 1.0 / temperature
    targets_local = (targets.long() - vocab_start).contiguous()
    chunk = chunk_rows(n, weight_shard.shape[0], hidden.element_size())
    ws = torch.empty((min(chunk, n), v), device=hidden.device, dtype=torch.float32)
    dz_buf = torch.empty((min(chunk, n), v), device=hidden.device, dtype=hidden.dtype)
    logprob = torch.empty(n, device=hidden.device, dtype=torch.float32)
    entropy = torch.empty_like(logprob)
    grad_h = torch.empty_like(hidden)
    grad_w = torch.zeros_like(weight_shard) if v < weight_shard.shape[0] else torch.empty_like(weight_shard)
    acc_w = torch.zeros((v, h), device=hidden.device, dtype=torch.float32) if chunk < n else None
    has_dual = loss_kw["clip_ratio_c"] is not None
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        h_rows, ws_c, dz = hidden[r0:r1], ws[: r1 - r0], dz_buf[: r1 - r0]
        stats = _chunk_stats(h_rows, weight, targets_local[r0:r1], ws_c, inv_temp, logits)
        if tp_group is not None:
            stats = _gather_merge(stats, tp_group)
        big_m, s, t, zt = stats.unbind(0)
        log_s = torch.log(s)
        torch.sub(zt - big_m, log_s, out=logprob[r0:r1])
        torch.sub(log_s, t / s, out=entropy[r0:r1])
        if v > 0:
            bn, bv = _DZ_TILE
            _dz_kernel[(triton.cdiv(r1 - r0, bn) * triton.cdiv(v, bv),)](
                ws_c, dz, targets_local[r0:r1], big_m.contiguous(), log_s, logprob[r0:r1], old[r0:r1], adv[r0:r1],
                lw[r0:r1], r1 - r0, v, ws_c.stride(0), dz.stride(0), float(loss_kw["eps_low"]),
                float(loss_kw["eps_high"]), float(loss_kw["clip_ratio_c"]) if has_dual else 0.0,
                1.0 / loss_kw["loss_denominator"], inv_temp, HAS_DUAL=has_dual, BLOCK_N=bn, BLOCK_V=bv,
            )  # fmt: skip
        if tp_group is None:
            torch.mm(dz, weight, out=grad_h[r0:r1])
        else:  # each shard holds its vocab rows' share of dL/dhidden: sum them in fp32
            part = mm_fp32(dz, weight) if v > 0 else torch.zeros((r1 - r0, h), device=hidden.device)
            dist.all_reduce(part, group=tp_group)
            grad_h[r0:r1].copy_(part)
        if acc_w is None:
            torch.mm(dz.t(), h_rows, out=grad_w[:v])
        else:
            addmm_fp32_(acc_w, dz.t(), h_rows)
    if acc_w is not None:
        grad_w[:v].copy_(acc_w)
    out = _loss_and_stats(logprob, old, adv, lw, **loss_kw)
    return out, logprob, entropy, grad_h, grad_w


class _LinearDapoLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, targets, old, adv, lw, temperature, tp_group, real_rows, vocab_start, loss_kw, logits
    ):
        out, logprob, entropy, grad_h, grad_w = _one_pass(
            hidden, weight, targets, old, adv, lw, real_rows=real_rows, vocab_start=vocab_start,
            tp_group=tp_group, loss_kw=loss_kw, temperature=temperature, logits=logits,
        )  # fmt: skip
        ctx.save_for_backward(grad_h, grad_w)
        stats = out[1:]
        ctx.mark_non_differentiable(logprob, entropy, stats)
        return out[0], logprob, entropy, stats

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype)
        return grad_h * scale, grad_w * scale, None, None, None, None, None, None, None, None, None, None


def linear_dapo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_weight: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    loss_denominator: float,
    temperature: float = 1.0,
    tp_group=None,
    vocab_size: int | None = None,
    logits: str = "triton",
):
    """(loss, logprob[N], entropy[N], stats): loss = sum(loss_weight * l) / loss_denominator with l the
    per-token DAPO clipped loss (kernels/reference.py policy_loss_terms) of logp = log softmax(hidden @
    weight.T / temperature)[target]; differentiable in hidden and weight only (the gradients were
    computed by the forward). logprob and entropy are detached fp32 metrics; stats are the detached fp32
    POLICY_LOSS_STAT_KEYS weighted by loss_weight (mask, aggregation weight, importance weight: any
    per-token factor; num_tokens = its sum). All per-token inputs are [N]. clip_ratio_c=None disables the
    dual clip. logits: "triton" (tl.dot kernel) or "tma" (operand tiles by TMA, head_loss_tma.py; the tl.dot
    kernel where TMA's 16-byte alignment fails). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; else
    RuntimeError."""
    check_logprob_args(hidden, weight, targets, temperature)
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS}; got {logits!r}")
    if hidden.dtype not in _SUPPORTED:
        raise ValueError(f"linear_dapo_loss supports {_SUPPORTED}; got {hidden.dtype}")
    n = hidden.shape[0]
    for name, x in (("old_logprob", old_logprob), ("advantages", advantages), ("loss_weight", loss_weight)):
        if x.shape != (n,):
            raise ValueError(f"{name} must be per token, [N={n}]; got {tuple(x.shape)}")
    check_policy_loss_args(
        old_logprob, old_logprob, advantages, loss_weight, eps_low, eps_high, clip_ratio_c, loss_denominator
    )
    require_runnable(hidden, weight, targets, old_logprob, advantages, loss_weight, op="linear_dapo_loss")
    vocab_start, vocab_local, vocab_rows = vocab_shard(weight, tp_group)
    vocab_size = check_vocab_size(vocab_size, vocab_rows)
    check_targets_in_vocab(targets, vocab_size)
    if n == 0:
        raise ValueError("linear_dapo_loss needs at least one token (N = 0)")
    real_rows = max(0, min(vocab_local, vocab_size - vocab_start))
    lw = loss_weight.float() if loss_weight.dtype == torch.bool else loss_weight
    loss_kw = dict(
        eps_low=eps_low, eps_high=eps_high, clip_ratio_c=clip_ratio_c, loss_denominator=float(loss_denominator)
    )
    loss, logprob, entropy, stats = _LinearDapoLoss.apply(
        hidden if hidden.stride(-1) == 1 else hidden.contiguous(),
        weight if weight.stride(-1) == 1 else weight.contiguous(),
        targets,
        old_logprob.contiguous(),
        advantages.contiguous(),
        lw.contiguous(),
        float(temperature),
        tp_group,
        real_rows,
        vocab_start,
        loss_kw,
        logits,
    )
    return loss, logprob, entropy, dict(zip(POLICY_LOSS_STAT_KEYS, stats.unbind(0)))

"""The DAPO policy loss on a persistent grid: provider `persistent` beside kernels/policy_loss.py's `fused`.

    from dapo_kernels.policy_loss_persistent import policy_loss_persistent
    loss, stats = policy_loss_persistent(logprob, old_logprob, advantages, mask, eps_low=0.2, eps_high=0.28,
                                         clip_ratio_c=3.0, loss_denominator=global_num_tokens)

Same arguments, values, gradient and stats as `policy_loss` (kernels/policy_loss.py's docstring has the
per-token formula); what differs is the schedule (issue 41 item 4):
- the tokens are cut into TILE-token tiles, the tiles into at most TARGET_GROUPS groups of `group_tiles`
  consecutive tiles (a function of N alone); a grid of P = min(groups, PROGRAMS_PER_SM x SMs) programs
  walks the groups (program p takes groups p, p + P, ...). One program sums a group's tiles in tile order
  and writes the group's 8 partials; the program that arrives last (one acq_rel atomic per PROGRAM, not
  per tile: a few hundred instead of N / 2048) reduces the <= TARGET_GROUPS group partials in group order.
  So the result is bitwise the same run to run AND for any P (tests/kernels/test_policy_loss_persistent.py
  runs P = 1, 2, 3 and the default), and the last program's serial walk is <= 1024 partials, not N / 2048.
- full tiles load without a mask: 16-byte loads (LDG.E.128) whatever N is (today's kernel masks every
  block with `offs < T`, which vectorizes only when the JIT sees N divisible by 16: a packed micro-batch's
  N usually is not, and then every load is 4 bytes); only the last, partial tile is masked.
- host side per call: one launch, two allocations, no reshape/view of the inputs (contiguous tensors are
  passed as they are, bool masks included), no host sync; on a GPU the launch goes straight to the
  compiled kernel's launcher once the first call has compiled it (`_Launcher`: skips JITFunction.run's
  argument binding, which the kernel does not need: its integer arguments are not specialized).
Backward: one multiply by the upstream gradient (as `fused`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from ._runtime import INTERPRET, num_sms, require_runnable
from .policy_loss import _clipped_token_loss, _finish
from .reference import POLICY_LOSS_STAT_KEYS, check_policy_loss_args


@dataclass(frozen=True)
class PersistentConfig:
    """tile: tokens per tile (a power of 2); num_warps: per program; programs_per_sm: the grid is at most this
    many programs per SM (keep it within the resident count, else a second wave runs after the first);
    target_groups: at most this many groups (the last program reduces their partials); reduce_block: the
    last program reads the partials in chunks of this many groups. tile and target_groups fix the summation
    order (with N); num_warps and the tile fix the in-register one; programs_per_sm changes no bit."""

    tile: int = 512
    num_warps: int = 4
    programs_per_sm: int = 4
    target_groups: int = 1024
    reduce_block: int = 256

    @property
    def row(self) -> int:
        """Consecutive tokens per thread, summed in registers (tile / threads; 4 at 512 / 4 warps, so every
        input, the bool mask included, and the gradient share one layout: no shared-memory shuffle)."""
        return max(1, self.tile // (32 * self.num_warps))


# 512 tokens x 4 warps: 4 fp32 per thread (one 16-byte load per input), 72 registers for sm_90, ~7 programs
# resident per SM (kernels/bench/compile_check_loss.py); the interpreter's tiny tiles and 4 groups give the
# tests several tiles per group, several groups and a partial tile on a few hundred tokens
DEFAULT_CONFIG = (
    PersistentConfig(tile=64, num_warps=1, target_groups=4, reduce_block=2) if INTERPRET else PersistentConfig()
)
MAX_TOKENS = 2**31 - 2**16  # int32 offsets, with a tile of slack
_NUM_PARTIALS = 8


@triton.jit
def _combine(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, tl.maximum(a7, b7)


@triton.jit
def _tile(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, grad_ptr, start, N, adv_cols,
    eps_low, eps_high, clip_c, inv_denom,
    HAS_DUAL: tl.constexpr, ADV_PER_ROW: tl.constexpr, MASKED: tl.constexpr, TILE: tl.constexpr,
    ROW: tl.constexpr,
):  # fmt: skip
    """One tile: writes its gradient, returns its 8 sums (one combined reduction: one shared-memory pass)."""
    offs = start + tl.arange(0, TILE)
    if MASKED:
        ok = offs < N
        lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        mk = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.float32)
        adv_offs = offs // adv_cols if ADV_PER_ROW else offs
        adv = tl.load(adv_ptr + adv_offs, mask=ok, other=0.0).to(tl.float32)
    else:  # a full tile: no mask, so the loads vectorize to 16 bytes whatever N is
        lp = tl.load(lp_ptr + offs).to(tl.float32)
        old = tl.load(old_ptr + offs).to(tl.float32)
        mk = tl.load(mask_ptr + offs).to(tl.float32)
        adv = tl.load(adv_ptr + (offs // adv_cols if ADV_PER_ROW else offs)).to(tl.float32)

    loss, grad, d, r, low, high, dual = _clipped_token_loss(
        lp, old, adv, mk, eps_low, eps_high, clip_c, inv_denom, HAS_DUAL, TILE
    )
    if MASKED:
        tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty))
    # each thread's ROW consecutive tokens summed in registers (no shuffle, no barrier): [TILE // ROW] vectors
    return (
        _row_sum(mk * loss, TILE, ROW), _row_sum(mk, TILE, ROW), _row_sum(mk * low, TILE, ROW),
        _row_sum(mk * high, TILE, ROW), _row_sum(mk * dual, TILE, ROW), _row_sum(mk * 0.5 * d * d, TILE, ROW),
        _row_sum(mk * r, TILE, ROW), tl.max(tl.reshape(tl.where(mk != 0.0, r, 0.0), (TILE // ROW, ROW)), axis=1),
    )  # fmt: skip


@triton.jit
def _row_sum(x, TILE: tl.constexpr, ROW: tl.constexpr):
    return tl.sum(tl.reshape(x, (TILE // ROW, ROW)), axis=1)


@triton.jit(do_not_specialize=["N", "adv_cols", "group_tiles", "num_groups"])
def _persistent_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, grad_ptr, part_ptr, counter_ptr, out_ptr,
    N, adv_cols, group_tiles, num_groups,
    eps_low, eps_high, clip_c, inv_denom, loss_denominator,
    HAS_DUAL: tl.constexpr, ADV_PER_ROW: tl.constexpr, TILE: tl.constexpr, ROW: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    full_tiles = N // TILE
    for group in range(pid, num_groups, num_programs):
        first = group * group_tiles
        # per-thread partial sums, in tile order; one cross-thread reduction per group
        s0 = tl.zeros([TILE // ROW], dtype=tl.float32)
        s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
        for tile in range(first, tl.minimum(first + group_tiles, full_tiles)):
            t0, t1, t2, t3, t4, t5, t6, t7 = _tile(
                lp_ptr, old_ptr, adv_ptr, mask_ptr, grad_ptr, tile * TILE, N, adv_cols,
                eps_low, eps_high, clip_c, inv_denom, HAS_DUAL, ADV_PER_ROW, False, TILE, ROW,
            )  # fmt: skip
            s0, s1, s2, s3, s4, s5, s6, s7 = _combine(s0, s1, s2, s3, s4, s5, s6, s7, t0, t1, t2, t3, t4, t5, t6, t7)
        if (group == num_groups - 1) & (full_tiles * TILE < N):  # the partial tile: last of the last group
            t0, t1, t2, t3, t4, t5, t6, t7 = _tile(
                lp_ptr, old_ptr, adv_ptr, mask_ptr, grad_ptr, full_tiles * TILE, N, adv_cols,
                eps_low, eps_high, clip_c, inv_denom, HAS_DUAL, ADV_PER_ROW, True, TILE, ROW,
            )  # fmt: skip
            s0, s1, s2, s3, s4, s5, s6, s7 = _combine(s0, s1, s2, s3, s4, s5, s6, s7, t0, t1, t2, t3, t4, t5, t6, t7)
        s0, s1, s2, s3, s4, s5, s6, s7 = tl.reduce((s0, s1, s2, s3, s4, s5, s6, s7), 0, _combine)
        out = part_ptr + group
        tl.store(out, s0)
        tl.store(out + num_groups, s1)
        tl.store(out + 2 * num_groups, s2)
        tl.store(out + 3 * num_groups, s3)
        tl.store(out + 4 * num_groups, s4)
        tl.store(out + 5 * num_groups, s5)
        tl.store(out + 6 * num_groups, s6)
        tl.store(out + 7 * num_groups, s7)
    # The last program to arrive reduces the group partials in group order and re-arms the counter (as
    # kernels/policy_loss.py's one-pass launch, but one arrival per program instead of one per 2048 tokens).
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == num_programs - 1:
        _finish(part_ptr, out_ptr, out_ptr + 1, num_groups, loss_denominator, REDUCE_BLOCK, True)
        tl.atomic_xchg(counter_ptr, 0)


def schedule(num_tokens: int, config: PersistentConfig) -> tuple[int, int]:
    """(group_tiles, num_groups) for N tokens: a function of N and the config's tile and target_groups only
    (so the summation order, hence every bit of the result, depends on neither the device nor the grid)."""
    num_tiles = triton.cdiv(num_tokens, config.tile)
    group_tiles = max(1, triton.cdiv(num_tiles, config.target_groups))
    return group_tiles, max(1, triton.cdiv(num_tiles, group_tiles))


_COUNTERS: dict = {}  # device -> int32 arrival counter (left at 0 by every launch; one stream per device)


def _counter(device: torch.device) -> torch.Tensor:
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def launch_key(tensors, constexprs: tuple, num_warps: int) -> tuple:
    """What Triton's JIT specializes this kernel on, from the arguments: each tensor's dtype and whether its
    address is 16-byte aligned (the integer arguments are do_not_specialize and < 2**31: always i32; the
    floats always fp32), the constexprs and num_warps. Equal keys -> the same compiled kernel (checked
    against triton's native_specialize_impl in tests/kernels/test_policy_loss_persistent.py)."""
    return (*((t.dtype, t.data_ptr() % 16 == 0) for t in tensors), *constexprs, num_warps)


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook is set. Since triton 3.6 knobs.runtime.launch_enter_hook / _exit_hook are
    HookChain objects, never None (triton/knobs.py: `launch_enter_hook: HookChain[LaunchHook] = HookChain()`),
    so `is not None` was always true and the direct launch never ran (issue 49): a chain is installed when
    its `calls` list is not empty (proton's HookManager adds to it); a plain callable assigned by hand (or an
    older triton's hook slot) counts as installed."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is None:
            continue
        calls = getattr(hook, "calls", None)
        if calls is None or len(calls) > 0:
            return True
    return False


class _Launcher:
    """Launches `_persistent_kernel`. In the interpreter, or with a Triton launch hook installed (a
    profiler), through the JIT every time; on a GPU the first call of each launch_key compiles through
    the JIT, later ones call that compiled kernel's launcher directly (what JITFunction.run ends with,
    less its per-call argument binding, cache-key hashing and global-variable check)."""

    def __init__(self) -> None:
        self.compiled: dict = {}
        self.direct = not INTERPRET

    def goes_direct(self) -> bool:
        """True when a call may skip the JIT: not the interpreter, not switched off (`persistent_jit`), and no
        launch hook installed (the direct call passes none, so a profiler's hook would miss the launch)."""
        return self.direct and not launch_hooks_installed()

    def __call__(self, grid: int, tensors: tuple, scalars: tuple, constexprs: dict, num_warps: int) -> None:
        if not self.goes_direct():
            _persistent_kernel[(grid,)](*tensors, *scalars, **constexprs, num_warps=num_warps)
            return
        device = tensors[0].device
        key = (device.index, launch_key(tensors, tuple(constexprs.values()), num_warps))
        kernel = self.compiled.get(key)
        if kernel is None:  # compile (or load from Triton's cache) and launch through the JIT, once per key
            self.compiled[key] = _persistent_kernel[(grid,)](*tensors, *scalars, **constexprs, num_warps=num_warps)
            return
        stream = torch.cuda.current_stream(device).cuda_stream
        kernel.run(
            grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
            *tensors, *scalars, *constexprs.values(),
        )  # fmt: skip


LAUNCH = _Launcher()


def _advantages_arg(advantages: torch.Tensor, logprob: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(tensor, per_row, cols): per-token advantages as they are, [B, 1] per-sequence ones read in place
    (token i takes row i // cols); other broadcasts expanded (one copy)."""
    if advantages.shape == logprob.shape:
        return advantages.contiguous(), False, 1
    if logprob.dim() == 2 and advantages.shape == (logprob.shape[0], 1):
        return advantages.contiguous(), True, logprob.shape[1]
    return advantages.expand_as(logprob).contiguous(), False, 1


class _PersistentPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, denominator, setup):
        config, programs = setup
        # contiguous tensors go to the kernel as they are (.contiguous() returns them; no flat views)
        logprob, old_logprob, mask = logprob.contiguous(), old_logprob.contiguous(), mask.contiguous()
        adv, per_row, adv_cols = _advantages_arg(advantages, logprob)
        num = logprob.numel()
        group_tiles, num_groups = schedule(num, config)
        grid = min(num_groups, programs or config.programs_per_sm * num_sms(logprob.device))
        grad = torch.empty_like(logprob)
        buf = torch.empty(8 + 8 * num_groups, device=logprob.device, dtype=torch.float32)  # [loss, 7 stats | partials]
        has_dual = clip_ratio_c is not None
        LAUNCH(
            grid,
            (logprob, old_logprob, adv, mask, grad, buf[8:], _counter(logprob.device), buf),
            (num, adv_cols, group_tiles, num_groups, eps_low, eps_high, clip_ratio_c if has_dual else 0.0,
             1.0 / denominator, denominator),
            {"HAS_DUAL": has_dual, "ADV_PER_ROW": per_row, "TILE": config.tile, "ROW": config.row,
             "REDUCE_BLOCK": config.reduce_block},
            config.num_warps,
        )  # fmt: skip
        ctx.save_for_backward(grad)
        stats = buf[1:8]
        ctx.mark_non_differentiable(stats)
        return buf[0], stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None, None, None, None


def policy_loss_persistent(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    loss_denominator: float,
    config: PersistentConfig = DEFAULT_CONFIG,
    programs: int | None = None,
):
    """dapo_kernels.policy_loss's contract (values, gradient, stats, errors) on the persistent grid.
    programs: the grid size (default config.programs_per_sm per SM, at most one per group); any value gives
    the same bits. config: the tile schedule (the benchmark's variants; the default otherwise)."""
    check_policy_loss_args(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator)
    require_runnable(logprob, old_logprob, advantages, mask, op="policy_loss")
    if logprob.numel() > MAX_TOKENS:
        raise ValueError(f"policy_loss: {logprob.numel()} tokens is over the kernel's int32 limit of {MAX_TOKENS}")
    if programs is not None and programs < 1:
        raise ValueError(f"policy_loss: programs={programs} must be >= 1")
    loss, stats = _PersistentPolicyLoss.apply(
        logprob,
        old_logprob,
        advantages,
        mask,
        float(eps_low),
        float(eps_high),
        None if clip_ratio_c is None else float(clip_ratio_c),
        float(loss_denominator),
        (config, programs),
    )
    return loss, dict(zip(POLICY_LOSS_STAT_KEYS, stats.unbind(0)))

"""The persistent-grid policy loss (kernels/policy_loss_persistent.py, provider `persistent`) against float64
(kernels/reference.py) and against today's `fused`: value, gradient and stats under every setting the kernel
takes (dual clip on and off, bool / uint8 / float-weight masks, [B, 1] advantages, empty rows, N of 0, 1, a
tile, a tile +- 1, several groups), poisoned outputs, bitwise reruns and bitwise the same for every grid
size, and the host side of a call (one launch, two allocations, no host read).

In the interpreter the default config is 64-token tiles, at most 4 groups, the last program reading 2
groups per chunk: 606 tokens are 10 tiles in 4 groups of 3 (the last holding the partial tile).

Run: pytest tests/kernels/test_policy_loss_persistent.py -q        (any device: tests/kernels/conftest.py)
"""

from __future__ import annotations

import sys

import pytest
import torch
from kernels_device import DEVICE
from kernels_device import AtenOps as _AtenOps

import dapo_kernels
from dapo_kernels import policy_loss, policy_loss_reference
from dapo_kernels.policy_loss_persistent import DEFAULT_CONFIG, launch_key, policy_loss_persistent, schedule
from dapo_kernels.reference import POLICY_LOSS_STAT_KEYS

KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)


def make_inputs(shape, *, seed, spread=0.6, mask_dtype=torch.bool):
    """Ratios spanning every branch (below 1 - eps_low, inside, above 1 + eps_high, above c), a mask with
    a quarter of the tokens out; drawn on the CPU, then moved (the same numbers on every device)."""
    gen = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(shape, generator=gen) * 3
    old = logprob + torch.randn(shape, generator=gen) * spread
    adv = torch.randn(shape, generator=gen)
    mask = (torch.rand(shape, generator=gen) > 0.25).to(mask_dtype)
    return tuple(t.to(DEVICE) for t in (logprob, old, adv, mask))


def run(fn, logprob, old, adv, mask, **kw):
    logprob = logprob.clone().requires_grad_()
    loss, stats = fn(logprob, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), logprob.grad, stats


def float64(logprob, old, adv, mask, **kw):
    logprob = logprob.double().requires_grad_()
    loss, stats = policy_loss_reference(logprob, old.double(), adv.double(), mask, **kw)
    loss.backward()
    return loss.detach(), logprob.grad, stats


def assert_close_to_float64(got, want, *, grad_tol=1e-7):
    loss, grad, stats = got
    loss64, grad64, stats64 = want
    assert abs(loss.item() - loss64.item()) < 1e-6 * max(1.0, abs(loss64.item()))
    assert grad.shape == grad64.shape and grad.dtype == torch.float32
    if grad.numel():
        assert (grad.double() - grad64).abs().max().item() < grad_tol
    assert list(stats) == list(POLICY_LOSS_STAT_KEYS)
    for key in POLICY_LOSS_STAT_KEYS:
        assert abs(stats[key].item() - stats64[key].item()) < 1e-6 * max(1.0, abs(stats64[key].item())), key


def assert_bitwise_equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in POLICY_LOSS_STAT_KEYS)


@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.float32])
def test_matches_float64_reference(clip_ratio_c, mask_dtype, device):
    inputs = make_inputs((6, 101), seed=1, mask_dtype=mask_dtype)
    kw = dict(KW, clip_ratio_c=clip_ratio_c, loss_denominator=500.0)
    got = run(policy_loss_persistent, *inputs, **kw)
    want = float64(*inputs, **kw)
    assert want[2]["dualclip_frac"].item() > (0.01 if clip_ratio_c else -1.0)  # every branch is hit
    assert want[2]["clipfrac_low"].item() > 0.01 and want[2]["clipfrac_high"].item() > 0.01
    assert_close_to_float64(got, want)


@pytest.mark.parametrize("extra", [-1, 0, 1])
@pytest.mark.parametrize("tiles", [0, 1, 5])
def test_token_counts_around_the_tile(tiles, extra, device):
    """N = 0, 1, a tile +- 1, several tiles +- 1: the unmasked full tiles and the masked partial one."""
    num = max(0, tiles * DEFAULT_CONFIG.tile + extra) or (1 if extra == 1 else 0)
    inputs = make_inputs((num,), seed=10 + num)
    kw = dict(KW, loss_denominator=max(num, 1))
    assert_close_to_float64(run(policy_loss_persistent, *inputs, **kw), float64(*inputs, **kw))


def test_empty_rows_and_per_sequence_advantages(device):
    """[B, T] with two fully masked rows and [B, 1] advantages read in place (token i -> row i // T)."""
    logprob, old, adv, mask = make_inputs((5, 77), seed=3)
    mask[1] = False
    mask[4] = False
    per_seq = adv[:, :1].contiguous()
    kw = dict(KW, loss_denominator=123.0)
    got = run(policy_loss_persistent, logprob, old, per_seq, mask, **kw)
    assert_close_to_float64(got, float64(logprob, old, per_seq, mask, **kw))
    assert not got[1][1].any() and not got[1][4].any()
    expanded = run(policy_loss_persistent, logprob, old, per_seq.expand(5, 77).contiguous(), mask, **kw)
    assert_bitwise_equal(got, expanded)


def test_sequence_mean_weights_match_the_algo_loss(device):
    """The trainer's other aggregations reach the kernel as float weights (1 / the row's token count for
    seq-mean-token-mean) with the global denominator: the same value and gradient as algo.policy_loss."""
    algo = pytest.importorskip("dapo_megatron.algo.policy_loss")
    logprob, old, adv, mask = make_inputs((4, 90), seed=4)
    mask[2] = False
    weights = mask.float() / mask.float().sum(-1, keepdim=True).clamp(min=1.0)
    got = run(policy_loss_persistent, logprob, old, adv, weights, **KW, loss_denominator=3.0)
    lp = logprob.clone().requires_grad_()
    loss_a, _ = algo.policy_loss(lp, old, adv, mask, **KW, agg_mode="seq-mean-token-mean", loss_denominator=3.0)
    loss_a.backward()
    assert abs(got[0].item() - loss_a.item()) < 1e-6
    assert (got[1] - lp.grad).abs().max().item() < 1e-8


def test_nothing_masked_gives_zeros(device):
    logprob, old, adv, _ = make_inputs((3, 40), seed=5)
    nothing = torch.zeros(3, 40, dtype=torch.bool, device=device)
    loss, grad, stats = run(policy_loss_persistent, logprob, old, adv, nothing, **KW, loss_denominator=7)
    assert loss.item() == 0.0 and not grad.any()
    assert all(stats[k].item() == 0.0 for k in POLICY_LOSS_STAT_KEYS)


def test_poisoned_outputs_are_all_overwritten(monkeypatch, device):
    """The gradient and the [loss, stats | partials] buffer come from torch.empty: filled with NaN here,
    so any element the kernel failed to write shows up as NaN (or a wrong value)."""
    mod = sys.modules["dapo_kernels.policy_loss_persistent"]
    real_empty, real_empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(mod.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    monkeypatch.setattr(mod.torch, "empty_like", lambda *a, **kw: real_empty_like(*a, **kw).fill_(float("nan")))
    inputs = make_inputs((606,), seed=6)
    got = run(policy_loss_persistent, *inputs, **KW, loss_denominator=606)
    assert not got[1].isnan().any()
    assert_close_to_float64(got, float64(*inputs, **KW, loss_denominator=606))


def test_bitwise_the_same_for_every_grid_size_and_rerun(device):
    """The design's promise: groups are summed by one program in tile order and reduced in group order,
    so the grid size changes no bit (1 program walks every group; 3 leave one program two groups)."""
    inputs = make_inputs((2500,), seed=7)
    group_tiles, num_groups = schedule(2500, DEFAULT_CONFIG)
    assert num_groups > 3 and group_tiles > 1
    first = run(policy_loss_persistent, *inputs, **KW, loss_denominator=2500)
    for programs in (1, 2, 3, num_groups, None):
        assert_bitwise_equal(
            first, run(policy_loss_persistent, *inputs, **KW, loss_denominator=2500, programs=programs)
        )
    assert_close_to_float64(first, float64(*inputs, **KW, loss_denominator=2500))


def test_same_values_as_fused(device):
    """Against today's kernel: the gradient bitwise (the same per-token arithmetic), loss and stats to
    fp32 summation order."""
    inputs = make_inputs((8, 333), seed=8)
    new = run(policy_loss_persistent, *inputs, **KW, loss_denominator=2000.0)
    old = run(policy_loss, *inputs, **KW, loss_denominator=2000.0)
    assert torch.equal(new[1], old[1])
    assert abs(new[0].item() - old[0].item()) < 1e-6
    for key in POLICY_LOSS_STAT_KEYS:
        assert abs(new[2][key].item() - old[2][key].item()) < 1e-6 * max(1.0, abs(old[2][key].item())), key


def test_one_launch_no_sync_two_allocations(monkeypatch, device):
    """The host side of a call: the launch replaced by a recorder (the interpreter's own argument copies
    would hide the wrapper's): one launch with the schedule's grid, no .item() (aten._local_scalar_dense),
    no reshape, view or copy of contiguous inputs, exactly two allocations (gradient; loss + stats +
    partials); the backward is one multiply. Then the real call leaves the arrival counter at 0."""
    mod = sys.modules["dapo_kernels.policy_loss_persistent"]
    logprob, old, adv, mask = make_inputs((4, 300), seed=9)
    per_seq = adv[:, :1].contiguous()
    launches = []
    monkeypatch.setattr(mod, "LAUNCH", lambda grid, tensors, scalars, constexprs, warps: launches.append(grid))
    lp = logprob.clone().requires_grad_()
    with _AtenOps() as forward_ops:
        loss, _ = policy_loss_persistent(lp, old, per_seq, mask, **KW, loss_denominator=1000.0, programs=3)
    assert launches == [3]
    assert "_local_scalar_dense" not in forward_ops.ops
    allocations = [op for op in forward_ops.ops if op.startswith(("empty", "zeros", "clone", "copy", "_to_copy"))]
    assert allocations == ["empty_like", "empty"], forward_ops.ops
    assert not [op for op in forward_ops.ops if op.startswith(("view", "reshape", "expand", "_reshape"))]
    with _AtenOps() as backward_ops:
        loss.backward()
    assert "_local_scalar_dense" not in backward_ops.ops and backward_ops.ops.count("mul") == 1
    monkeypatch.undo()
    policy_loss_persistent(logprob, old, per_seq, mask, **KW, loss_denominator=1000.0)
    assert mod._COUNTERS[logprob.device].item() == 0


def test_launch_key_is_what_triton_specializes(device):
    """The GPU launcher reuses a compiled kernel for equal launch_keys: the key must tell apart whatever
    Triton's JIT would compile separately. Triton's own per-argument specialization (native_specialize_impl,
    the function its binder calls) for aligned / misaligned fp32, bool and uint8 tensors against the key."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    base = torch.zeros(64, device=device)
    tensors = [base, base[1:], base[4:], torch.zeros(64, dtype=torch.bool, device=device)[3:]]
    tensors.append(torch.zeros(64, dtype=torch.uint8, device=device))
    for tensor in tensors:
        triton_type, triton_align = native_specialize_impl(BaseBackend, tensor, False, True, True)
        key_dtype, key_aligned = launch_key([tensor], (), 4)[0]
        assert (triton_align == "D") == key_aligned, tensor.data_ptr()
        assert triton_type == {torch.float32: "*fp32", torch.bool: "*u1", torch.uint8: "*u8"}[key_dtype]
    # integers the kernel does not specialize on: i32 whatever the value (1, a multiple of 16, odd)
    assert {native_specialize_impl(BaseBackend, v, False, False, True)[0] for v in (1, 16, 2**31 - 1, 7)} == {"i32"}
    assert launch_key([base[1:]], (True,), 4) != launch_key([base], (True,), 4)


def test_bad_inputs_raise_value_error(device):
    logprob, old, adv, mask = make_inputs((10,), seed=11)
    with pytest.raises(ValueError, match="advantages .* must have the shape"):
        policy_loss_persistent(logprob, old, adv[:5], mask, **KW, loss_denominator=1)
    with pytest.raises(ValueError, match="loss_denominator"):
        policy_loss_persistent(logprob, old, adv, mask, **KW, loss_denominator=0)
    with pytest.raises(ValueError, match="programs=0"):
        policy_loss_persistent(logprob, old, adv, mask, **KW, loss_denominator=1, programs=0)
    assert (DEVICE == "cpu") == dapo_kernels.INTERPRET


@pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="the CPU dry run (on a GPU, run_all.sh runs the real one)")
def test_variants_script_dry_run_writes_every_row(tmp_path):
    """kernels/bench/variants_policy_loss.py's code (not its timings) in the interpreter: the copy row, and
    for each candidate asked host_us, ms, GB/s and % of copy in both modes, in the benchmark CSV's schema."""
    import csv

    from dapo_kernels.bench import variants_policy_loss
    from dapo_kernels.bench.common import CSV_FIELDS

    path = tmp_path / "kernels.csv"
    names = "fused,persistent,persistent_jit"
    assert variants_policy_loss.main(["--dry-run", "--loss-candidates", names, "--csv", str(path)]) == 0
    with path.open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        rows = list(reader)
    assert [r["provider"] for r in rows if r["metric"] == "bandwidth" and r["mode"] == "copy"] == ["device_copy"]
    for name in names.split(","):
        metrics = {(r["mode"], r["metric"]) for r in rows if r["provider"] == name and r["x"] == "T=700"}
        assert metrics == {("fwd", "host_us")} | {
            (m, k) for m in ("fwd", "fwd_bwd") for k in ("ms", "bandwidth", "pct_of_copy")
        }
    with pytest.raises(SystemExit):
        variants_policy_loss.main(["--dry-run", "--loss-candidates", "fused,nope"])


@pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="the CPU dry run (on a GPU, run_all.sh runs the real one)")
def test_variants_script_keeps_the_other_candidates_when_one_raises(tmp_path, monkeypatch):
    """Issue 49: a candidate with a bug (the direct launcher now really runs on a GPU, for the first time)
    gets "error" rows and its traceback; the candidates after it are still timed; the script exits 1."""
    import csv

    from dapo_kernels.bench import variants_policy_loss

    def broken(*args, **kwargs):
        raise RuntimeError("a launcher that does not match this triton")

    monkeypatch.setitem(variants_policy_loss.CANDIDATES, "persistent", (broken, "broken"))
    path = tmp_path / "kernels.csv"
    assert variants_policy_loss.main(["--dry-run", "--loss-candidates", "persistent,fused", "--csv", str(path)]) == 1
    rows = list(csv.DictReader(path.open()))
    assert [(r["mode"], r["metric"], r["p50"]) for r in rows if r["provider"] == "persistent"] == [
        ("fwd", "ms", "error")
    ]
    fused = {(r["mode"], r["metric"]) for r in rows if r["provider"] == "fused"}
    assert ("fwd_bwd", "pct_of_copy") in fused and ("fwd", "host_us") in fused


def test_direct_launch_unless_a_launch_hook_is_installed(monkeypatch):
    """Issue 49: on triton >= 3.6 the hook slots are HookChain objects, never None, so the old test
    (`launch_enter_hook is not None`) sent every call through the JIT and `persistent` timed the same code
    as `persistent_jit`. An empty chain is no hook; a chain with a hook, or a plain callable, is one."""
    from triton import knobs

    from dapo_kernels.policy_loss_persistent import _Launcher, launch_hooks_installed

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    assert enter is not None and leave is not None  # why `is not None` could not tell
    launcher = _Launcher()
    launcher.direct = True  # as on a GPU (the interpreter sets False)
    assert not launch_hooks_installed() and launcher.goes_direct()

    def hook(metadata):
        return None

    enter.add(hook)
    try:
        assert launch_hooks_installed() and not launcher.goes_direct()
    finally:
        enter.remove(hook)
    assert launcher.goes_direct()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)  # a hook assigned by hand
    assert launch_hooks_installed() and not launcher.goes_direct()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)  # an older triton's empty slot
    assert not launch_hooks_installed()
    launcher.direct = False  # persistent_jit (kernels/bench/variants_policy_loss.py)
    assert not launcher.goes_direct()

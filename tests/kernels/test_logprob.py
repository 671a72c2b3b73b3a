"""Fused linear log-prob + entropy (Triton, interpreter on CPU) against a float64 oracle.

Run: /work/venv/bin/pytest tests/kernels/test_logprob.py -q
Forward AND gradients (hidden, weight; through logprob and entropy) on odd shapes: V not a multiple
of the 64-wide vocab tile, N = 1, +-1e4 logit offsets (all-negative logits), temperature != 1,
fp32/fp16/bf16 inputs, several backward chunks; vocab-parallel TP=2 on two gloo ranks equals TP=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dapo_kernels
import dapo_kernels._runtime as runtime
import dapo_kernels.logprob as logprob_mod
from dapo_kernels import linear_logprob_entropy, linear_logprob_entropy_reference

pytestmark = pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="CPU kernel tests run in the Triton interpreter")


def make_inputs(n, h, v, *, dtype, seed, offset=0.0, scale=0.3):
    """hidden, weight, targets, and upstream grads for logprob and entropy.

    offset shifts EVERY logit by the same amount: column 0 of hidden is 100 and of weight offset/100,
    so z_j = offset + (random part); the log-softmax is unchanged, fp32 has to cope with it."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * scale
    if offset:
        hidden[:, 0] = 100.0
        weight[:, 0] = offset / 100.0
    targets = torch.randint(0, v, (n,), generator=gen)
    g_lp = torch.randn(n, generator=gen)
    g_ent = torch.randn(n, generator=gen)
    return hidden.to(dtype), weight.to(dtype), targets, g_lp, g_ent


def run_fused(hidden, weight, targets, g_lp, g_ent, *, temperature=1.0, return_entropy=True):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    lp, ent = linear_logprob_entropy(hidden, weight, targets, temperature=temperature, return_entropy=return_entropy)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if return_entropy else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), hidden.grad, weight.grad


def run_oracle(hidden, weight, targets, g_lp, g_ent, *, temperature=1.0, return_entropy=True):
    """float64 on the same (upcast) inputs: the exact answer the fp32 accumulation approximates."""
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    lp, ent = linear_logprob_entropy_reference(hidden, weight, targets, temperature=temperature)
    loss = (lp * g_lp.double()).sum() + ((ent * g_ent.double()).sum() if return_entropy else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def grad_tol(dtype):
    # The fused backward rounds dL/dlogits and the returned grads to the input dtype: one or two
    # roundings of relative size eps (fp16 2^-10, bf16 2^-7). fp32 sums ~V*N products in fp32: 1e-5.
    return max(2 * torch.finfo(dtype).eps, 1e-5)


CASES = {
    # name: (n, h, v, dtype, temperature, backward workspace in rows (None = one chunk))
    "fp32_odd_V_T0.7_chunked": (37, 48, 301, torch.float32, 0.7, 16),
    "fp32_N1": (1, 40, 130, torch.float32, 1.0, None),
    "fp16_T1.3": (29, 32, 200, torch.float16, 1.3, 16),
    "bf16_fp32cast": (33, 64, 257, torch.bfloat16, 1.0, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_float64(name, monkeypatch):
    n, h, v, dtype, temperature, chunk_rows = CASES[name]
    if chunk_rows is not None:  # force several backward chunks (fp32 grad_weight accumulation path)
        itemsize = torch.tensor([], dtype=dtype).element_size()
        monkeypatch.setattr(logprob_mod, "BACKWARD_WORKSPACE_BYTES", chunk_rows * v * itemsize)
    inputs = make_inputs(n, h, v, dtype=dtype, seed=hash(name) % 1000)
    lp, ent, gh, gw = run_fused(*inputs, temperature=temperature)
    lp64, ent64, gh64, gw64 = run_oracle(*inputs, temperature=temperature)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (n,)
    assert gh.dtype == dtype and gw.dtype == dtype
    # Forward: the matmul accumulates exactly-representable products in fp32 (H <= 64 terms).
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert (ent.double() - ent64).abs().max().item() < 2e-5
    assert (lp <= 0).all() and (ent >= 0).all()
    assert rel_err(gh, gh64) < grad_tol(dtype)
    assert rel_err(gw, gw64) < grad_tol(dtype)


@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_logit_offsets(offset):
    """Every logit shifted by +-1e4 (at -1e4 all logits are negative). fp32 spacing at 1e4 is 2^-10,
    so the logits themselves carry ~1e-3 absolute error; allow 4 spacings, nothing more."""
    n, h, v = 24, 32, 190
    inputs = make_inputs(n, h, v, dtype=torch.float32, seed=7, offset=offset)
    lp, ent, gh, gw = run_fused(*inputs, temperature=0.9)
    lp64, ent64, gh64, gw64 = run_oracle(*inputs, temperature=0.9)
    spacing = 2.0**-10
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp <= 0).all()
    assert (lp.double() - lp64).abs().max().item() < 4 * spacing
    assert (ent.double() - ent64).abs().max().item() < 4 * spacing
    assert rel_err(gh, gh64) < 4 * spacing
    assert rel_err(gw, gw64) < 4 * spacing


def test_without_entropy_grads_flow_from_logprob_only():
    inputs = make_inputs(19, 32, 150, dtype=torch.float32, seed=3)
    lp, ent, gh, gw = run_fused(*inputs, return_entropy=False)
    lp64, _, gh64, gw64 = run_oracle(*inputs, return_entropy=False)
    assert ent is None
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert rel_err(gh, gh64) < 1e-5 and rel_err(gw, gw64) < 1e-5


def test_empty_batch_gives_empty_outputs_and_zero_grads():
    hidden = torch.zeros(0, 16, requires_grad=True)
    weight = torch.randn(70, 16, requires_grad=True)
    lp, ent = linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_bit_identical_reruns(monkeypatch):
    monkeypatch.setattr(logprob_mod, "BACKWARD_WORKSPACE_BYTES", 16 * 170 * 2)
    inputs = make_inputs(40, 32, 170, dtype=torch.float16, seed=11)
    first = run_fused(*inputs, temperature=0.8)
    second = run_fused(*inputs, temperature=0.8)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_inputs_raise_value_error():
    hidden, weight, targets, _, _ = make_inputs(4, 16, 70, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        linear_logprob_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 70\)"):
        linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 70, 2]))
    with pytest.raises(ValueError, match="same dtype"):
        linear_logprob_entropy(hidden, weight.half(), targets)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(hidden, weight, targets, temperature=0.0)


def test_without_cuda_or_interpreter_the_fused_op_refuses(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="linear_logprob_entropy_reference|_reference"):
        runtime.require_runnable(torch.zeros(2), op="linear_logprob_entropy")


# ---- vocab-parallel: TP=2 on two gloo ranks equals TP=1 -------------------------------------------

TP_N, TP_H, TP_V = 21, 32, 2 * 75  # V_local = 75: not a multiple of the 64-wide tile


def _tp_inputs():
    hidden, weight, targets, g_lp, g_ent = make_inputs(TP_N, TP_H, TP_V, dtype=torch.float32, seed=5)
    v_local = TP_V // 2
    # targets on both sides of the shard boundary and at the ends of the vocab
    targets[:6] = torch.tensor([0, v_local - 1, v_local, v_local + 1, TP_V - 1, v_local - 2])
    return hidden, weight, targets, g_lp, g_ent


def _tp_rank(impl: str):
    """On each rank: its vocab shard of the weight, fused or reference op with tp_group=WORLD."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, weight, targets, g_lp, g_ent = _tp_inputs()
    v_local = TP_V // world
    shard = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    hidden = hidden.clone().requires_grad_()
    fn = linear_logprob_entropy if impl == "fused" else linear_logprob_entropy_reference
    lp, ent = fn(hidden, shard, targets, temperature=0.8, tp_group=dist.group.WORLD)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), hidden.grad, shard.grad


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_vocab_parallel_tp2_equals_tp1(impl, rank_pool):
    results = rank_pool(2).run(_tp_rank, impl)
    lp1, ent1, gh1, gw1 = run_fused(*_tp_inputs(), temperature=0.8)
    lp64, ent64, gh64, gw64 = run_oracle(*_tp_inputs(), temperature=0.8)
    assert (lp1.double() - lp64).abs().max().item() < 2e-5
    for rank, (lp, ent, gh, gw_shard) in enumerate(results):
        # fp32 on both sides, merged in a different order: agreement to a few fp32 roundings
        assert (lp - lp1).abs().max().item() < 2e-6
        assert (ent - ent1).abs().max().item() < 2e-6
        assert rel_err(gh, gh1.double()) < 1e-6  # all-reduced: the full hidden gradient on each rank
        rows = slice(rank * TP_V // 2, (rank + 1) * TP_V // 2)
        assert rel_err(gw_shard, gw1[rows].double()) < 1e-6  # the weight gradient stays local
        assert rel_err(gw_shard, gw64[rows]) < 1e-5

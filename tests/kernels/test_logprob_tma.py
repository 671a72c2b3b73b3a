"""The persistent TMA-fed kernels of linear_logprob_entropy (logits="tma", kernels/logprob_persistent.py)
at the kernel level, against float64. test_logprob.py runs the whole op with logits="tma" through its
cases (fp32/fp16/bf16, N = 1, padded vocabularies, +-1e4 offsets, TP=2 through gloo); this file checks
what only this design can get wrong: a work item of the persistent loop never visited (outputs
pre-filled with NaN), the two epilogues (whole tile, two halves), the program count (must not change a
bit), targets at the vocabulary's edges, the fallback where TMA's alignment rules fail, and fresh
random inputs on every run (the seed is in the failure message).

bf16: the interpreter's tl.dot multiplies bf16 bit patterns, so the kernels cast bf16 tiles to fp32
there (_runtime.cast_dot_inputs_to_fp32), as the tl.dot kernels do; compiled, bf16 goes to wgmma.
"""

from __future__ import annotations

import random

import pytest
import torch
from logprob_cases import grad_tol, make_inputs, rel_err, run_fused, run_oracle

import dapo_kernels.logprob as logprob_mod
import dapo_kernels.logprob_persistent as persistent
from dapo_kernels import linear_logprob_entropy

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _oracle_stats(hidden, weight, targets, inv_temp):
    """float64 (max, log sum exp(z - max), E_p[z - max], z_target, logits) of z = hidden @ weight.T * inv_temp."""
    z = (hidden.double() @ weight.double().T) * inv_temp
    big_m = z.max(dim=1).values
    zc = z - big_m[:, None]
    p = torch.softmax(z, dim=1)
    return big_m, torch.logsumexp(zc, dim=1), (p * zc).sum(1), z.gather(1, targets[:, None])[:, 0], z


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


@pytest.mark.parametrize("split", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_stats_fill_every_entry_of_a_poisoned_buffer(dtype, split, monkeypatch, device):
    """Stats buffer pre-filled with NaN; 45 rows = 3 row blocks (the last partial) x 2 vocab splits of
    Vs 64-column tiles over V = 301 (a partial last tile): 6 work items on 3 programs. Merged, the
    statistics equal float64's; targets at 0 and V - 1."""
    key = "TILES_FP32" if dtype == "fp32" else "TILES"
    monkeypatch.setattr(persistent, key, {**getattr(persistent, key), "SPLIT_EPILOGUE": split})
    n, h, v, seed = 45, 32, 301, _fresh_seed()
    hidden, weight, targets, _, _ = make_inputs(n, h, v, dtype=DTYPES[dtype], seed=seed, device=device)
    targets[:2] = torch.tensor([0, v - 1])
    out = torch.full((persistent.num_splits(v, DTYPES[dtype]), 4, n), float("nan"), device=device)
    stats = logprob_mod.merge_stats(persistent.forward_split_stats(hidden, weight, targets, 1 / 0.7, out=out))
    assert torch.isfinite(out).all(), f"seed {seed}: unwritten stats"
    big_m, log_s, mean_c, z_t, _ = _oracle_stats(hidden.cpu(), weight.cpu(), targets.cpu(), 1 / 0.7)
    m, s, t, zt = (x.cpu().double() for x in stats)
    for got, want, name in ((m, big_m, "max"), (s.log(), log_s, "log s"), (t / s, mean_c, "E[z-m]"), (zt, z_t, "z_t")):
        assert (got - want).abs().max().item() < 2e-5, f"seed {seed}: {name}"


@pytest.mark.parametrize("has_ent", [True, False])
@pytest.mark.parametrize("split", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dlogits_fill_every_entry_of_a_poisoned_block(dtype, split, has_ent, monkeypatch, device):
    """dL/dlogits of a [40, 150] block (columns from col0 = 60 of the shard: targets are shard ids)
    into a NaN-filled buffer with a row stride of 157 elements (not 16-byte aligned: the store is
    a masked one), against float64 from the exact statistics."""
    key = "TILES_FP32" if dtype == "fp32" else "TILES"
    monkeypatch.setattr(persistent, key, {**getattr(persistent, key), "SPLIT_EPILOGUE": split})
    n, h, v, col0, seed = 40, 32, 210, 60, _fresh_seed()
    hidden, weight, targets, g_lp, g_ent = make_inputs(n, h, v, dtype=DTYPES[dtype], seed=seed, device=device)
    targets[:3] = torch.tensor([col0, v - 1, col0 - 1])  # first column of the block, last, just before it
    inv_temp = 1 / 1.3
    big_m, log_s, mean_c, _, z = _oracle_stats(hidden.cpu(), weight.cpu(), targets.cpu(), inv_temp)
    buf = torch.full((n, 157), float("nan"), dtype=DTYPES[dtype], device=device)
    dz = buf[:, : v - col0]
    per_row = [x.float().to(device) for x in (big_m, log_s, mean_c)]
    persistent.dlogits_into(
        dz, hidden, weight[col0:], targets, *per_row, g_lp, g_ent, has_ent=has_ent, inv_temp=inv_temp, col0=col0
    )
    p = torch.exp(z - big_m[:, None] - log_s[:, None])[:, col0:]
    onehot = torch.nn.functional.one_hot(targets.cpu(), v)[:, col0:].double()
    want = g_lp.double().cpu()[:, None] * (onehot - p)
    if has_ent:
        want += g_ent.double().cpu()[:, None] * p * (mean_c[:, None] - (z - big_m[:, None])[:, col0:])
    want *= inv_temp
    got = dz.cpu().double()
    assert torch.isfinite(got).all(), f"seed {seed}: unwritten dL/dlogits"
    assert buf[:, v - col0 :].isnan().all(), "wrote past the block's columns"
    eps = torch.finfo(DTYPES[dtype]).eps if dtype != "fp32" else 1e-6
    assert (got - want).abs().max().item() <= 2 * eps * want.abs().max().item() + 1e-7, f"seed {seed}"


def test_program_count_changes_no_bit(monkeypatch, device):
    """Each work item is computed whole by one program, so 1, 2 or 5 persistent programs give
    bit-identical log-probs, entropies and gradients."""
    inputs = make_inputs(37, 32, 150, dtype=torch.float16, seed=4, device=device)
    results = []
    for programs in (1, 2, 5):
        monkeypatch.setattr(persistent, "INTERPRET_PROGRAMS", programs)
        monkeypatch.setattr(persistent, "PROGRAMS_PER_SM", programs)
        results.append(run_fused(*inputs, temperature=0.9, logits="tma"))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_tma_path_is_taken_and_misaligned_rows_fall_back(monkeypatch, device):
    """H = 32 fp16 (64-byte rows): the persistent kernels run, forward and backward. H = 30 fp16 (60-byte
    rows, not 16-byte aligned): the tl.dot kernels run instead, with the same answer."""
    calls = {"fwd": 0, "dlogits": 0}
    for name, key in (("forward_split_stats", "fwd"), ("dlogits_into", "dlogits")):
        real = getattr(persistent, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(persistent, name, counted)
    for h, expect in ((32, 1), (30, 0)):
        calls.update(fwd=0, dlogits=0)
        seed = _fresh_seed()
        inputs = make_inputs(21, h, 130, dtype=torch.float16, seed=seed, device=device)
        lp, ent, gh, gw = run_fused(*inputs, logits="tma")
        lp64, ent64, gh64, gw64 = run_oracle(*inputs)
        assert calls["fwd"] == expect and min(calls["dlogits"], 1) == expect  # one call per dL/dlogits block
        assert (lp.double().cpu() - lp64.cpu()).abs().max().item() < 2e-5, f"seed {seed}"
        assert (ent.double().cpu() - ent64.cpu()).abs().max().item() < 2e-5, f"seed {seed}"
        tol = grad_tol(torch.float16)
        assert rel_err(gh.cpu(), gh64.cpu()) < tol and rel_err(gw.cpu(), gw64.cpu()) < tol, f"seed {seed}"


def test_bad_stats_buffer_is_refused(device):
    hidden, weight, targets, _, _ = make_inputs(5, 16, 70, dtype=torch.float32, seed=0, device=device)
    with pytest.raises(ValueError, match=r"out must be a contiguous fp32 \[\d+, 4, 5\] tensor"):
        persistent.forward_split_stats(hidden, weight, targets, 1.0, out=torch.empty(1, 4, 4, device=device))
    assert linear_logprob_entropy(hidden, weight, targets, logits="tma")[0].shape == (5,)

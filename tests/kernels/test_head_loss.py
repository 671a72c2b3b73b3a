"""The LM head and the DAPO loss in one pass (kernels/head_loss.py; Triton: interpreted on CPU, compiled
on a GPU) against the float64 oracle: today's reference log-prob + reference loss with autograd through
both. Forward (loss, log-prob, entropy, stats) AND the gradients the forward computed, on odd shapes
(V not a multiple of the vocab tile, N = 1, several row chunks, +-1e4 logit offsets: all logits negative
at -1e4, temperature != 1, fp32/fp16/bf16), with masked and fractionally weighted tokens and ratios
crafted to land in every branch (below 1 - eps_low, inside, above 1 + eps_high, beyond the dual clip
with a negative advantage); vocab-parallel TP=2 (gloo, with vocab padding) equals TP=1. The tests that
take the `logits` fixture run for both builds of the forward's logits kernel (head_loss.LOGITS: the tl.dot
kernel and the TMA-fed one, head_loss_tma.py) and check which of them ran.

Run: pytest tests/kernels/test_head_loss.py -q        (any device: see tests/kernels/conftest.py)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from kernels_device import DEVICE
from logprob_cases import grad_tol, rel_err
from logprob_cases import make_inputs as make_head_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dapo_kernels.head_loss as head_loss_mod
import dapo_kernels.head_loss_tma as head_loss_tma
from dapo_kernels import linear_logprob_entropy_reference, policy_loss_reference
from dapo_kernels.head_loss import linear_dapo_loss
from dapo_kernels.reference import POLICY_LOSS_STAT_KEYS, policy_loss_terms

KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
# Target ratios, each far (>= 5 %) from the bounds 0.8 / 1.28 / 3.0, so fp32 and float64 take the same
# branch; with advantages of both signs every branch of the clipped loss is hit.
RATIOS = (0.3, 0.7, 0.95, 1.1, 1.5, 2.5, 5.0)


@pytest.fixture(params=head_loss_mod.LOGITS)
def logits(request, monkeypatch):
    """The forward's logits kernel, both builds; fails at teardown unless the TMA kernel ran exactly when
    logits="tma" (a silent fallback to the tl.dot kernel would pass the oracle checks twice)."""
    calls = []
    real = head_loss_tma.logits_stats
    monkeypatch.setattr(head_loss_tma, "logits_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    yield request.param
    assert bool(calls) == (request.param == "tma"), f"logits={request.param!r}: TMA kernel launches {len(calls)}"


def make_inputs(n, h, v, *, dtype, seed, temperature, offset=0.0, vocab_size=None, device=DEVICE):
    """hidden, weight, targets (logprob_cases.make_inputs), then old log-probs set so that the ratio
    exp(logp - old) takes the RATIOS in turn (logp from the float64 oracle), advantages alternating in
    sign (+-[0.5, 1.5)), and loss weights: 0 (masked) for every 5th token, else in [0.5, 1.5) (an
    aggregation / importance weight)."""
    hidden, weight, targets, _, _ = make_head_inputs(
        n, h, v, dtype=dtype, seed=seed, offset=offset, vocab_size=vocab_size, device="cpu"
    )
    real = vocab_size or v
    lp64, _ = linear_logprob_entropy_reference(
        hidden.double(), weight[:real].double(), targets, temperature=temperature
    )
    gen = torch.Generator().manual_seed(seed + 1)
    ratio = torch.tensor([RATIOS[i % len(RATIOS)] for i in range(n)], dtype=torch.float64)
    old = (lp64 - ratio.log()).float()
    sign = torch.tensor([(-1.0) ** (i // len(RATIOS)) for i in range(n)])
    adv = sign * (0.5 + torch.rand(n, generator=gen))
    lw = torch.where(torch.arange(n) % 5 == 4, 0.0, 0.5 + torch.rand(n, generator=gen))
    return tuple(t.to(device) for t in (hidden, weight, targets, old, adv, lw))


def run_fused(hidden, weight, targets, old, adv, lw, **kw):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss, lp, ent, stats = linear_dapo_loss(hidden, weight, targets, old, adv, lw, **kw)
    loss.backward()
    return loss.detach(), lp, ent, stats, hidden.grad, weight.grad


def run_oracle(hidden, weight, targets, old, adv, lw, *, temperature, **kw):
    """float64 on the same (upcast) inputs: reference log-prob, then reference loss, autograd through both."""
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    lp, ent = linear_logprob_entropy_reference(hidden, weight, targets, temperature=temperature)
    loss, stats = policy_loss_reference(lp, old.double(), adv.double(), lw.double(), **kw)
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), stats, hidden.grad, weight.grad


def loss_scale(lp64, old, adv, lw, *, loss_denominator, eps_low, eps_high, clip_ratio_c, **_):
    """sum(w |l|) / D in float64: the loss is a sum of terms of both signs (it can cancel to far below
    its terms), each carrying the relative error of its ratio, so its error is bounded relative to this."""
    terms, _, _ = policy_loss_terms(
        lp64, old.double(), adv.double(), eps_low=eps_low, eps_high=eps_high, clip_ratio_c=clip_ratio_c
    )
    return (lw.double() * terms.abs()).sum().item() / loss_denominator


def force_chunks(monkeypatch, *, rows, v, dtype):
    """Row chunks of `rows` rows (on the GPU too, whose chunks are otherwise multiples of 128 rows)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    monkeypatch.setattr(head_loss_mod, "CHUNK_ROW_ALIGN", 16)
    monkeypatch.setattr(head_loss_mod, "WORKSPACE_BYTES", rows * v * (4 + itemsize))


CASES = {
    # name: (n, h, v, dtype, temperature, rows per chunk (None = one chunk), clip_ratio_c)
    "fp32_odd_V_T0.7_chunked": (37, 48, 301, torch.float32, 0.7, 16, 3.0),
    "fp32_N1": (1, 40, 130, torch.float32, 1.0, None, 3.0),
    "fp32_no_dual_clip": (24, 32, 190, torch.float32, 1.0, None, None),
    "fp16_T1.3_chunked": (29, 32, 200, torch.float16, 1.3, 16, 3.0),
    "bf16": (33, 64, 257, torch.bfloat16, 0.9, None, 3.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_float64(name, logits, monkeypatch, device):
    n, h, v, dtype, temperature, rows, clip_c = CASES[name]
    if rows is not None:
        force_chunks(monkeypatch, rows=rows, v=v, dtype=dtype)
        assert head_loss_mod.chunk_rows(n, v, torch.tensor([], dtype=dtype).element_size()) == rows < n
    inputs = make_inputs(n, h, v, dtype=dtype, seed=sum(map(ord, name)), temperature=temperature)
    kw = dict(KW, clip_ratio_c=clip_c, loss_denominator=float(n + 3), temperature=temperature)
    loss, lp, ent, stats, gh, gw = run_fused(*inputs, **kw, logits=logits)
    loss64, lp64, ent64, stats64, gh64, gw64 = run_oracle(*inputs, **kw)
    if n > 1:  # the crafted ratios reach every branch
        assert stats64["clipfrac_low"] > 0.05 and stats64["clipfrac_high"] > 0.05
        assert stats64["dualclip_frac"] > (0.05 if clip_c else -1.0)
    assert lp.dtype == ent.dtype == loss.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    assert gh.dtype == dtype and gw.dtype == dtype
    assert not (lp.requires_grad or ent.requires_grad or stats["ratio_mean"].requires_grad)
    # Forward: the logits accumulate <= 64 products in fp32 (as in test_logprob.py): log-prob and entropy
    # within 2e-5. The loss and the ratio statistics move with exp(logp - old): relative 2e-5 as well.
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert (ent.double() - ent64).abs().max().item() < 2e-5
    assert abs(loss.item() - loss64.item()) < 2e-5 * loss_scale(lp64, *inputs[3:], **kw)
    assert list(stats) == list(POLICY_LOSS_STAT_KEYS)
    for key in POLICY_LOSS_STAT_KEYS:  # counts and weight sums: fp32 sums of < 40 terms, same branches
        assert abs(stats[key].item() - stats64[key].item()) < 2e-5 * max(1.0, abs(stats64[key].item())), key
    # Gradients: dlogits and the results are rounded to the input dtype (fp16/bf16: two roundings of
    # relative size eps); fp32 sums ~V*N products: 1e-5 (test_logprob.py's grad_tol).
    assert rel_err(gh, gh64) < grad_tol(dtype)
    assert rel_err(gw, gw64) < grad_tol(dtype)


@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_logit_offsets(offset, logits, monkeypatch, device):
    """Every logit shifted by +-1e4 (all negative at -1e4), 2 row chunks. fp32 spacing at 1e4 is 2^-10
    and z / T rounds each logit by up to half a spacing (test_logprob.py): log-prob and entropy within 4
    spacings; the ratio exp(logp - old), hence the loss and every gradient, within 4 spacings relative."""
    n, h, v = 24, 32, 190
    force_chunks(monkeypatch, rows=16, v=v, dtype=torch.float32)
    inputs = make_inputs(n, h, v, dtype=torch.float32, seed=7, temperature=0.9, offset=offset)
    kw = dict(KW, loss_denominator=30.0, temperature=0.9)
    loss, lp, ent, stats, gh, gw = run_fused(*inputs, **kw, logits=logits)
    loss64, lp64, ent64, stats64, gh64, gw64 = run_oracle(*inputs, **kw)
    spacing = 2.0**-10
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and (lp <= 0).all()
    assert (lp.double() - lp64).abs().max().item() < 4 * spacing
    assert (ent.double() - ent64).abs().max().item() < 4 * spacing
    assert abs(loss.item() - loss64.item()) < 4 * spacing * loss_scale(lp64, *inputs[3:], **kw)
    assert rel_err(gh, gh64) < 4 * spacing
    assert rel_err(gw, gw64) < 4 * spacing
    for key in ("clipfrac_low", "clipfrac_high", "dualclip_frac", "num_tokens"):
        assert stats[key].item() == pytest.approx(stats64[key].item(), abs=1e-6), key


def test_backward_scales_the_stored_gradients(logits, device):
    """The backward only multiplies: (0.5 * loss) gives exactly half the gradients (a power of two), and
    a rerun is bit-identical (no atomics in any sum)."""
    inputs = make_inputs(20, 32, 150, dtype=torch.float32, seed=3, temperature=1.0)
    kw = dict(KW, loss_denominator=20.0, logits=logits)
    loss, _, _, _, gh, gw = run_fused(*inputs, **kw)
    hidden = inputs[0].clone().requires_grad_()
    weight = inputs[1].clone().requires_grad_()
    loss2, *_ = linear_dapo_loss(hidden, weight, *inputs[2:], **kw)
    (0.5 * loss2).backward()
    assert loss2.item() == loss.item()
    assert torch.equal(hidden.grad * 2, gh) and torch.equal(weight.grad * 2, gw)


def test_every_token_masked_gives_zero_loss_and_grads(logits, device):
    hidden, weight, targets, old, adv, _ = make_inputs(9, 32, 100, dtype=torch.float32, seed=4, temperature=1.0)
    loss, lp, _, stats, gh, gw = run_fused(
        hidden, weight, targets, old, adv, torch.zeros(9, device=DEVICE), **KW, loss_denominator=9.0, logits=logits
    )
    assert loss.item() == 0.0 and stats["num_tokens"].item() == 0.0 and stats["ratio_mean"].item() == 0.0
    assert not gh.any() and not gw.any()
    assert (lp < 0).all()  # the log-prob is still computed (a metric)


def test_bad_inputs_raise_value_error(device):
    hidden, weight, targets, old, adv, lw = make_inputs(4, 32, 70, dtype=torch.float32, seed=5, temperature=1.0)
    with pytest.raises(ValueError, match="advantages must be per token"):
        linear_dapo_loss(hidden, weight, targets, old, adv[:, None], lw, **KW, loss_denominator=4.0)
    with pytest.raises(ValueError, match="loss_denominator"):
        linear_dapo_loss(hidden, weight, targets, old, adv, lw, **KW, loss_denominator=0.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        linear_dapo_loss(hidden, weight, targets, old, adv, lw, **dict(KW, clip_ratio_c=0.5), loss_denominator=4.0)
    with pytest.raises(ValueError, match="temperature"):
        linear_dapo_loss(hidden, weight, targets, old, adv, lw, **KW, loss_denominator=4.0, temperature=0.0)
    with pytest.raises(ValueError, match=r"logits must be one of \('triton', 'tma'\); got 'cublas'"):
        linear_dapo_loss(hidden, weight, targets, old, adv, lw, **KW, loss_denominator=4.0, logits="cublas")


def test_tma_falls_back_to_the_tl_dot_kernel_where_tma_rules_fail(monkeypatch, device):
    """H = 20 in fp16: 40-byte rows, not 16-byte aligned (logprob_persistent.tma_ok): logits="tma" runs the
    tl.dot kernel, bit for bit logits="triton", and never launches the TMA kernel."""
    monkeypatch.setattr(head_loss_tma, "logits_stats", lambda *a, **k: pytest.fail("TMA kernel launched"))
    inputs = make_inputs(19, 20, 150, dtype=torch.float16, seed=21, temperature=1.0)
    kw = dict(KW, loss_denominator=19.0)
    want = run_fused(*inputs, **kw)
    got = run_fused(*inputs, **kw, logits="tma")
    for a, b in zip(tree_leaves(want), tree_leaves(got)):
        assert torch.equal(a, b)


TP_N, TP_H, TP_V = 21, 32, 2 * 75  # V_local = 75: not a multiple of the vocab tile


def _tp_inputs(vocab_size, device=DEVICE):
    inputs = make_inputs(TP_N, TP_H, TP_V, dtype=torch.float32, seed=11, temperature=0.8, vocab_size=vocab_size)
    return tuple(t.to(device) for t in inputs)


def _tp_rank(vocab_size, logits="triton"):
    """On each rank: its vocab shard of the weight, over the pool's gloo world, 2 row chunks of 16 rows."""
    saved = (head_loss_mod.CHUNK_ROW_ALIGN, head_loss_mod.WORKSPACE_BYTES)
    head_loss_mod.CHUNK_ROW_ALIGN, head_loss_mod.WORKSPACE_BYTES = 16, 16 * 75 * 8
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        hidden, weight, targets, old, adv, lw = _tp_inputs(vocab_size, device="cpu")
        v_local = TP_V // world
        shard = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
        hidden = hidden.clone().requires_grad_()
        loss, lp, ent, stats = linear_dapo_loss(
            hidden, shard, targets, old, adv, lw, **KW, loss_denominator=25.0, temperature=0.8,
            tp_group=dist.group.WORLD, vocab_size=vocab_size, logits=logits,
        )  # fmt: skip
        loss.backward()
        return loss.detach(), lp, ent, torch.stack(list(stats.values())), hidden.grad, shard.grad
    finally:
        head_loss_mod.CHUNK_ROW_ALIGN, head_loss_mod.WORKSPACE_BYTES = saved


# vocab_size None: no padding; 110: rank 1 holds 35 real rows and 40 of padding; 60: rank 1 only padding.
@pytest.mark.parametrize("vocab_size", [None, 110, 60])
def test_vocab_parallel_tp2_equals_tp1(vocab_size, logits, rank_pool, device):
    if device != "cpu":
        pytest.skip("the TP=2 check runs on the CPU pool (gloo); GPUs: tests/gpu")
    results = rank_pool(2).run(_tp_rank, vocab_size, logits)
    inputs = _tp_inputs(vocab_size)
    real = vocab_size or TP_V
    kw = dict(KW, loss_denominator=25.0, temperature=0.8)
    loss1, lp1, ent1, stats1, gh1, gw1 = run_fused(*inputs, **kw, vocab_size=vocab_size, logits=logits)
    oracle_inputs = (inputs[0], inputs[1][:real], *inputs[2:])
    loss64, lp64, _, _, gh64, gw64 = run_oracle(*oracle_inputs, **kw)
    scale = loss_scale(lp64, *inputs[3:], **kw)
    assert abs(loss1.item() - loss64.item()) < 2e-5 * scale
    assert rel_err(gh1, gh64) < 1e-5 and rel_err(gw1[:real], gw64) < 1e-5
    assert not gw1[real:].any()  # padding rows: zero gradient
    stats1 = torch.stack(list(stats1.values()))
    for rank, (loss, lp, ent, stats, gh, gw_shard) in enumerate(results):
        # fp32 on both sides, the shards' statistics merged in another order: a few fp32 roundings
        assert (lp - lp1).abs().max().item() < 2e-6 and (ent - ent1).abs().max().item() < 2e-6
        # each ratio within 2e-6 relative, so the loss within 2e-6 of its terms' scale
        assert abs(loss.item() - loss1.item()) < 2e-6 * scale
        assert ((stats - stats1).abs() <= 1e-6 * stats1.abs().clamp(min=1.0)).all()
        # every gradient carries its token's ratio, itself within 2e-6 relative (the log-prob bound above)
        assert rel_err(gh, gh1.double()) < 2e-6  # all-reduced: the full hidden gradient on each rank
        want = gw1[rank * 75 : (rank + 1) * 75]
        if rank * 75 < real:  # the weight gradient stays local: the shard's rows of the TP=1 gradient
            assert rel_err(gw_shard, want.double()) < 2e-6
        else:  # a shard of padding only
            assert not gw_shard.any()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dry run needs the Triton interpreter (GPU: the plan's call)")
def test_variants_script_runs_every_variant_and_checks_one_pass_against_today(tmp_path):
    """kernels/bench/variants_head_loss.py on CPU (its code, not its timings): a row per variant that runs
    here (liger is not installed on the CPU machines), and one_pass agrees with today's head + loss."""
    from dapo_kernels.bench import variants_head_loss

    path = tmp_path / "variants.csv"
    assert variants_head_loss.main(["--cpu-dry-run", "--csv", str(path)]) == 0
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]]
    timed = {row[1] for row in rows if row[3] == "ms"}
    assert timed == {"one_pass", "one_pass_tma", "one_pass_ws2g", "today", "today_tma", "cublas_3gemm"}
    table = variants_head_loss.run_variants(
        n=20, h=32, v=260, tp=2, variants=["one_pass", "one_pass_tma"], repeats=1, csv=str(path), device="cpu"
    )
    for row in table[-2:]:
        d_lp, d_loss = (float(x) for x in row["vs_today"].split("/"))
        # bf16 inputs, fp32 logits on both paths, different tilings: a few fp32 roundings of the log-prob
        assert d_lp < 1e-5 and d_loss < 1e-5, row
    with pytest.raises(ValueError, match=r"--variants: unknown \['nope'\]"):
        variants_head_loss.main(["--cpu-dry-run", "--csv", str(path), "--variants", "one_pass,nope"])


class _Shapes(TorchDispatchMode):
    """The shape of every floating-point tensor an aten op returns while active (the interpreter's uint8
    byte copies of the kernels' argument storages are not allocations of the op: left out)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.shapes += [tuple(t.shape) for t in leaves if t.is_floating_point()]
        return out


def test_logits_never_exist_beyond_one_chunk(logits, monkeypatch, device):
    """N = 48 rows in chunks of 16: every tensor the call creates (forward and backward) holds at most
    one chunk's logits (16 x V), and nothing is as large as the [N, V] logits (V H < N V here)."""
    n, h, v = 48, 32, 301
    force_chunks(monkeypatch, rows=16, v=v, dtype=torch.float32)
    inputs = make_inputs(n, h, v, dtype=torch.float32, seed=9, temperature=1.0)
    hidden = inputs[0].clone().requires_grad_()
    weight = inputs[1].clone().requires_grad_()
    with _Shapes() as seen:
        loss, *_ = linear_dapo_loss(hidden, weight, *inputs[2:], **KW, loss_denominator=40.0, logits=logits)
        loss.backward()
    sizes = [math.prod(shape) for shape in seen.shapes]
    vocab_wide = [shape for shape in seen.shapes if len(shape) == 2 and shape[1] == v]
    assert vocab_wide and max(rows for rows, _ in vocab_wide) == 16
    assert max(sizes) < n * v


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_aggregation_mode_is_a_per_token_weight(agg_mode, logits, device):
    """The trainer's three aggregation modes (dapo_megatron.algo) through loss_weight and D, known before
    the pass: token-mean w = mask, D = tokens; seq-mean-token-sum w = mask, D = sequences;
    seq-mean-token-mean w = mask / (the sequence's token count), D = sequences. Loss and gradients equal
    algo.policy_loss on the float64 reference log-prob (tolerances as test_forward_and_grads_match_float64)."""
    algo = pytest.importorskip("dapo_megatron.algo.policy_loss")
    b, t, h, v = 3, 9, 32, 150
    hidden, weight, targets, old, adv, lw = make_inputs(b * t, h, v, dtype=torch.float32, seed=13, temperature=1.0)
    mask = (lw > 0).float().view(b, t)
    count = mask.sum(dim=1, keepdim=True)
    loss_weight = (mask / count if agg_mode == "seq-mean-token-mean" else mask).reshape(-1)
    denom = float(mask.sum()) if agg_mode == "token-mean" else float(b)
    kw = dict(KW, loss_denominator=denom)
    loss, _, _, _, gh, gw = run_fused(hidden, weight, targets, old, adv, loss_weight, **kw, logits=logits)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    lp64, _ = linear_logprob_entropy_reference(h64, w64, targets)
    loss64, _ = algo.policy_loss(
        lp64.view(b, t), old.double().view(b, t), adv.double().view(b, t), mask, agg_mode=agg_mode, **kw
    )
    loss64.backward()
    scale = loss_scale(lp64.detach(), old, adv, loss_weight, **kw)
    assert abs(loss.item() - loss64.item()) < 2e-5 * scale
    assert rel_err(gh, h64.grad) < 1e-5 and rel_err(gw, w64.grad) < 1e-5


class _Storages(TorchDispatchMode):
    """Bytes of every distinct floating-point storage an aten op returns while active (by data pointer: the
    forward's buffers are alive together, so none is counted twice; views of the inputs included)."""

    def __init__(self):
        super().__init__()
        self.nbytes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.nbytes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("rows", [16, None], ids=["3_chunks", "one_chunk"])
def test_one_pass_bytes_is_what_the_forward_allocates(rows, logits, monkeypatch, device):
    """one_pass_bytes (the memory plan's count, memplan/activations.py) against the storages the forward
    creates: the buffers of at least one chunk x H fp32 (the O(N) vectors and the [4, N] statistics are
    below it) are exactly its workspace + saved, and saved is what autograd keeps for the backward."""
    n, h, v = 48, 32, 301
    if rows is not None:
        force_chunks(monkeypatch, rows=rows, v=v, dtype=torch.float32)
    inputs = make_inputs(n, h, v, dtype=torch.float32, seed=9, temperature=1.0)
    hidden = inputs[0].clone().requires_grad_()
    weight = inputs[1].clone().requires_grad_()
    with _Storages() as seen:
        loss, *_ = linear_dapo_loss(hidden, weight, *inputs[2:], **KW, loss_denominator=40.0, logits=logits)
    want = head_loss_mod.one_pass_bytes(n, h, v, 4, tp=False)
    floor = 16 * h * 4
    given = {t.untyped_storage().data_ptr() for t in (hidden, weight, *inputs[2:])}  # views of the inputs
    created = [b for ptr, b in seen.nbytes.items() if b >= floor and ptr not in given]
    assert sum(created) == want["workspace"] + want["saved"]
    assert sum(t.untyped_storage().nbytes() for t in loss.grad_fn.saved_tensors) == want["saved"]
    # one chunk's fp32 logits + fp32 dlogits, and with several chunks the fp32 grad_weight accumulator
    assert want["workspace"] == (16 * v * 8 + v * h * 4 if rows else n * v * 8)


@pytest.mark.parametrize("fp32", [False, True])
def test_tma_autotune_configs_set_the_descriptor_boxes(fp32):
    """Compiled, the TMA kernel autotunes over tiles while the host descriptors carry one box: each config's
    pre-hook must set the boxes to its tiles (a box that is not the tile reads the wrong rows on the GPU;
    the interpreter runs its fixed tiles and would not notice)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    for cfg in head_loss_tma.hopper_configs(fp32=fp32):
        nargs = {
            "h_desc": TensorDescriptor.from_tensor(torch.zeros(8, 64), [16, 32]),
            "w_desc": TensorDescriptor.from_tensor(torch.zeros(8, 64), [16, 32]),
            **cfg.kwargs,
        }
        cfg.pre_hook(nargs)
        bn, bv, bk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_V"], cfg.kwargs["BLOCK_K"]
        assert list(nargs["h_desc"].block_shape) == [bn, bk] and list(nargs["w_desc"].block_shape) == [bv, bk]

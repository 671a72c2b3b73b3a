"""Fused linear log-prob + entropy (Triton: interpreted on CPU, compiled on a GPU) against a
float64 oracle.

Run: pytest tests/kernels/test_logprob.py -q          (any device: see tests/kernels/conftest.py)
Forward AND gradients (hidden, weight; through logprob and entropy) on odd shapes: V not a multiple
of the vocab tile, N = 1, +-1e4 logit offsets (all-negative logits), temperature != 1,
fp32/fp16/bf16 inputs, several backward chunks, Megatron's vocab padding (vocab_size); vocab-parallel
TP=2 on two ranks equals TP=1, also when one rank's shard is all padding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kernels_device import DEVICE, AtenOps
from logprob_cases import grad_tol, make_inputs, rel_err, run_fused, run_oracle

import dapo_kernels
import dapo_kernels._runtime as runtime
import dapo_kernels.logprob as logprob_mod
import dapo_kernels.logprob_cublas as logprob_cublas
from dapo_kernels import linear_logprob_entropy, linear_logprob_entropy_reference

CASES = {
    # name: (n, h, v, dtype, temperature, backward workspace in rows (None = one chunk))
    "fp32_odd_V_T0.7_chunked": (37, 48, 301, torch.float32, 0.7, 16),
    "fp32_N1": (1, 40, 130, torch.float32, 1.0, None),
    "fp16_T1.3": (29, 32, 200, torch.float16, 1.3, 16),
    "bf16_fp32cast": (33, 64, 257, torch.bfloat16, 1.0, None),
    # bf16 over 3 row blocks: the weight gradient is rounded to bf16 once per row block (3 roundings)
    "bf16_chunked": (45, 32, 257, torch.bfloat16, 0.9, 16),
}


# The fused op's variants: backward schedule x where the logits come from (tl.dot or cuBLAS + epilogue).
SCHEDULES = {
    "blocked": dict(backward="blocked"),
    "row_chunked": dict(backward="row_chunked"),
    "cublas": dict(backward="blocked", logits="cublas"),
    "tma": dict(backward="blocked", logits="tma"),  # persistent TMA-fed kernels (logprob_persistent.py)
}


def force_chunks(monkeypatch, *, rows, v, dtype, h=None, cublas=False):
    """Backward chunks of `rows` rows, on the GPU too (whose chunks are otherwise multiples of 128
    rows). row_chunked: `rows` x the full vocab (fp32 grad_weight accumulation). blocked: row blocks
    of `rows` x vocab blocks of 100 rows (not a multiple of the vocab tile; several blocks at every
    V below, so the fp32 grad_hidden rows and the per-row-block grad_weight passes both run); the
    budget is pinned (h given) to exactly rows * (100 * itemsize + 4 h) bytes (cublas: + 400, the fp32
    logits block). The cuBLAS forward's logit chunks are pinned to `rows` rows too."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    monkeypatch.setattr(logprob_mod, "CHUNK_ROW_ALIGN", 16)
    monkeypatch.setattr(logprob_mod, "VOCAB_BLOCK", 100)
    monkeypatch.setattr(logprob_mod, "BLOCKED_BUDGET_PER_NH", 1 << 30)  # the byte budget below decides
    per_row = v * itemsize if h is None else 100 * (itemsize + (4 if cublas else 0)) + 4 * h
    monkeypatch.setattr(logprob_mod, "BACKWARD_WORKSPACE_BYTES", rows * per_row)
    monkeypatch.setattr(logprob_cublas, "ROW_ALIGN", 16)
    monkeypatch.setattr(logprob_cublas, "FORWARD_LOGITS_BYTES", rows * v * 4)


def force_schedule_chunks(monkeypatch, schedule, *, rows, v, dtype, h):
    blocked = SCHEDULES[schedule]["backward"] == "blocked"
    force_chunks(monkeypatch, rows=rows, v=v, dtype=dtype, h=h if blocked else None, cublas=schedule == "cublas")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_grads_match_float64(name, schedule, monkeypatch, device):
    n, h, v, dtype, temperature, chunk_rows = CASES[name]
    if chunk_rows is not None:
        force_schedule_chunks(monkeypatch, schedule, rows=chunk_rows, v=v, dtype=dtype, h=h)
        if schedule != "row_chunked":  # the schedule these tests mean to exercise: several row AND vocab blocks
            rows, cols = logprob_mod.blocked_plan(
                n, h, v, torch.tensor([], dtype=dtype).element_size(), cublas=schedule == "cublas"
            )
            assert rows == chunk_rows < n and cols == 100 < v
    inputs = make_inputs(n, h, v, dtype=dtype, seed=sum(map(ord, name)))
    lp, ent, gh, gw = run_fused(*inputs, temperature=temperature, **SCHEDULES[schedule])
    lp64, ent64, gh64, gw64 = run_oracle(*inputs, temperature=temperature)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (n,)
    assert gh.dtype == dtype and gw.dtype == dtype
    # Forward: the matmul accumulates exactly-representable products in fp32 (H <= 64 terms).
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert (ent.double() - ent64).abs().max().item() < 2e-5
    assert (lp <= 0).all() and (ent >= 0).all()
    assert rel_err(gh, gh64) < grad_tol(dtype)
    assert rel_err(gw, gw64) < grad_tol(dtype)


@pytest.mark.parametrize("schedule", [None, *SCHEDULES])
@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_large_logit_offsets(offset, schedule, monkeypatch, device):
    """Every logit shifted by +-1e4 (at -1e4 all logits are negative). fp32 spacing at 1e4 is 2^-10:
    the logits are exact (make_inputs) but z / T rounds each by up to half a spacing, and a
    log-prob combines two of them and the log-sum-exp; allow 4 spacings, nothing more."""
    n, h, v = 24, 32, 190
    if schedule:  # 2 row blocks (x 2 vocab blocks for the blocked schedules)
        force_schedule_chunks(monkeypatch, schedule, rows=16, v=v, dtype=torch.float32, h=h)
    inputs = make_inputs(n, h, v, dtype=torch.float32, seed=7, offset=offset)
    lp, ent, gh, gw = run_fused(*inputs, temperature=0.9, **SCHEDULES.get(schedule, {}))
    lp64, ent64, gh64, gw64 = run_oracle(*inputs, temperature=0.9)
    spacing = 2.0**-10
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp <= 0).all()
    assert (lp.double() - lp64).abs().max().item() < 4 * spacing
    assert (ent.double() - ent64).abs().max().item() < 4 * spacing
    assert rel_err(gh, gh64) < 4 * spacing
    assert rel_err(gw, gw64) < 4 * spacing


def test_without_entropy_grads_flow_from_logprob_only(device):
    inputs = make_inputs(19, 32, 150, dtype=torch.float32, seed=3)
    lp, ent, gh, gw = run_fused(*inputs, return_entropy=False)
    lp64, _, gh64, gw64 = run_oracle(*inputs, return_entropy=False)
    assert ent is None
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert rel_err(gh, gh64) < 1e-5 and rel_err(gw, gw64) < 1e-5


def test_empty_batch_gives_empty_outputs_and_zero_grads(device):
    hidden = torch.zeros(0, 16, device=device, requires_grad=True)
    weight = torch.randn(70, 16, device=device, requires_grad=True)
    lp, ent = linear_logprob_entropy(hidden, weight, torch.zeros(0, dtype=torch.long, device=device))
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 16) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_bit_identical_reruns(monkeypatch, device):
    force_chunks(monkeypatch, rows=16, v=170, dtype=torch.float16)
    inputs = make_inputs(40, 32, 170, dtype=torch.float16, seed=11)
    first = run_fused(*inputs, temperature=0.8)
    second = run_fused(*inputs, temperature=0.8)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_bad_inputs_raise_value_error(device, monkeypatch):
    monkeypatch.setenv("DAPO_KERNELS_DEBUG", "1")  # the target-range check (a host sync) runs in debug mode only
    hidden, weight, targets, _, _ = make_inputs(4, 16, 70, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        linear_logprob_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 70\)"):
        linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 70, 2], device=device))
    with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 60\)"):  # 60..69: padding rows
        linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 65, 2], device=device), vocab_size=60)
    for bad in (0, 71, 3.5):
        with pytest.raises(ValueError, match=r"vocab_size must be an int in \[1, 70\]"):
            linear_logprob_entropy(hidden, weight, targets, vocab_size=bad)
    with pytest.raises(ValueError, match="same dtype"):
        linear_logprob_entropy(hidden, weight.half(), targets)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob_entropy(hidden, weight, targets, temperature=0.0)


@pytest.mark.parametrize("impl", ["fused", "reference"])
def test_target_range_check_only_in_debug_mode_and_no_host_read_without_it(impl, monkeypatch, device):
    """Without DAPO_KERNELS_DEBUG the call reads no tensor value on the host (no aten._local_scalar_dense,
    the .item()/int() behind a device-to-host sync) in forward or backward; 3eb0efe read targets.min()
    and targets.max() on every call. With it, an out-of-range id is refused with the message."""
    op = linear_logprob_entropy if impl == "fused" else linear_logprob_entropy_reference
    hidden, weight, targets, g_lp, g_ent = make_inputs(20, 16, 70, dtype=torch.float32, seed=3)
    monkeypatch.delenv("DAPO_KERNELS_DEBUG", raising=False)
    hidden = hidden.clone().requires_grad_()
    with AtenOps() as recorded:
        lp, ent = op(hidden, weight, targets)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert "_local_scalar_dense" not in recorded.ops
    assert hidden.grad is not None
    monkeypatch.setenv("DAPO_KERNELS_DEBUG", "1")
    bad = targets.clone()
    bad[7] = 70
    with pytest.raises(
        ValueError,
        match=r"targets must be token ids in \[0, 70\); got min \d+, max 70 "
        r"\(mask padding positions with the loss mask, not with -100\)",
    ):
        op(hidden, weight, bad)
    bad[7] = -100
    with pytest.raises(ValueError, match=r"got min -100"):
        op(hidden, weight, bad)


def test_without_cuda_or_interpreter_the_fused_op_refuses(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="linear_logprob_entropy_reference|_reference"):
        runtime.require_runnable(torch.zeros(2), op="linear_logprob_entropy")


# ---- Megatron's vocab padding -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("chunked", [False, True])
def test_padded_vocab_rows_take_no_probability_and_no_gradient(chunked, schedule, monkeypatch, device):
    """vocab_size=261 of 320 rows (the padding rows hold random values, not Megatron's zeros, so a
    leak would show): equal to the float64 oracle on the 261 real rows; zero gradient on the rest."""
    n, h, v, real = 29, 32, 320, 261
    if chunked:
        force_schedule_chunks(monkeypatch, schedule, rows=16, v=v, dtype=torch.float32, h=h)
    hidden, weight, targets, g_lp, g_ent = make_inputs(n, h, v, dtype=torch.float32, seed=21, vocab_size=real)
    targets[:2] = torch.tensor([0, real - 1])
    lp, ent, gh, gw = run_fused(
        hidden, weight, targets, g_lp, g_ent, temperature=0.9, vocab_size=real, **SCHEDULES[schedule]
    )
    lp64, ent64, gh64, gw64 = run_oracle(hidden, weight[:real], targets, g_lp, g_ent, temperature=0.9)
    assert (lp.double() - lp64).abs().max().item() < 2e-5
    assert (ent.double() - ent64).abs().max().item() < 2e-5
    assert rel_err(gh, gh64) < 1e-5 and rel_err(gw[:real], gw64) < 1e-5
    assert torch.equal(gw[real:], torch.zeros_like(gw[real:]))
    ref = run_fused(
        hidden, weight, targets, g_lp, g_ent, temperature=0.9, vocab_size=real, impl=linear_logprob_entropy_reference
    )
    for got, want in zip((lp, ent, gh, gw), ref):  # the plain-torch head pads the same way
        assert (got - want).abs().max().item() < 1e-5


# ---- vocab-parallel: TP=2 on two ranks equals TP=1 ------------------------------------------------

TP_N, TP_H, TP_V = 21, 32, 2 * 75  # V_local = 75: not a multiple of the vocab tile


def _tp_inputs(*, vocab_size=None, device=DEVICE):
    real = vocab_size or TP_V
    hidden, weight, targets, g_lp, g_ent = make_inputs(
        TP_N, TP_H, TP_V, dtype=torch.float32, seed=5, vocab_size=real, device=device
    )
    v_local = TP_V // 2
    # targets on both sides of the shard boundary and at the ends of the (real) vocab
    edges = [t for t in (0, v_local - 1, v_local, v_local + 1, real - 1, v_local - 2) if t < real]
    targets[: len(edges)] = torch.tensor(edges, device=targets.device)
    return hidden, weight, targets, g_lp, g_ent


def _tp_group(device: str):
    """The pool's gloo world on CPU. On GPUs: an NCCL group over the first two (gloo has no CUDA
    all_gather, and NCCL refuses two ranks on one device)."""
    if device == "cpu":
        return dist.group.WORLD
    torch.cuda.set_device(dist.get_rank())
    return dist.new_group(backend="nccl")


# blocked backward on the ranks: vocab blocks of 40 rows (2 per 75-row shard) x row blocks of 16 rows
_TP_BLOCKED = {
    "VOCAB_BLOCK": 40,
    "BLOCKED_BUDGET_PER_NH": 1 << 30,
    "CHUNK_ROW_ALIGN": 16,
    "BACKWARD_WORKSPACE_BYTES": 16 * (40 * 4 + 4 * TP_H),
}


def _tp_rank(impl: str, vocab_size, device: str):
    """On each rank: its vocab shard of the weight, fused or reference op over the TP group."""
    saved = {k: getattr(logprob_mod, k) for k in ("INTERPRET_TILE_CAPS", *_TP_BLOCKED)}
    saved_cublas = (logprob_cublas.ROW_ALIGN, logprob_cublas.FORWARD_LOGITS_BYTES)
    if dapo_kernels.INTERPRET:  # the same small tiles as the single-process tests (restored below)
        logprob_mod.INTERPRET_TILE_CAPS = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}
    if impl in ("fused_blocked", "fused_cublas", "fused_tma"):
        for key, value in _TP_BLOCKED.items():
            setattr(logprob_mod, key, value)
        if impl == "fused_cublas":  # fp32 logits block on top; forward logit chunks of 16 rows
            logprob_mod.BACKWARD_WORKSPACE_BYTES = 16 * (40 * 8 + 4 * TP_H)
            logprob_cublas.ROW_ALIGN, logprob_cublas.FORWARD_LOGITS_BYTES = 16, 16 * 75 * 4
    try:
        return _tp_rank_body(impl, vocab_size, device)
    finally:
        for key, value in saved.items():
            setattr(logprob_mod, key, value)
        logprob_cublas.ROW_ALIGN, logprob_cublas.FORWARD_LOGITS_BYTES = saved_cublas


def _tp_rank_body(impl: str, vocab_size, device: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _tp_group(device)
    hidden, weight, targets, g_lp, g_ent = _tp_inputs(vocab_size=vocab_size, device=device if device == "cpu" else rank)
    v_local = TP_V // world
    shard = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    hidden = hidden.clone().requires_grad_()
    if impl == "reference":
        lp, ent = linear_logprob_entropy_reference(
            hidden, shard, targets, temperature=0.8, tp_group=group, vocab_size=vocab_size
        )
    else:
        variant = {
            "fused": SCHEDULES["row_chunked"],
            "fused_blocked": SCHEDULES["blocked"],
            "fused_cublas": SCHEDULES["cublas"],
            "fused_tma": SCHEDULES["tma"],
        }[impl]
        lp, ent = linear_logprob_entropy(
            hidden, shard, targets, temperature=0.8, tp_group=group, vocab_size=vocab_size, **variant
        )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)
    return tuple(t.detach().cpu() for t in (lp, ent, hidden.grad, shard.grad))


# vocab_size None: no padding; 110: rank 1 holds 35 real rows and 40 of padding; 60: rank 0 holds
# 60 real rows and 15 of padding, rank 1 only padding (it must still join every collective).
@pytest.mark.parametrize("vocab_size", [None, 110, 60])
@pytest.mark.parametrize("impl", ["fused", "fused_blocked", "fused_cublas", "fused_tma", "reference"])
def test_vocab_parallel_tp2_equals_tp1(impl, vocab_size, rank_pool, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("vocab-parallel on GPUs needs two of them (NCCL: one rank per device)")
    results = rank_pool(2).run(_tp_rank, impl, vocab_size, device)
    real = vocab_size or TP_V
    inputs = _tp_inputs(vocab_size=vocab_size)
    lp1, ent1, gh1, gw1 = (t.cpu() for t in run_fused(*inputs, temperature=0.8, vocab_size=vocab_size))
    inputs64 = list(inputs)
    inputs64[1] = inputs[1][:real]  # the oracle sees only the real rows
    lp64, ent64, gh64, gw64 = (t.cpu() for t in run_oracle(*inputs64, temperature=0.8))
    assert (lp1.double() - lp64).abs().max().item() < 2e-5
    for rank, (lp, ent, gh, gw_shard) in enumerate(results):
        # fp32 on both sides, merged in a different order: agreement to a few fp32 roundings
        assert (lp - lp1).abs().max().item() < 2e-6
        assert (ent - ent1).abs().max().item() < 2e-6
        assert rel_err(gh, gh1.double()) < 1e-6  # all-reduced: the full hidden gradient on each rank
        start = rank * TP_V // 2
        real_rows = max(0, min(TP_V // 2, real - start))  # the weight gradient stays local
        if real_rows:
            assert rel_err(gw_shard[:real_rows], gw1[start : start + real_rows].double()) < 1e-6
            assert rel_err(gw_shard[:real_rows], gw64[start : start + real_rows]) < 1e-5
        assert torch.equal(gw_shard[real_rows:], torch.zeros_like(gw_shard[real_rows:]))


def _row_chunked_padded_rank(device: str):
    """row_chunked backward at TP=2 with vocab_size=110: rank 0's shard holds 75 real rows, rank 1's 35
    real and 40 of padding. A workspace of 16 x 75 fp32 rows: planned from the padded shard (75 rows) both
    ranks cut the 21 tokens into chunks of 16 + 5, i.e. two all-reduces of grad_hidden each; planned from
    the real rows (3eb0efe) rank 1 took all 21 rows in one chunk, one all-reduce against rank 0's two. The
    all-reduces are counted on the way to the real collective; the group's 60 s timeout turns a mismatch
    into an error instead of a hang."""
    import datetime

    saved = {k: getattr(logprob_mod, k) for k in ("INTERPRET_TILE_CAPS", "CHUNK_ROW_ALIGN", "BACKWARD_WORKSPACE_BYTES")}
    real_all_reduce = dist.all_reduce
    sizes = []

    def counted_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.shape[0])
        return real_all_reduce(tensor, *args, **kwargs)

    if dapo_kernels.INTERPRET:
        logprob_mod.INTERPRET_TILE_CAPS = {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}
    logprob_mod.CHUNK_ROW_ALIGN = 16
    logprob_mod.BACKWARD_WORKSPACE_BYTES = 16 * 75 * 4
    rank = dist.get_rank()
    group = (
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)) if device == "cpu" else _tp_group(device)
    )
    try:
        hidden, weight, targets, g_lp, g_ent = _tp_inputs(vocab_size=110, device=device if device == "cpu" else rank)
        shard = weight[rank * 75 : (rank + 1) * 75].clone().requires_grad_()
        hidden = hidden.clone().requires_grad_()
        lp, ent = linear_logprob_entropy(
            hidden, shard, targets, temperature=0.8, tp_group=group, vocab_size=110, backward="row_chunked"
        )
        dist.all_reduce = counted_all_reduce
        try:
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        finally:
            dist.all_reduce = real_all_reduce
        return sizes, tuple(t.detach().cpu() for t in (hidden.grad, shard.grad))
    finally:
        for key, value in saved.items():
            setattr(logprob_mod, key, value)
        dist.destroy_process_group(group)


def test_row_chunked_tp2_plans_its_chunks_from_the_padded_shard(rank_pool, device):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("vocab-parallel on GPUs needs two of them (NCCL: one rank per device)")
    (sizes0, (gh0, gw0)), (sizes1, (gh1, gw1)) = rank_pool(2).run(_row_chunked_padded_rank, device)
    assert sizes0 == sizes1 == [16, 5]  # the same collectives on both ranks: grad_hidden rows per chunk
    inputs = _tp_inputs(vocab_size=110)
    inputs64 = list(inputs)
    inputs64[1] = inputs[1][:110]  # the oracle sees only the real rows
    _, _, gh64, gw64 = (t.cpu() for t in run_oracle(*inputs64, temperature=0.8))
    for gh in (gh0, gh1):
        assert rel_err(gh, gh64) < 1e-5
    assert rel_err(gw0, gw64[:75]) < 1e-5
    assert rel_err(gw1[:35], gw64[75:110]) < 1e-5
    assert torch.equal(gw1[35:], torch.zeros_like(gw1[35:]))  # padding rows: zero gradient


def test_autotune_off_keeps_the_first_hopper_configuration(monkeypatch):
    """DAPO_KERNELS_AUTOTUNE=0 (the GPU kernel tests): one configuration, the first of the tuned set."""
    from dapo_kernels import _runtime, logprob

    monkeypatch.setenv(_runtime.AUTOTUNE_ENV, "0")
    assert not _runtime.autotune_every_config()
    monkeypatch.delenv(_runtime.AUTOTUNE_ENV)
    assert _runtime.autotune_every_config()
    for with_group in (True, False):
        every = logprob._hopper_configs(with_group)
        (first,) = logprob._hopper_configs(with_group, every=False)
        assert len(every) == 4 and str(first) == str(every[0])
        assert first.kwargs["BLOCK_N"] == 128 and first.kwargs["BLOCK_V"] == 256 and first.num_warps == 8

"""What the fused LM head's backward holds, counted tensor by tensor (CPU, Triton interpreter).

Run: pytest tests/kernels/test_logprob_memory.py -q
A TorchDispatchMode sees every tensor torch allocates inside the call and a finalizer on its
storage sees it freed, so the peak of live bytes is exact (the Triton kernels only write into
tensors allocated through torch). The GPU test tests/gpu/test_kernels_gpu.py checks the same
formulas with torch.cuda.max_memory_allocated at Qwen2.5-7B size, plus cuBLAS's workspace.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from kernels_device import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dapo_kernels.logprob as logprob_mod
from dapo_kernels import linear_logprob_entropy


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages allocated while active (views count once; views of the storages of
    `existing`, such as weight[:rows], count nothing)."""

    def __init__(self, existing=()):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in self.live or key in self.existing:
                    continue
                if self.now + storage.nbytes() > self.peak:
                    # Under a dispatch mode some interpreter-launched temporaries end up in reference
                    # cycles (freed by refcount alone without the mode): collect before a new peak.
                    gc.collect()
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key):
        self.now -= self.live.pop(key, 0)


def _fwd_bwd_peak(n, h, v, dtype, backward, **kw):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    with LiveBytes(existing=(hidden, weight, targets)) as live:
        lp, ent = linear_logprob_entropy(hidden, weight, targets, backward=backward, **kw)
        (lp.sum() + ent.sum()).backward()
        del lp, ent
    return live.peak


@pytest.fixture
def cpu_only(device):
    if DEVICE != "cpu":
        pytest.skip("counts CPU storages; on a GPU tests/gpu/test_kernels_gpu.py measures the same")


@pytest.mark.parametrize("logits", ["triton", "cublas"])
def test_blocked_backward_holds_its_workspace_formula_and_nothing_more(logits, cpu_only, monkeypatch):
    """fp32 (whose CPU matmuls allocate exactly what the CUDA ones do): peak = the two gradients +
    blocked_workspace_bytes + O(N) per-token vectors, with 3 row blocks x 3 vocab blocks (cublas: plus
    the fp32 logits block; its forward's logit chunk, 16 rows here, is freed before the backward)."""
    import dapo_kernels.logprob_cublas as logprob_cublas

    n, h, v = 40, 32, 250
    cublas = logits == "cublas"
    monkeypatch.setattr(logprob_mod, "CHUNK_ROW_ALIGN", 16)
    monkeypatch.setattr(logprob_mod, "VOCAB_BLOCK", 100)
    monkeypatch.setattr(logprob_mod, "BACKWARD_WORKSPACE_BYTES", 16 * (100 * (8 if cublas else 4) + 4 * h))
    monkeypatch.setattr(logprob_cublas, "ROW_ALIGN", 16)
    monkeypatch.setattr(logprob_cublas, "FORWARD_LOGITS_BYTES", 16 * v * 4)
    rows, cols = logprob_mod.blocked_plan(n, h, v, 4, cublas=cublas)
    assert (rows, cols) == (16, 100)
    workspace = logprob_mod.blocked_workspace_bytes(n, h, v, 4, cublas=cublas)
    assert workspace == 16 * 100 * (8 if cublas else 4) + 16 * h * 4
    peak = _fwd_bwd_peak(n, h, v, torch.float32, "blocked", logits=logits)
    grads = (n * h + v * h) * 4
    per_token = 32 * 4 * n  # saved stats, outputs, upstream grads, targets, merge temporaries: < 32 fp32 vectors
    assert grads + workspace <= peak <= grads + workspace + per_token, (peak, grads, workspace)


def test_blocked_workspace_is_bounded_whatever_n(cpu_only, monkeypatch):
    """Qwen2.5-7B head in bf16: <= the 256 MiB cap at any N, and <= 3 N H bytes (below Liger's
    transient logits) where that is smaller. Row blocks aligned to 128 as when compiled."""
    monkeypatch.setattr(logprob_mod, "CHUNK_ROW_ALIGN", 128)
    h, v = 3584, 152064
    for n in (1, 4096, 16384, 32768, 65536, 1 << 20):
        ws = logprob_mod.blocked_workspace_bytes(n, h, v, 2)
        assert ws <= logprob_mod.BACKWARD_WORKSPACE_BYTES
        if n >= 128:
            assert ws <= 3 * n * h
    # the numbers kernels/bench/NOTES.md and tests/gpu/test_kernels_gpu.py quote for N=32768
    assert logprob_mod.blocked_plan(32768, h, v, 2) == (11008, 4096)  # 3 balanced row blocks
    assert logprob_mod.blocked_workspace_bytes(32768, h, v, 2) == 11008 * (4096 * 2 + 4 * h)


def test_row_chunked_converts_its_accumulator_in_place(cpu_only, monkeypatch):
    """The first schedule in bf16 over 3 chunks: fp32 [V, H] accumulator + the dL/dlogits chunk, and no
    third [V, H] at the end (the old `grad[:] = acc.to(bf16)` temporary, 2VH bytes, the bulk of the
    1153 MiB the first H100 run measured). CPU-only on top: the fp32 copies of dZ^T and the hidden chunk
    that the CPU addmm needs (CUDA uses addmm(out_dtype=float32) instead)."""
    n, h, v, chunk = 40, 64, 300, 16
    monkeypatch.setattr(logprob_mod, "CHUNK_ROW_ALIGN", 16)
    monkeypatch.setattr(logprob_mod, "BACKWARD_WORKSPACE_BYTES", chunk * v * 2)
    peak = _fwd_bwd_peak(n, h, v, torch.bfloat16, "row_chunked")
    grads = (n * h + v * h) * 2
    acc, dz = 4 * v * h, chunk * v * 2
    cpu_copies = 4 * chunk * v + 4 * chunk * h  # a.float() and b.float() of one chunk (addmm_ adds in place)
    per_token = 32 * 4 * n
    assert peak <= grads + acc + dz + cpu_copies + per_token, (peak, grads + acc + dz + cpu_copies)
    # a leftover conversion temporary could not hide in the slack (measured 2026-11-25: the old code's
    # peak was 2VH = 38400 bytes above the copies + 1928 bytes of per-token vectors; now 1928 above)
    assert 2 * v * h > per_token

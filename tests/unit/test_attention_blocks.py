"""The torch backend's O(T) attention (actor/attention.py) against the dense-mask reference
(tests/attention_reference.py) on CPU, outputs and gradients: in float64 to 1e-12 (the same maths, not
just close), and in fp32 within 1e-6 of the tensor's scale (its largest magnitude) of the float64 dense
answer. Two fp32 kernels differ from each other by rounding: the new and the dense path each land up to
~8e-7 (absolute, gradients of magnitude ~1-5) from float64, on opposite sides, so new-vs-dense in fp32
reaches 1.5e-6 absolute; the float64 reference is the fair judge of both."""

import pytest
import torch

from attention_reference import block_causal_mask, cp_causal_mask, dense_attention
from dapo_megatron.actor import attention
from dapo_megatron.actor.attention import QueryBlock, blockwise_attention, document_blocks
from dapo_megatron.actor.context_parallel import merge_from_cp, split_for_cp

TOL64 = dict(atol=1e-12, rtol=0)


def _assert_matches(new, ref_fn, q, k, v, weight):
    """new: (out, dq, dk, dv) of the new path in q's dtype; ref_fn: the dense path, run in float64."""
    ref = _grads(ref_fn, *(x.double() for x in (q, k, v, weight)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), new, ref):
        if q.dtype == torch.float64:
            torch.testing.assert_close(a, b, **TOL64)
        else:
            error = (a.double() - b).abs().max().item()
            assert error <= 1e-6 * b.abs().max().item(), (name, error, b.abs().max().item())


def test_document_blocks_by_hand():
    # documents of 3, 1 and 2 tokens, then a 2-token tail not in the boundaries: its own block
    assert document_blocks([0, 3, 4, 6], 8) == [
        QueryBlock(0, 3, 0, 3),
        QueryBlock(3, 4, 3, 4),
        QueryBlock(4, 6, 4, 6),
        QueryBlock(6, 8, 6, 8),
    ]
    # cp=2, documents of 8 and 4 tokens: rank 1 holds chunks 1 and 2 of each (lengths 2 and 1);
    # chunk c of a document starting at s sees keys [s, s + (c+1) n)
    assert document_blocks([0, 8, 12], 6, cp_size=2, cp_rank=1) == [
        QueryBlock(0, 2, 0, 4),
        QueryBlock(2, 4, 0, 6),
        QueryBlock(4, 5, 8, 10),
        QueryBlock(5, 6, 8, 11),
    ]
    assert document_blocks([0, 8, 12], 6, cp_size=2, cp_rank=0) == [
        QueryBlock(0, 2, 0, 2),
        QueryBlock(2, 4, 0, 8),
        QueryBlock(4, 5, 8, 9),
        QueryBlock(5, 6, 8, 12),
    ]
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp = 4"):
        document_blocks([0, 6], 3, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="boundaries end at 12"):
        document_blocks([0, 8, 12], 5, cp_size=2, cp_rank=0)


def _qkv(total, *, heads=4, groups=2, dim=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, groups, total, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, groups, total, dim, generator=gen, dtype=dtype)
    weight = torch.randn(1, heads, total, dim, generator=gen, dtype=dtype)  # d loss / d out
    return q, k, v, weight


def _grads(fn, q, k, v, weight):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_packed_blocks_equal_dense_mask_forward_and_gradients(heads, groups, dtype):
    # documents of 5, 1 (length 1), 7 and 1 tokens, then a 3-token padding tail not in cu_seqlens
    cu = torch.tensor([0, 5, 6, 13, 14])
    total = 17
    q, k, v, weight = _qkv(total, heads=heads, groups=groups, dtype=dtype)
    scale = 0.3
    blocks = document_blocks(cu.tolist(), total)
    new = _grads(lambda q, k, v: blockwise_attention(q, k, v, blocks, scale=scale), q, k, v, weight)
    _assert_matches(
        new, lambda q, k, v: dense_attention(q, k, v, block_causal_mask(cu, total), scale=scale), q, k, v, weight
    )
    # not vacuous: one causal row over the whole micro-batch differs
    whole = dense_attention(q, k, v, torch.ones(total, total).tril().bool(), scale=scale)
    assert (whole - new[0]).abs().max() > 1e-2


def _cp_parity(cu, cp_size, *, heads=4, groups=2, lower_right_by_flash=None, monkeypatch=None, dtype=torch.float32):
    """Each CP rank's local queries against the gathered (token-order) K/V, per query block, merged over
    ranks; gradients of a loss summed over ranks, against the dense whole-micro-batch attention."""
    if lower_right_by_flash is not None:
        monkeypatch.setattr(attention, "_lower_right_by_flash", lambda q: lower_right_by_flash)
    cu = torch.tensor(cu)
    total = int(cu[-1])
    q, k, v, weight = _qkv(total, heads=heads, groups=groups, seed=cp_size, dtype=dtype)

    def cp_attention(q, k, v):
        parts = []
        for rank in range(cp_size):
            q_local = split_for_cp(q, cu, cp_size=cp_size, cp_rank=rank, dim=2)
            blocks = document_blocks(cu.tolist(), total // cp_size, cp_size=cp_size, cp_rank=rank)
            parts.append(blockwise_attention(q_local, k, v, blocks, scale=8**-0.5))
        return merge_from_cp(parts, cu, dim=2)

    new = _grads(cp_attention, q, k, v, weight)
    _assert_matches(new, lambda q, k, v: dense_attention(q, k, v, block_causal_mask(cu, total)), q, k, v, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_chunks_equal_dense_mask_forward_and_gradients(cp_size, dtype):
    m = 2 * cp_size
    # documents cross the chunk boundaries (every document spans 2*cp chunks); one of exactly 2*cp tokens
    # (chunks of one token), and a padding segment at the end
    _cp_parity([0, 3 * m, 4 * m, 9 * m, 10 * m], cp_size, dtype=dtype)


def test_cp_lower_right_kernel_branch_equals_dense(monkeypatch):
    """The CUDA branch (torch.nn.attention.bias.causal_lower_right; on CPU it materialises the small mask,
    on GPUs it runs flash) has the same alignment as the CPU zero-padding branch."""
    _cp_parity([0, 12, 16, 36], 2, lower_right_by_flash=True, monkeypatch=monkeypatch)


def test_cp_dense_reference_mask_rows_match_the_blocks():
    """The reference CP mask (a [T/cp, T] boolean) is exactly what the query blocks describe."""
    cu = [0, 8, 12, 24]
    for rank in range(2):
        mask = cp_causal_mask(cu, cp_size=2, cp_rank=rank)
        from_blocks = torch.zeros_like(mask)
        for b in document_blocks(cu, 12, cp_size=2, cp_rank=rank):
            for i in range(b.q_start, b.q_end):
                position = b.k_end - (b.q_end - i)  # lower-right alignment
                from_blocks[i, b.k_start : position + 1] = True
        assert torch.equal(mask, from_blocks)


def test_flex_document_mask_forward_equals_dense():
    """FlexAttention's document BlockMask (the CUDA kernel option), eager forward on CPU (its backward
    raises on CPU in torch 2.13: the GPU tests cover it), against the float64 dense answer within 4x the
    rounding the fp32 dense path shows against it (not within a fixed 1e-6 of the fp32 dense path)."""
    cu = torch.tensor([0, 12, 16, 36])
    q, k, v, _ = _qkv(36)
    mask64 = block_causal_mask(cu, 36)
    exact = dense_attention(q.double(), k.double(), v.double(), mask64)
    bound = 4 * (dense_attention(q, k, v, mask64).double() - exact).abs().max().item()
    assert 0 < bound < 1e-5
    blocks = document_blocks(cu.tolist(), 36)
    mask = attention.document_block_mask(blocks, key_tokens=36, device="cpu")
    out = attention.flex_document_attention(q, k, v, mask, scale=8**-0.5, compiled=False)
    assert (out.double() - exact).abs().max().item() <= bound
    # cp=2, rank 1: lower-right aligned chunks
    q_local = split_for_cp(q, cu, cp_size=2, cp_rank=1, dim=2)
    blocks = document_blocks(cu.tolist(), 18, cp_size=2, cp_rank=1)
    mask = attention.document_block_mask(blocks, key_tokens=36, device="cpu")
    out = attention.flex_document_attention(q_local, k, v, mask, scale=8**-0.5, compiled=False)
    assert (out.double() - split_for_cp(exact, cu, cp_size=2, cp_rank=1, dim=2)).abs().max().item() <= bound


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_flex_kernel_is_refused_without_cuda_naming_the_config_key():
    with pytest.raises(ValueError, match=r"actor\.attention_kernel=flex needs a CUDA GPU"):
        attention.check_attention_kernel("flex")
    with pytest.raises(ValueError, match=r"actor\.attention_kernel='dense': allowed sdpa, flex"):
        attention.check_attention_kernel("dense")


# --- the flex BlockMask built from the blocks (no [T, T] grid) ----------------------------------------


def _mask_pairs(mask) -> torch.Tensor:
    """The [Tq, Tk] attention a FlexAttention kernel computes with `mask`: full blocks attend everywhere,
    partial blocks where mask_mod says so, the others nowhere (the BlockMask's own to_dense() gives the
    block level; mask_mod is evaluated on the partial blocks only, as the kernels do)."""
    tq, tk = mask.seq_lengths
    bq, bk = mask.BLOCK_SIZE
    partial = torch.zeros_like(mask.to_dense()[0, 0], dtype=torch.bool)
    for r in range(partial.size(0)):
        partial[r, mask.kv_indices[0, 0, r, : mask.kv_num_blocks[0, 0, r]].long()] = True
    full = mask.to_dense()[0, 0].bool() & ~partial
    q = torch.arange(partial.size(0) * bq)
    k = torch.arange(partial.size(1) * bk)
    zero = torch.zeros((), dtype=torch.int64)
    by_mod = mask.mask_mod(zero, zero, q[:, None], k[None, :])
    expand = lambda b: b.repeat_interleave(bq, 0).repeat_interleave(bk, 1)  # noqa: E731
    pairs = expand(full) | (expand(partial) & by_mod)
    return pairs[:tq, :tk]


@pytest.mark.parametrize("block_size", [4, 8, 128])
@pytest.mark.parametrize(
    "cu,cp_size", [([0, 5, 6, 13, 14], 1), ([0, 3, 11, 40, 41, 64], 1), ([0, 12, 16, 36], 2), ([0, 24, 36, 60], 3)]
)
def test_flex_block_mask_equals_dense_document_mask(cu, cp_size, block_size):
    """Token level: what the kernel attends equals the dense document-causal mask (CP: each rank's
    load-balanced chunks against the gathered keys). Block level: the tables equal what torch's
    create_block_mask makes by evaluating the mask over the whole [Tq, Tk] grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = cu[-1] if cp_size > 1 else cu[-1] + 3  # cp = 1: a 3-token padding tail outside cu
    for rank in range(cp_size):
        blocks = document_blocks(cu, total // cp_size, cp_size=cp_size, cp_rank=rank)
        mask = attention.document_block_mask(blocks, key_tokens=total, device="cpu", block_size=block_size)
        dense = (
            cp_causal_mask(cu, cp_size=cp_size, cp_rank=rank)
            if cp_size > 1
            else block_causal_mask(torch.tensor(cu), total)
        )
        assert mask.seq_lengths == tuple(dense.shape)
        assert torch.equal(_mask_pairs(mask), dense)
        reference = create_block_mask(
            lambda b, h, q, k, dense=dense: dense[q, k], None, None, *dense.shape, device="cpu", BLOCK_SIZE=block_size
        )
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "q_num_blocks",
            "q_indices",
            "full_q_num_blocks",
            "full_q_indices",
        ):
            assert torch.equal(getattr(mask, name), getattr(reference, name)), name
    # not vacuous: documents of several small blocks give full blocks (mask_mod skipped) and partial ones
    if block_size == 4 and cu[-1] >= 36:
        assert mask.full_kv_num_blocks.sum() > 0 and mask.kv_num_blocks.sum() > 0


_MASK_MEMORY_PROBE = """
import resource, sys
import torch
from torch.nn.attention.flex_attention import BlockMask  # imports before the baseline
from dapo_megatron.actor.attention import document_blocks, document_block_mask
tokens, doc = int(sys.argv[1]), int(sys.argv[2])
blocks = document_blocks(list(range(0, tokens + 1, doc)), tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = document_block_mask(blocks, key_tokens=tokens, device="cpu")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, int(mask.full_kv_num_blocks.sum()), int(mask.kv_num_blocks.sum()))
"""


def test_flex_block_mask_of_65536_tokens_costs_under_half_a_gib():
    """Peak resident memory of a fresh process while it builds the mask of 65,536 tokens of 2,048-token
    documents: any [T, T] evaluation (create_block_mask's: 32 GiB of int64 indices; even a bool grid is
    4 GiB) would show in the peak RSS. Measured in a subprocess so that the pytest process's own earlier
    peak cannot hide it."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MASK_MEMORY_PROBE, "65536", "2048"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    extra, full, partial = (int(x) for x in out.stdout.split())
    assert extra <= 0.5 * 2**30, f"building the mask raised the peak RSS by {extra / 2**30:.2f} GiB"
    # 32 documents of 16 blocks of 128: per document 16 * 15 / 2 full blocks below the diagonal, 16 partial on it
    assert (full, partial) == (32 * 120, 32 * 16)

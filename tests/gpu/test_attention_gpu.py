"""The torch attention backend's CUDA branches (actor/attention.py), where a GPU is lent: the lower-right
causal blocks of CP chunks through causal_lower_right (flash, bf16) and FlexAttention with a document
BlockMask (compiled, forward and backward) against the same blocks in float32 on the GPU, and the saved
bytes at 4K vs 32K tokens (linear).

    pytest tests/gpu/test_attention_gpu.py
"""

import pytest
import torch

from dapo_megatron.actor import attention
from dapo_megatron.actor.attention import blockwise_attention, document_blocks
from dapo_megatron.actor.context_parallel import split_for_cp

pytestmark = pytest.mark.gpu


def _qkv(total, dtype, *, heads=12, groups=2, dim=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, h, total, dim, generator=gen, device="cuda", dtype=dtype) for h in (heads, groups, groups)]


def _run(fn, q, k, v):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    out.float().square().sum().backward()
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_cp_chunks_in_bf16_match_fp32_blocks(kernel):
    cu = [0, 1024, 1536, 4096]
    q, k, v = _qkv(4096, torch.float32)
    blocks = document_blocks(cu, 2048, cp_size=2, cp_rank=1)
    q_local = split_for_cp(q, cu, cp_size=2, cp_rank=1, dim=2)
    ref = _run(lambda q, k, v: blockwise_attention(q, k, v, blocks, scale=128**-0.5), q_local, k, v)
    if kernel == "sdpa":
        fn = lambda q, k, v: blockwise_attention(q, k, v, blocks, scale=128**-0.5)  # noqa: E731
    else:
        mask = attention.document_block_mask(blocks, key_tokens=4096, device="cuda")
        fn = lambda q, k, v: attention.flex_document_attention(q, k, v, mask, scale=128**-0.5)  # noqa: E731
    got = _run(fn, *(x.bfloat16() for x in (q_local, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-2 * scale, name  # bf16 inputs: ~3 significant digits


def test_saved_bytes_are_linear_on_the_gpu():
    from torch.autograd.graph import saved_tensors_hooks

    def saved(total):
        q, k, v = (x.bfloat16().requires_grad_(True) for x in _qkv(total, torch.float32))
        blocks = document_blocks([0, total // 2, total], total)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            blockwise_attention(q, k, v, blocks, scale=128**-0.5)
        return sum(storages.values())

    assert saved(32768) / saved(4096) <= 8.5


# --- the varlen kernel (actor/attention_varlen.py): torch's flash varlen_attn vs its CPU tests' twin ------------


def _varlen_rank_calls(q, k, v, bounds, *, cp_size, fn, return_lse=False):
    """Every CP rank's varlen call as the backend builds it (tests/unit/test_attention_varlen.py's helper, on
    CUDA tensors [T, h, d]): local queries, the all-gathered K/V in gather order; -> per rank (out, lse)."""
    from dapo_megatron.actor.attention_varlen import varlen_document_attention, varlen_layout
    from dapo_megatron.actor.context_parallel import gathered_to_token_order

    order = gathered_to_token_order(bounds, cp_size=cp_size) if cp_size > 1 else None
    gathered = [
        torch.cat([split_for_cp(x, bounds, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]) for x in (k, v)
    ]
    results = []
    for rank in range(cp_size):
        blocks = document_blocks(bounds, q.size(0) // cp_size, cp_size=cp_size, cp_rank=rank)
        layout = varlen_layout(blocks, device="cuda", gather_order=order)
        q_local = split_for_cp(q, bounds, cp_size=cp_size, cp_rank=rank)
        results.append(
            varlen_document_attention(q_local, *gathered, layout, scale=128**-0.5, fn=fn, return_lse=return_lse)
        )
    return results


VARLEN_LAYOUTS = [([0, 1, 1025, 1537, 4096], 1), ([0, 1024, 1536, 4096], 2), ([0, 1536, 1542, 4098], 3)]


@pytest.mark.parametrize("bounds,cp_size", VARLEN_LAYOUTS)
def test_varlen_attn_matches_the_twin_forward_lse_and_backward(bounds, cp_size):
    """The real kernel (bf16) against the float64 twin on the same bf16 inputs: output, logsumexp (shape
    and values) and the gradients; the construction is the backend's, so a wrong causal alignment or a
    wrong cu_seq_k shows here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dapo_megatron.actor.attention_varlen import torch_varlen_attn
    from varlen_twin import varlen_attn_twin

    total = bounds[-1]
    q, k, v = (x[0].transpose(0, 1).contiguous().bfloat16() for x in _qkv(total, torch.float32))
    real = _varlen_rank_calls(q, k, v, bounds, cp_size=cp_size, fn=torch_varlen_attn(), return_lse=True)
    twin = _varlen_rank_calls(q, k, v, bounds, cp_size=cp_size, fn=varlen_attn_twin, return_lse=True)
    for rank, ((out, lse), (out_t, lse_t)) in enumerate(zip(real, twin)):
        assert lse.shape == lse_t.shape, f"varlen_attn's lse is {tuple(lse.shape)}, the twin's {tuple(lse_t.shape)}"
        scale = out_t.float().abs().max().item()
        assert (out.float() - out_t.float()).abs().max().item() <= 2e-2 * scale, rank
        assert (lse.float() - lse_t.float()).abs().max().item() <= 2e-2, rank

    def grads(fn):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        outs = _varlen_rank_calls(*xs, bounds, cp_size=cp_size, fn=fn)
        sum(o.float().square().sum() for o in outs).backward()
        return [x.grad.float() for x in xs]

    for name, a, b in zip(("dq", "dk", "dv"), grads(torch_varlen_attn()), grads(varlen_attn_twin)):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item(), name


@pytest.mark.parametrize("bounds,cp_size", VARLEN_LAYOUTS)
def test_varlen_in_bf16_matches_sdpa_blocks_in_fp32(bounds, cp_size):
    """The varlen kernel against the sdpa kernel's blocks in fp32 (the same comparison as the other kernels)."""
    from dapo_megatron.actor.attention_varlen import torch_varlen_attn

    total = bounds[-1]
    q, k, v = _qkv(total, torch.float32)
    rank = cp_size - 1
    blocks = document_blocks(bounds, total // cp_size, cp_size=cp_size, cp_rank=rank)
    q_local = split_for_cp(q, bounds, cp_size=cp_size, cp_rank=rank, dim=2)
    ref = _run(lambda q, k, v: blockwise_attention(q, k, v, blocks, scale=128**-0.5), q_local, k, v)

    def varlen(q_full, k, v):  # [1, h, T, d] in and out, this rank's queries only
        thd = [x[0].transpose(0, 1) for x in (q_full, k, v)]
        outs = _varlen_rank_calls(*thd, bounds, cp_size=cp_size, fn=torch_varlen_attn())
        return outs[rank].transpose(0, 1)[None]

    got = _run(varlen, *(x.bfloat16() for x in (q, k, v)))
    # q's gradient covers every rank's rows in `got` but only this rank's in `ref`: compare that rank's rows
    local = split_for_cp(torch.arange(total, device="cuda"), bounds, cp_size=cp_size, cp_rank=rank)
    got[1] = got[1][:, :, local]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item(), name

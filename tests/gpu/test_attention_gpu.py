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

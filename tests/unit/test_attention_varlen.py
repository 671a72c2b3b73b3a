"""The `varlen` attention kernel (actor/attention_varlen.py) on CPU. torch's varlen_attn is CUDA-only, so its
place is taken by a TWIN (tests/varlen_twin.py: a float64 reference of varlen_attn's documented semantics,
checked against the real kernel by tests/gpu/test_attention_gpu.py where a GPU is lent). The twin is called
through the SAME argument construction the backend uses (varlen_layout: cu_seqlens, max lengths, the CP
key layout; varlen_kwargs: the signature decisions), and the result is compared in float64 to 1e-12 with
per-document SDPA (blockwise_attention, the `sdpa` kernel) and the dense-mask reference, outputs and
gradients, for packed layouts with documents of length 1, padding tails, CP = 2 and 3, GQA, and both the
torch 2.13 signature and the first releases' (no enable_gqa: K/V repeated; no scale)."""

import types

import pytest
import torch

from attention_reference import block_causal_mask, dense_attention
from dapo_megatron.actor import attention, attention_varlen
from dapo_megatron.actor.attention import blockwise_attention, document_blocks
from dapo_megatron.actor.attention_varlen import varlen_document_attention, varlen_kwargs, varlen_layout
from dapo_megatron.actor.context_parallel import gathered_to_token_order, merge_from_cp, split_for_cp
from varlen_twin import varlen_attn_twin, varlen_attn_twin_early

TOL64 = dict(atol=1e-12, rtol=0)
# twin, softmax scale: the first releases take no scale, so the model's must be their default 1/sqrt(d)
TWINS = {
    "torch 2.13 signature": (varlen_attn_twin, 0.3),
    "first releases' signature": (varlen_attn_twin_early, 8**-0.5),
}


def test_twin_by_hand():
    # one sequence of 2 queries against 3 keys (bottom-right causal: query 0 sees keys 0-1, query 1 all 3);
    # zero queries give equal scores, so each output is the mean of the values it sees, lse = log(count)
    q = torch.zeros(2, 1, 4, dtype=torch.float64)
    k = torch.randn(3, 1, 4, dtype=torch.float64)
    v = torch.tensor([[1.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 3.0, 0]], dtype=torch.float64)[:, None]
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    aux = types.SimpleNamespace(lse=True)
    out, lse = varlen_attn_twin(q, k, v, cu_q, cu_k, 2, 3, window_size=(-1, 0), return_aux=aux)
    torch.testing.assert_close(out[:, 0], torch.tensor([[0.5, 1.0, 0, 0], [1 / 3, 2 / 3, 1.0, 0]], dtype=torch.float64))
    torch.testing.assert_close(lse, torch.tensor([[2.0, 3.0]]).log())
    # without the mask every query sees the three keys
    out = varlen_attn_twin(q, k, v, cu_q, cu_k, 2, 3)
    torch.testing.assert_close(out[:, 0], torch.tensor([[1 / 3, 2 / 3, 1.0, 0]] * 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="beyond max_q=1"):
        varlen_attn_twin(q, k, v, cu_q, cu_k, 1, 3)
    with pytest.raises(ValueError, match="int32"):
        varlen_attn_twin(q, k, v, cu_q.long(), cu_k, 2, 3)


def test_layout_by_hand():
    # documents of 3, 1 and 2 tokens, then a 2-token tail not in the boundaries: square blocks, keys in place
    layout = varlen_layout(document_blocks([0, 3, 4, 6], 8), device="cpu")
    assert layout.cu_seq_q.tolist() == layout.cu_seq_k.tolist() == [0, 3, 4, 6, 8]
    assert layout.cu_seq_q.dtype == torch.int32 and (layout.max_q, layout.max_k) == (3, 3)
    assert layout.key_index is None
    # cp=2, documents of 8 and 4 tokens, rank 1: chunks 1 and 2 of each (lengths 2 and 1); chunk c of a
    # document starting at s sees keys [s, s + (c+1) n): key runs 0-3, 0-5, 8-9, 8-10 (token order)
    bounds = [0, 8, 12]
    order = gathered_to_token_order(bounds, cp_size=2)
    layout = varlen_layout(document_blocks(bounds, 6, cp_size=2, cp_rank=1), device="cpu", gather_order=order)
    assert layout.cu_seq_q.tolist() == [0, 2, 4, 5, 6]
    assert layout.cu_seq_k.tolist() == [0, 4, 10, 12, 15]
    assert (layout.max_q, layout.max_k) == (2, 6)
    runs = [*range(4), *range(6), 8, 9, 8, 9, 10]
    assert layout.key_index.tolist() == order[runs].tolist()
    # gather order: rank 0 holds tokens 0 1 6 7 8 11, rank 1 holds 2 3 4 5 9 10
    assert order.tolist() == [0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]


def test_kwargs_follow_the_signature_not_the_version():
    from torch.nn.attention.varlen import varlen_attn

    kwargs, repeat = varlen_kwargs(varlen_attn, scale=0.25, head_dim=16, gqa=True, lse=False)
    assert kwargs == {"window_size": (-1, 0), "scale": 0.25, "enable_gqa": True} and not repeat
    kwargs, repeat = varlen_kwargs(varlen_attn_twin_early, scale=16**-0.5, head_dim=16, gqa=True, lse=False)
    assert kwargs == {"is_causal": True} and repeat
    with pytest.raises(ValueError, match="actor.attention_kernel=varlen: this torch's varlen_attn has no scale"):
        varlen_kwargs(varlen_attn_twin_early, scale=0.3, head_dim=16, gqa=False, lse=False)


def _qkv(total, *, heads, groups, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(total, heads, dim), (total, groups, dim), (total, groups, dim), (total, heads, dim)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]  # q, k, v, d loss / d out


def _varlen_full(q, k, v, bounds, *, cp_size, twin, scale):
    """Every CP rank's varlen call as the backend builds it (its local queries, the all-gathered K/V in gather
    order), merged back to token order: [T, h, d]."""
    if cp_size == 1:
        layout = varlen_layout(document_blocks(bounds, q.size(0)), device="cpu")
        return varlen_document_attention(q, k, v, layout, scale=scale, fn=twin)
    order = gathered_to_token_order(bounds, cp_size=cp_size)
    gathered = [
        torch.cat([split_for_cp(x, bounds, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]) for x in (k, v)
    ]
    parts = []
    for rank in range(cp_size):
        local = q.size(0) // cp_size
        blocks = document_blocks(bounds, local, cp_size=cp_size, cp_rank=rank)
        layout = varlen_layout(blocks, device="cpu", gather_order=order)
        q_local = split_for_cp(q, bounds, cp_size=cp_size, cp_rank=rank)
        parts.append(varlen_document_attention(q_local, *gathered, layout, scale=scale, fn=twin))
    return merge_from_cp(parts, bounds)


def _grads(fn, q, k, v, weight):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


LAYOUTS = {
    # bounds, total tokens, cp
    "length-1 documents and a padding tail": ([0, 5, 6, 13, 14], 17, 1),
    "only length-1 documents": ([0, 1, 2, 3, 4], 4, 1),
    "one document": ([0, 12], 12, 1),
    "cp=2, a 4-token document (chunks of 1)": ([0, 8, 12, 20, 24], 24, 2),
    "cp=3, a 6-token document (chunks of 1) and a padding segment": ([0, 12, 18, 30, 36], 36, 3),
}


@pytest.mark.parametrize("twin_name", sorted(TWINS))
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_varlen_construction_equals_per_document_sdpa(layout_name, heads, groups, twin_name):
    bounds, total, cp_size = LAYOUTS[layout_name]
    q, k, v, weight = _qkv(total, heads=heads, groups=groups)
    twin, scale = TWINS[twin_name]
    got = _grads(
        lambda q, k, v: _varlen_full(q, k, v, bounds, cp_size=cp_size, twin=twin, scale=scale), q, k, v, weight
    )

    def per_document_sdpa(q, k, v):  # the `sdpa` kernel over the whole batch, [1, h, T, d]
        blocks = document_blocks(bounds, total)
        out = blockwise_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), blocks, scale=scale)
        return out[0].transpose(0, 1)

    def dense(q, k, v):
        mask = block_causal_mask(torch.tensor(bounds), total)
        out = dense_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), mask, scale=scale)
        return out[0].transpose(0, 1)

    for reference in (per_document_sdpa, dense):
        ref = _grads(reference, q, k, v, weight)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, b, **TOL64, msg=f"{name} vs {reference.__name__}")


class _StandInConfig(types.SimpleNamespace):
    """A stand-in for megatron's TransformerConfig: the three fields TorchSDPAttention reads at cp = 1."""


def test_module_varlen_path_equals_sdpa_path_through_the_twin(monkeypatch):
    """TorchSDPAttention(kernel=varlen) on CPU with the twin in varlen_attn's place (CUDA check lifted for
    this test only): the THD and the [s, b, h, d] paths equal the sdpa kernel's."""
    from megatron.core.packed_seq_params import PackedSeqParams

    monkeypatch.setattr(attention_varlen, "torch_varlen_attn", lambda: varlen_attn_twin)
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: True)
    config = _StandInConfig(kv_channels=8, context_parallel_size=1, attention_dropout=0.0)
    make = lambda kernel: attention.TorchSDPAttention(config, 1, None, "self", kernel=kernel)  # noqa: E731
    varlen, sdpa = make("varlen"), make("sdpa")
    q, k, v, _ = _qkv(11, heads=4, groups=2)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)  # a 2-token tail past the boundaries
    params = lambda: PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)  # noqa: E731
    torch.testing.assert_close(
        varlen(q, k, v, None, packed_seq_params=params()), sdpa(q, k, v, None, packed_seq_params=params()), **TOL64
    )
    # [s, b, h, d]: two rows of 11 tokens, one causal sequence each
    q2, k2, v2 = (torch.stack([x, x.flip(0)], dim=1) for x in (q, k, v))
    torch.testing.assert_close(varlen(q2, k2, v2, None), sdpa(q2, k2, v2, None), **TOL64)


def test_varlen_is_refused_without_cuda_naming_the_key():
    with pytest.raises(ValueError, match="actor.attention_kernel=varlen needs a CUDA GPU"):
        attention.check_attention_kernel("varlen")
    from dapo_megatron.config import load_config
    from dapo_megatron.launch.local.launcher import check_attention_kernel_device

    with pytest.raises(ValueError, match="actor.attention_kernel=varlen needs a CUDA GPU and this machine has none"):
        check_attention_kernel_device(
            load_config(None, ["actor.attention_kernel=varlen", "actor.attention_backend=torch"]).actor
        )

    with pytest.raises(ValueError, match="actor.attention_kernel.*varlen only with actor.attention_backend=torch"):
        load_config(None, ["actor.attention_kernel=varlen", "actor.attention_backend=te"])


def test_set_attention_kernel_switches_every_layer_and_keeps_the_checks(monkeypatch):
    """The actor bench measures several kernels on one built model (attention.set_attention_kernel)."""
    config = _StandInConfig(kv_channels=8, context_parallel_size=1, attention_dropout=0.0)
    chunk = torch.nn.ModuleList([attention.TorchSDPAttention(config, i, None, "self") for i in (1, 2)])
    with pytest.raises(ValueError, match="actor.attention_kernel=varlen needs a CUDA GPU"):
        attention.set_attention_kernel([chunk], "varlen")
    assert [m.kernel for m in chunk] == ["sdpa", "sdpa"]  # refused before any layer changed
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: True)
    assert attention.set_attention_kernel([chunk], "varlen") == 2
    assert [m.kernel for m in chunk] == ["varlen", "varlen"]
    chunk[0].dropout_p = 0.1
    with pytest.raises(ValueError, match="actor.attention_kernel=flex: the kernel has no attention dropout"):
        attention.set_attention_kernel([chunk], "flex")

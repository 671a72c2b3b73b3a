"""The `varlen` attention kernel of the torch backend (actor.attention_kernel=varlen, CUDA only): every
document of a packed micro-batch in ONE flash-attention launch per layer and direction, through torch's
`torch.nn.attention.varlen.varlen_attn` (cu_seqlens in, logsumexp out), instead of one SDPA call per
document (the `sdpa` kernel's Python loop).

The call is built from the same query blocks as the other kernels (attention.document_blocks): block i is
the n_i query rows [q_start, q_end) (local order) that see the m_i keys [k_start, k_end) (token order), the
queries being the LAST n_i positions of that key range. varlen_attn takes sequences laid end to end:

    cu_seq_q = [0, n_0, n_0 + n_1, ...]       the blocks are contiguous in local order already
    cu_seq_k = [0, m_0, m_0 + m_1, ...]       the keys of block i are rows cu_seq_k[i] .. cu_seq_k[i+1]
    max_q, max_k                               Python ints: computed on the host from the blocks (which
                                               come from the packing plan's host boundaries), once per
                                               micro-batch; no .item()/.tolist() on a device tensor
    causal                                     aligned at the BOTTOM RIGHT when n_i < m_i (below)

cp = 1: block i is document i, square (n_i = m_i, k range = q range), so the packed K/V are used as they
are (no copy). cp > 1: rank r holds chunks r and 2cp-1-r of every document; chunk c (length n) of a document
starting at s sees keys [s, s + (c+1) n), so the two blocks of a document share their first keys and their
key ranges overlap: varlen_attn cannot express overlapping ranges through cu_seq_k, so the keys are laid out
block by block with one index_select (`key_index`, composed with the all-gather's token order: one gather of
(2cp+1)/(2cp) of the gathered K/V, a few MB per layer at 24K tokens with 2 KV heads; its backward scatters
dK/dV back, and both blocks' contributions to a shared key add up).

Causal alignment, from the torch and flash-attention sources: torch/nn/attention/bias.py sends a
causal_lower_right mask to the flash kernel as `_scaled_dot_product_flash_attention(..., is_causal=True)`
with the comment "Flash accepts causal = True and for this particular op it means lower right"; flash-
attention 2 (from 2.1, the version aten carries) documents "If causal=True, the causal mask is aligned to
the bottom right corner of the attention matrix" for seqlen_q != seqlen_k. varlen_attn reaches the same
`_flash_attention_forward` with is_causal (window_size == (-1, 0) in torch 2.13; an is_causal keyword in
the first releases). Bottom right: query j (0-based, of n) sees key t (of m) iff t <= j + (m - n), i.e. the
last query sees every key, which is exactly the block's meaning. tests/unit/test_attention_varlen.py checks
the construction through a float64 twin of these semantics, tests/gpu/test_attention_gpu.py the real kernel
against the twin.

Signatures (decided by inspecting the installed function, never by the version string):
  causal       window_size=(-1, 0) where the function takes window_size, else is_causal=True
  scale        passed where taken; where not, the kernel's default 1/sqrt(d) must be the model's scale
  GQA          enable_gqa=True where taken; where not, K/V heads are repeated to the query heads
               (repeat_interleave: query head h reads KV head h // (h_q / h_kv), SDPA's GQA mapping)
No dropout (varlen_attn hard-codes 0): refused at model build like flex.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from dapo_megatron.actor.staging import to_device

VarlenFn = Callable[..., object]


@dataclass(frozen=True)
class VarlenLayout:
    """The arguments of one varlen_attn call besides q, k, v (built once per micro-batch, shared by layers).

    key_index: rows of the key tensor to lay the blocks' keys end to end (None: the keys are already laid
    out so, cp = 1); with cp > 1 it indexes the all-gathered K/V in gather order (rank 0's tokens, then rank
    1's, ...), the token order composed in."""

    cu_seq_q: torch.Tensor  # int32 [blocks + 1], on the attention's device
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int
    key_index: torch.Tensor | None


def varlen_layout(blocks: Sequence, *, device, gather_order: torch.Tensor | None = None) -> VarlenLayout:
    """The varlen_attn arguments of query blocks (attention.document_blocks); host arithmetic only, then
    pinned non-blocking copies. gather_order: the index putting the all-gathered K/V in token order
    (context_parallel.gathered_to_token_order, on the host) with cp > 1, None with cp = 1."""
    q_lengths = [b.q_end - b.q_start for b in blocks]
    k_lengths = [b.k_end - b.k_start for b in blocks]
    expected_q = 0
    for b, n, m in zip(blocks, q_lengths, k_lengths):
        if b.q_start != expected_q or not 0 < n <= m:
            raise ValueError(f"varlen: query block {b} is not contiguous after row {expected_q} or sees fewer keys")
        expected_q = b.q_end
    in_place = all(b.k_start == b.q_start and b.k_end == b.q_end for b in blocks)
    key_index = None
    if not in_place:
        rows = torch.cat([torch.arange(b.k_start, b.k_end, dtype=torch.int64) for b in blocks])
        if gather_order is not None:
            rows = gather_order.cpu()[rows]
        key_index = to_device(rows, device)
    cu_q = torch.tensor([0, *accumulate(q_lengths)], dtype=torch.int32)
    cu_k = torch.tensor([0, *accumulate(k_lengths)], dtype=torch.int32)
    return VarlenLayout(
        cu_seq_q=to_device(cu_q, device),
        cu_seq_k=to_device(cu_k, device),
        max_q=max(q_lengths, default=0),
        max_k=max(k_lengths, default=0),
        key_index=key_index,
    )


@functools.lru_cache(maxsize=8)
def _parameters(fn: VarlenFn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def torch_varlen_attn() -> VarlenFn:
    """torch's varlen_attn (torch >= 2.9); a clear error where the installed torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        raise ValueError(
            f"actor.attention_kernel=varlen needs torch.nn.attention.varlen (torch >= 2.9; installed "
            f"{torch.__version__}): use actor.attention_kernel=sdpa ({err})"
        ) from None
    return varlen_attn


def varlen_kwargs(fn: VarlenFn, *, scale: float, head_dim: int, gqa: bool, lse: bool) -> tuple[dict, bool]:
    """(keyword arguments for `fn`, whether K/V heads must be repeated) for a causal call, from fn's signature."""
    params = _parameters(fn)
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise ValueError(f"{fn.__module__}.{fn.__qualname__} takes neither window_size nor is_causal: no causal mask")
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5, rel_tol=1e-12):
        raise ValueError(
            f"actor.attention_kernel=varlen: this torch's varlen_attn has no scale argument and the model's "
            f"softmax scale {scale} is not 1/sqrt({head_dim}): use actor.attention_kernel=sdpa"
        )
    repeat = gqa and "enable_gqa" not in params
    if gqa and not repeat:
        kwargs["enable_gqa"] = True
    if lse:
        from torch.nn.attention.varlen import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    return kwargs, repeat


def varlen_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: VarlenLayout,
    *,
    scale: float,
    fn: VarlenFn | None = None,
    return_lse: bool = False,
):
    """Document-causal attention of packed rows: q [Tq, h, d] in local order, k, v [Tk, g, d] (token order
    with cp = 1; the all-gathered tensor in gather order with cp > 1, layout.key_index picks the rows);
    returns out [Tq, h, d] (and the logsumexp varlen_attn returns with it, when return_lse).
    fn: varlen_attn (default, CUDA) or a twin with one of its signatures (the CPU tests)."""
    fn = fn or torch_varlen_attn()
    if layout.key_index is not None:
        k, v = k.index_select(0, layout.key_index), v.index_select(0, layout.key_index)
    gqa = q.size(1) != k.size(1)
    kwargs, repeat = varlen_kwargs(fn, scale=scale, head_dim=q.size(-1), gqa=gqa, lse=return_lse)
    if repeat:
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return fn(q, k, v, layout.cu_seq_q, layout.cu_seq_k, layout.max_q, layout.max_k, **kwargs)

"""A float64 TWIN of torch's `torch.nn.attention.varlen.varlen_attn` (the flash varlen kernel), for the CPU
tests of the `varlen` attention kernel (actor/attention_varlen.py): varlen_attn runs on CUDA only, so the
CPU tests call this twin through the same argument construction the backend uses, and
tests/gpu/test_attention_gpu.py checks the twin against the real kernel where a GPU is lent.

What it reproduces (torch 2.13's torch/nn/attention/varlen.py and the flash kernel it calls):
  - query [Tq, Hq, D], key / value [Tk, Hkv, D]; sequence i is query rows cu_seq_q[i]:cu_seq_q[i+1] against
    key rows cu_seq_k[i]:cu_seq_k[i+1]; cu_seq_* int32 (flash refuses other dtypes)
  - window_size (-1, 0) = causal, aligned at the BOTTOM RIGHT when a sequence has n queries and m >= n keys:
    query j sees key t iff t <= j + (m - n) (flash-attention >= 2.1; torch's bias.py relies on it);
    (-1, -1) = no mask
  - scale default 1/sqrt(D); GQA with enable_gqa (query head h reads KV head h // (Hq / Hkv)), refused
    without it when the head counts differ (varlen_attn's own check)
  - max_q / max_k size the kernel's grid: a sequence longer than them would be silently cut by the real
    kernel, so the twin refuses it (the construction under test must get them right)
  - return_aux=AuxRequest(lse=True): also the logsumexp, float32 [Hq, Tq] (the shape of varlen_attn's
    registered fake: "logsumexp shape: (num_heads, total_q)"; its docstring says (T_q, H_q), and the GPU
    test says which the kernel returns)
Not modelled: a sequence with more queries than keys under the causal mask (rows with no key), which the
construction never makes; the twin refuses it.
Outputs in the query's dtype, computed in float64, differentiable (autograd through the float64 maths).
"""

from __future__ import annotations

import torch


def varlen_attn_twin(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """torch 2.13's varlen_attn signature (the parts the backend uses)."""
    heads, groups, dim = query.size(1), key.size(1), query.size(2)
    if not enable_gqa and heads != groups:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got {heads} and {groups}")
    if heads % groups:
        raise ValueError(f"query heads {heads} are not a multiple of KV heads {groups}")
    if tuple(window_size) not in ((-1, 0), (-1, -1)):
        raise NotImplementedError(f"window_size {window_size}: the twin models causal and full attention only")
    causal = tuple(window_size) == (-1, 0)
    for name, cu, rows in (("cu_seq_q", cu_seq_q, query.size(0)), ("cu_seq_k", cu_seq_k, key.size(0))):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor (got {cu.dtype}, {cu.dim()}-D)")
        if int(cu[0]) != 0 or int(cu[-1]) != rows or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} {cu.tolist()} does not run from 0 to {rows} in order")
    if cu_seq_q.numel() != cu_seq_k.numel():
        raise ValueError("cu_seq_q and cu_seq_k describe different numbers of sequences")
    scale = dim**-0.5 if scale is None else scale
    q64, k64, v64 = (x.double() for x in (query, key, value))
    k64, v64 = (x.repeat_interleave(heads // groups, dim=1) for x in (k64, v64))
    outs, lses = [], []
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        n, m = q1 - q0, k1 - k0
        if n > max_q or m > max_k:
            raise ValueError(f"sequence {i}: {n} queries / {m} keys beyond max_q={max_q} / max_k={max_k}")
        if n == 0:
            continue
        if causal and n > m:
            raise NotImplementedError(f"sequence {i}: {n} queries against {m} keys under the causal mask")
        scores = torch.einsum("nhd,mhd->hnm", q64[q0:q1], k64[k0:k1]) * scale
        if causal:
            visible = torch.arange(m, device=query.device)[None, :] <= torch.arange(n, device=query.device)[:, None] + (
                m - n
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [h, n]
        probs = torch.exp(scores - lse[..., None])
        outs.append(torch.einsum("hnm,mhd->nhd", probs, v64[k0:k1]))
        lses.append(lse)
    out = torch.cat(outs).to(query.dtype) if outs else query.new_zeros(query.shape)
    if return_aux is not None and return_aux.lse:
        lse = torch.cat(lses, dim=1).float() if lses else query.new_zeros(heads, 0, dtype=torch.float32)
        return out, lse
    return out


def varlen_attn_twin_early(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """The first releases' signature (is_causal keyword; no scale, no window_size, no enable_gqa): the
    backend must then repeat K/V heads itself and rely on the default 1/sqrt(D) scale."""
    return varlen_attn_twin(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        return_aux=return_aux,
        window_size=(-1, 0) if is_causal else (-1, -1),
    )

"""The torch attention backend's core attention: packed (THD) and context-parallel causal attention in
O(T) memory, without Transformer Engine and without any [T, T] tensor.

A packed micro-batch is documents (padded segments, cu_seqlens_q_padded) laid end to end; a token attends
to the tokens of its own document at or before its position. Instead of a dense block-diagonal mask
(which SDPA turns into a [heads, T, T] score matrix), the queries are cut into *query blocks*: contiguous
query rows that belong to one document, each with the contiguous key range it may see (`document_blocks`):

    cp = 1     one block per document: queries [s, e), keys [s, e), square causal (is_causal=True)
    cp > 1     rank r holds chunks r and 2cp-1-r of every document (context_parallel.py); chunk c of a
               document starting at s (chunk length n) is queries [s + c n, s + (c+1) n) against keys
               [s, s + (c+1) n) of the all-gathered K/V: causal aligned at the LOWER RIGHT (the last query
               sees every key), square only for c = 0

Three kernels (actor.attention_kernel):
  sdpa  (default) one torch scaled_dot_product_attention call per query block, GQA through enable_gqa (no
        repeat_interleave copies of K/V). Square blocks use is_causal=True: the flash kernels on GPUs, the
        flash-for-CPU kernel on CPU; both keep q, k, v, out and the fp32 logsumexp for the backward (O(T)).
        Lower-right blocks (CP chunks that start inside their document) use
        torch.nn.attention.bias.causal_lower_right on CUDA in bf16/fp16, which runs the flash kernel;
        elsewhere (CPU, fp32 on GPUs) causal_lower_right would materialise a [n, m] float mask, so the
        queries are front-padded with m - n zero rows instead and the square is_causal kernel runs (the
        padded rows' outputs are dropped; their gradient is zero): exact, O(T) memory, up to cp times the
        attention FLOPs of that rank (the CPU / fp32 path is for tests).
        Cost: a Python loop over documents, per layer, in forward and backward (one kernel launch per
        document and direction): tens of microseconds per document on a GPU, noticeable with many short
        documents per micro-batch; nothing in it is quadratic in T.
  flex  torch FlexAttention with a document-causal BlockMask (one kernel for the whole micro-batch, built
        once per micro-batch and shared by every layer, on the packed and the unpacked path): CUDA only (in
        torch 2.13 its backward raises on CPU), refused at model build on a machine without CUDA. The
        BlockMask is built from the query blocks' key ranges (`document_block_mask`), never by evaluating
        the mask over a [T, T] grid as create_block_mask does (32 GiB at 65,536 tokens).
  varlen torch's varlen_attn (flash varlen): the query blocks as the sequences of ONE flash call per layer
        and direction, cu_seqlens and max lengths built on the host once per micro-batch: CUDA only,
        refused at model build without CUDA; no dropout. actor/attention_varlen.py.

The dense-mask formulation survives only as the tests' reference (tests/attention_reference.py).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dapo_megatron.actor.attention_varlen import (
    VarlenLayout,
    torch_varlen_attn,
    varlen_document_attention,
    varlen_layout,
)
from dapo_megatron.actor.context_parallel import gather_for_cp, gathered_to_token_order
from dapo_megatron.actor.staging import to_device

ATTENTION_KERNELS = ("sdpa", "flex", "varlen")
CUDA_ONLY_KERNELS = {
    "flex": "FlexAttention's backward is not implemented on CPU (torch 2.13)",
    "varlen": "torch's varlen_attn runs the CUDA flash kernel only",
}


@dataclass(frozen=True)
class QueryBlock:
    """Query rows [q_start, q_end) (local order) of one document and the keys [k_start, k_end) (token
    order) they may see; the queries are the last q_end - q_start positions of that key range."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int


def document_blocks(
    bounds: Sequence[int], local_tokens: int, *, cp_size: int = 1, cp_rank: int = 0
) -> list[QueryBlock]:
    """The query blocks of a packed micro-batch of documents with (global, padded) boundaries `bounds`.

    cp_size = 1: tokens past bounds[-1] (an unannounced padding tail) form one more document, so every
    query sees at least itself. cp_size > 1: the local tensor holds chunks r and 2cp-1-r of every
    document (context_parallel.cp_local_indices) and must have exactly bounds[-1] / cp tokens."""
    bounds = [int(x) for x in bounds]
    if cp_size == 1:
        if bounds[-1] < local_tokens:
            bounds = bounds + [local_tokens]
        if bounds[-1] != local_tokens:
            raise ValueError(
                f"packed sequence boundaries end at {bounds[-1]} but the micro-batch has {local_tokens} tokens"
            )
        return [QueryBlock(s, e, s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if bounds[-1] != local_tokens * cp_size:
        raise ValueError(
            f"context parallel: boundaries end at {bounds[-1]} but cp={cp_size} ranks hold {local_tokens} tokens each"
        )
    blocks, offset = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a packed segment of {length} tokens (offset {start}) is not a multiple of "
                f"2*cp = {2 * cp_size}: pad every sequence with seq_pad_multiple=2*cp"
            )
        chunk = length // (2 * cp_size)
        if chunk == 0:
            continue
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            blocks.append(QueryBlock(offset, offset + chunk, start, start + (c + 1) * chunk))
            offset += chunk
    return blocks


def _lower_right_by_flash(query: torch.Tensor) -> bool:
    """causal_lower_right reaches the flash kernel (no materialised mask) only on CUDA in half precision."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def _causal_block(q, k, v, *, scale: float, dropout_p: float) -> torch.Tensor:
    """q [B, h, n, d] = the last n positions of k, v [B, g, m, d] (n <= m); causal aligned at the lower right."""
    n, m = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if n == m:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    if _lower_right_by_flash(q):
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(n, m), dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    # zero queries in front make the block square: query i of the padded block sees keys <= i
    padded = torch.cat([q.new_zeros(q.size(0), q.size(1), m - n, q.size(3)), q], dim=2)
    out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    return out[:, :, m - n :]


def blockwise_attention(q, k, v, blocks: Sequence[QueryBlock], *, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Document-causal attention block by block: q [B, h, Tq, d]; k, v [B, g, Tk, d] in token order;
    returns [B, h, Tq, d]. Every query row must be in exactly one block (document_blocks' blocks are)."""
    outs = [
        _causal_block(
            q[:, :, b.q_start : b.q_end],
            k[:, :, b.k_start : b.k_end],
            v[:, :, b.k_start : b.k_end],
            scale=scale,
            dropout_p=dropout_p,
        )
        for b in blocks
    ]
    if len(outs) == 1:
        return outs[0]
    # concatenated token-major ([B, T, h, d] storage, returned as a [B, h, T, d] view): the callers' move
    # to [T, h*d] is then a view, not a second copy (SDPA's outputs are token-major views as well)
    return torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)


# --- FlexAttention (CUDA) ------------------------------------------------------------------------------

FLEX_BLOCK = 128  # torch's default sparse block (_DEFAULT_SPARSE_BLOCK_SIZE): the kernels' tile multiple


def _row_key_ranges(blocks: Sequence[QueryBlock], rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row (local order, padded to `rows`): the first and the last key it may see (inclusive).
    Row i of block b sees keys [b.k_start, b.k_end - (b.q_end - i)] (lower-right alignment); rows past the
    last block (the padding up to a whole number of query blocks) get the empty range [1, 0]."""
    key_lo = torch.ones(rows, dtype=torch.int64)
    key_hi = torch.zeros(rows, dtype=torch.int64)
    if blocks:
        lengths = torch.tensor([b.q_end - b.q_start for b in blocks], dtype=torch.int64)
        used = int(lengths.sum())
        key_lo[:used] = torch.repeat_interleave(torch.tensor([b.k_start for b in blocks], dtype=torch.int64), lengths)
        # row i's own position: k_end - q_end + i
        shift = torch.tensor([b.k_end - b.q_end for b in blocks], dtype=torch.int64)
        key_hi[:used] = torch.arange(used, dtype=torch.int64) + torch.repeat_interleave(shift, lengths)
    return key_lo.to(device), key_hi.to(device)


def _ordered(dense_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [N] int32, indices [N, K] int32) of a boolean block matrix, the layout create_block_mask
    makes (torch's _dense_to_ordered): each row's set columns first, ascending, then the others."""
    dense = dense_NK.to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def document_block_mask(blocks: Sequence[QueryBlock], *, key_tokens: int, device, block_size: int = FLEX_BLOCK):
    """FlexAttention BlockMask of the same attention as `blocks`: query row i (local) may see key j iff
    j is in its block's key range and j <= its own position (the block's lower-right alignment).

    Built from the blocks directly, never over a [T, T] grid (torch's create_block_mask evaluates
    mask_mod on every (query, key) pair: 32 GiB at 65,536 tokens). Each query row sees ONE contiguous key
    range [lo, hi], so per query block of `block_size` rows (nQ of them; nK key blocks):
      touched key blocks = the union over its rows of [lo // B, hi // B] (a difference array per query
                           block, one scatter-add of two entries per row, a cumulative sum)
      full key blocks    = [max ceil(lo / B), min (hi + 1) // B - 1] over its rows (every pair attends;
                           a block that reaches past key_tokens, or a query block with padding rows, is
                           never full: create_block_mask's rule); mask_mod is skipped there
      partial            = touched and not full; mask_mod decides per pair
    Memory: a few [T] int64 vectors and [nQ, nK] int32 block tables (the layout torch's kernels read:
    1 MiB each at 65,536 tokens). The tables equal create_block_mask's (tests/unit/test_attention_blocks.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    query_tokens = blocks[-1].q_end if blocks else 0
    num_q = max(1, -(-query_tokens // block_size))
    num_k = max(1, -(-key_tokens // block_size))
    # the mask_mod's lookups cover every query row the kernel may evaluate (padded to whole blocks)
    key_lo, key_hi = _row_key_ranges(blocks, num_q * block_size, device)
    seen = key_lo <= key_hi
    row_block = torch.arange(num_q * block_size, device=device) // block_size

    # touched: +1 at (q block, lo // B), -1 at (q block, hi // B + 1), cumulative sum over key blocks > 0
    diff = torch.zeros(num_q * (num_k + 1), dtype=torch.int32, device=device)
    base = row_block * (num_k + 1)
    ones = seen.to(torch.int32)
    diff.index_add_(0, base + torch.where(seen, key_lo // block_size, 0), ones)
    diff.index_add_(0, base + torch.where(seen, key_hi // block_size + 1, 0), -ones)
    touched = diff.view(num_q, num_k + 1).cumsum(-1)[:, :num_k] > 0

    # full: the key blocks inside every row's range, within key_tokens
    full_first = torch.where(seen, -(-key_lo // block_size), num_k).view(num_q, block_size).amax(-1)
    full_last = torch.where(seen, (key_hi + 1) // block_size - 1, -1).view(num_q, block_size).amin(-1)
    full_last = full_last.clamp(max=key_tokens // block_size - 1)
    k_index = torch.arange(num_k, device=device)
    full = (k_index >= full_first[:, None]) & (k_index <= full_last[:, None])
    partial = touched & ~full

    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx >= key_lo[q_idx]) & (kv_idx <= key_hi[q_idx])

    return BlockMask.from_kv_blocks(
        kv_num[None, None],
        kv_idx[None, None],
        full_num[None, None],
        full_idx[None, None],
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(query_tokens, key_tokens),
    )


_COMPILED_FLEX: Callable[..., torch.Tensor] | None = None


def flex_document_attention(q, k, v, block_mask, *, scale: float, compiled: bool = True) -> torch.Tensor:
    """FlexAttention with a document BlockMask; q [B, h, Tq, d], k, v [B, g, Tk, d]. compiled=False runs
    the eager (reference) implementation, which materialises scores: for tests only."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    fn: Callable[..., torch.Tensor] = flex_attention
    if compiled:
        if _COMPILED_FLEX is None:
            # default dynamic-shape policy: packed micro-batches change length every step; after the first
            # recompile the kernel is traced with a symbolic length instead of recompiling per length
            _COMPILED_FLEX = torch.compile(flex_attention)
        fn = _COMPILED_FLEX
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))


def check_attention_kernel(kernel: str) -> None:
    """The clear error for actor.attention_kernel, at model build (before any forward)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"actor.attention_kernel={kernel!r}: allowed {', '.join(ATTENTION_KERNELS)}")
    if kernel in CUDA_ONLY_KERNELS and not torch.cuda.is_available():
        raise ValueError(
            f"actor.attention_kernel={kernel} needs a CUDA GPU: {CUDA_ONLY_KERNELS[kernel]}; "
            "use actor.attention_kernel=sdpa"
        )
    if kernel == "varlen":
        torch_varlen_attn()  # the clear error where this torch has no varlen_attn


# One layout per distinct micro-batch shape, shared by every layer (and by the next micro-batch of the
# same shape): the packed path also caches it on the forward's PackedSeqParams; the unpacked path
# ([0, seq * cp] bounds) has no per-forward object, so every layer would otherwise build its own mask.
_LAYOUT_CACHE: OrderedDict[tuple, tuple] = OrderedDict()
_LAYOUT_CACHE_SIZE = 4


def _attention_layout(bounds: tuple, local_tokens: int, cp_size: int, cp_rank: int, kernel: str, device: torch.device):
    key = (bounds, local_tokens, cp_size, cp_rank, kernel, str(device))
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        _LAYOUT_CACHE.move_to_end(key)
        return hit
    blocks = document_blocks(bounds, local_tokens, cp_size=cp_size, cp_rank=cp_rank)
    order = host_order = None
    if cp_size > 1:
        host_order = gathered_to_token_order(list(bounds), cp_size=cp_size)
        order = to_device(host_order, device)  # pinned, non-blocking: no host sync
    mask: object = None
    if kernel == "flex":
        mask = document_block_mask(blocks, key_tokens=local_tokens * cp_size, device=device)
    elif kernel == "varlen":  # its key_index replaces `order` (the token order composed in)
        mask = varlen_layout(blocks, device=device, gather_order=host_order)
    layout = (order, blocks, mask)
    _LAYOUT_CACHE[key] = layout
    while len(_LAYOUT_CACHE) > _LAYOUT_CACHE_SIZE:
        _LAYOUT_CACHE.popitem(last=False)
    return layout


# --- megatron core attention ---------------------------------------------------------------------------


class TorchSDPAttention(torch.nn.Module):
    """Core attention of the torch backend: drop-in for megatron's DotProductAttention (same constructor and
    forward signature), with packed THD sequences and context parallelism in O(T) memory (module docstring).

    Context parallelism (config.context_parallel_size > 1): the inputs hold this CP rank's tokens only (two
    chunks of every segment, context_parallel.py). K and V are all-gathered over the CP group and put back
    in token order; each local query chunk attends to its document's gathered keys up to its own position.
    megatron-core's cp_comm_type "all_gather"; the other comm types are refused.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        kernel: str = "sdpa",
    ):
        super().__init__()
        from megatron.core import parallel_state

        check_attention_kernel(kernel)
        self.config = config
        self.kernel = kernel
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if kernel in ("flex", "varlen") and self.dropout_p:
            raise ValueError(
                f"actor.attention_kernel={kernel}: the kernel has no attention dropout "
                f"(config.json attention_dropout={self.dropout_p})"
            )
        self.cp_group = None
        if config.context_parallel_size > 1:
            if cp_comm_type not in (None, "all_gather"):
                raise ValueError(
                    f"cp_comm_type={cp_comm_type!r}: the torch attention backend implements "
                    "context parallelism as 'all_gather' only (use attention_backend=te for p2p/a2a)"
                )
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()

    def _layout(self, bounds: Sequence[int], local_tokens: int, device):
        """(index putting gathered K/V in token order or None, query blocks, flex BlockMask or None)."""
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        cp_rank = 0 if self.cp_group is None else self.cp_group.rank()
        return _attention_layout(
            tuple(int(x) for x in bounds), local_tokens, cp_size, cp_rank, self.kernel, torch.device(device)
        )

    def _gather_kv(self, key, value, order):
        return (
            gather_for_cp(key, token_order=order, cp_group=self.cp_group),
            gather_for_cp(value, token_order=order, cp_group=self.cp_group),
        )

    def _attend_varlen(self, query, key, value, layout: VarlenLayout):
        """query [Tq, h, d] local; key, value [T, g, d] local (gathered over CP here) -> [Tq, h, d]."""
        if self.cp_group is not None:
            # the all-gather's reordering IS the blocks' key layout: one index_select, then no key_index
            assert layout.key_index is not None  # cp > 1: a document's two chunks' key runs overlap
            key = gather_for_cp(key, token_order=layout.key_index, cp_group=self.cp_group)
            value = gather_for_cp(value, token_order=layout.key_index, cp_group=self.cp_group)
            layout = dataclasses.replace(layout, key_index=None)
        return varlen_document_attention(query, key, value, layout, scale=self.softmax_scale)

    def _attend(self, q, k, v, blocks, mask):
        """q [B, h, Tq, d]; k, v [B, g, Tk, d] -> [B, h, Tq, d]."""
        if self.kernel == "flex":
            return flex_document_attention(q, k, v, mask, scale=self.softmax_scale)
        dropout_p = self.dropout_p if self.training else 0.0
        return blockwise_attention(q, k, v, blocks, scale=self.softmax_scale, dropout_p=dropout_p)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the torch attention backend")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd'")
        # [s, b, n, hn] -> [b, n, s, hn]: one causal sequence per row
        seq, batch = query.size(0), query.size(1)
        if attention_mask is not None:
            if self.cp_group is not None:
                raise ValueError(
                    "an explicit attention_mask with context parallelism: the torch backend "
                    "supports causal (attention_mask=None) or packed THD batches"
                )
            if self.kernel != "sdpa":
                raise ValueError(f"actor.attention_kernel={self.kernel}: an explicit attention_mask is not supported")
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            dropout_p = self.dropout_p if self.training else 0.0
            # megatron: True = masked out; SDPA: True = attend
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=~attention_mask,
                dropout_p=dropout_p,
                scale=self.softmax_scale,
                enable_gqa=q.size(1) != k.size(1),
            )
            return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
        # the row is split like megatron's get_batch_on_this_cp_rank: one segment of seq*cp tokens
        cp_size = 1 if self.cp_group is None else self.cp_group.size()
        order, blocks, mask = self._layout([0, seq * cp_size], seq, query.device)
        if self.kernel == "varlen":  # one row at a time: each row is one packed sequence of its own
            rows = [
                self._attend_varlen(query[:, b].contiguous(), key[:, b].contiguous(), value[:, b].contiguous(), mask)
                for b in range(batch)
            ]
            return torch.stack(rows, dim=1).reshape(seq, batch, -1)
        if order is not None:
            key, value = self._gather_kv(key, value, order)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._attend(q, k, v, blocks, mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # [s, b, np*hn]

    def _forward_thd(self, query, key, value, packed_seq_params):
        # [T, np, hn] -> [1, np, T, hn]; T is this CP rank's share of the packed tokens. The segment
        # boundaries are the padded ones when given (tokens are laid out by them; RoPE reads the same).
        total = query.size(0)
        # one layout per forward, not per layer: cached on the params object every layer of this forward gets
        key_ = (total, str(query.device), self.kernel)
        cached = getattr(packed_seq_params, "_dapo_attention_layout", None)
        if cached is None or cached[0] != key_:
            cached = (key_, self._layout(_host_bounds(packed_seq_params), total, query.device))
            packed_seq_params._dapo_attention_layout = cached
        order, blocks, mask = cached[1]
        if self.kernel == "varlen":  # [T, np, hn] is varlen_attn's own layout
            return self._attend_varlen(query, key, value, mask).reshape(total, -1)
        if order is not None:
            key, value = self._gather_kv(key, value, order)
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
        out = self._attend(q, k, v, blocks, mask)
        return out.squeeze(0).permute(1, 0, 2).reshape(total, -1)  # [T, np*hn]


HOST_BOUNDS_ATTR = "dapo_host_bounds"


def _host_bounds(packed_seq_params) -> list[int]:
    """The segment boundaries as Python ints. The actor attaches the host copy it made the device tensor
    from (HOST_BOUNDS_ATTR, Actor._forward_step), so reading them costs no device-to-host sync; other
    callers' device tensors are read back (one sync per forward)."""
    host = getattr(packed_seq_params, HOST_BOUNDS_ATTR, None)
    if host is not None:
        return [int(x) for x in host]
    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    return bounds.tolist()


def set_attention_kernel(modules, kernel: str) -> int:
    """Switch every TorchSDPAttention among `modules` (model chunks) to `kernel`; returns how many. The
    kernels share every parameter and the layer's maths, so the actor benchmark compares them on ONE built
    model (its layouts are cached per kernel). The same checks as at model build."""
    check_attention_kernel(kernel)
    count = 0
    for chunk in modules:
        for module in chunk.modules():
            if isinstance(module, TorchSDPAttention):
                if kernel in ("flex", "varlen") and module.dropout_p:
                    raise ValueError(f"actor.attention_kernel={kernel}: the kernel has no attention dropout")
                module.kernel = kernel
                count += 1
    return count

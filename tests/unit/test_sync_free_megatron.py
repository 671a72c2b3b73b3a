"""actor/sync_free.py: megatron-core's THD RoPE and gradient-norm fallback without host syncs, equal to
megatron's own functions bit for bit, on every context-parallel rank layout, with no host read of a tensor
(aten._local_scalar_dense) where megatron's make several."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor import compat, sync_free
from helpers_dispatch import AtenOps

compat.apply_megatron_compat()  # the CPU patches megatron's own functions need here ("cuda" tensors)

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.utils import local_multi_tensor_l2_norm  # noqa: E402


def megatron_rope_thd():
    """megatron's _apply_rotary_pos_emb_thd as shipped (install() replaced the module's attribute)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core.models.common.embeddings.rope_utils")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)  # a second copy of the module: megatron's _apply_rotary_pos_emb_thd untouched
    return fresh._apply_rotary_pos_emb_thd


class CpGroupStandIn:
    """Stand-in for the context-parallel process group: both functions read only its size() and rank()."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _freqs(rows: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]  # [max_s, 1, 1, d], as RotaryEmbedding makes


CASES = [  # (global sequence lengths, cp_size): lengths are multiples of 2 cp_size, as the packer pads them
    ([7, 1, 12, 4], 1),
    ([8, 0, 4, 12], 2),
    ([16, 8, 24], 4),
    ([40], 2),  # one sequence: the table may cover the whole batch (megatron's offset mapping)
]


@pytest.mark.parametrize("lengths,cp_size", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_rope_equals_megatron_bitwise_on_every_cp_rank(lengths, cp_size, interleaved):
    original = megatron_rope_thd()
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    local = sum(lengths) // cp_size
    gen = torch.Generator().manual_seed(len(lengths) * 10 + cp_size)
    for table_rows in sorted({max(lengths), sum(lengths)}):  # the max-length table; the whole-batch table
        freqs = _freqs(table_rows, 16)
        for rank in range(cp_size):
            t = torch.randn(local, 3, 16, generator=gen)
            group = CpGroupStandIn(cp_size, rank)
            want = original(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
            with AtenOps() as ours_ops:
                got = sync_free.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
            assert torch.equal(got, want), (lengths, cp_size, rank, table_rows)
            assert "_local_scalar_dense" not in ours_ops.ops


def test_megatron_thd_rope_reads_the_host_and_ours_does_not():
    """The recorder sees megatron's host reads (so its silence on ours means something)."""
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    t, freqs = torch.randn(12, 2, 8), _freqs(12, 8)
    with AtenOps() as theirs:
        megatron_rope_thd()(t, cu, freqs, cp_group=CpGroupStandIn(1, 0))
    assert theirs.ops.count("_local_scalar_dense") >= 2


def test_thd_positions_by_hand():
    # cp 2, rank 1: sequences of 8 and 4 tokens; local halves: 4 and 2 tokens. Sequence 0's chunks of 2:
    # rank 1 holds chunks 1 and 2 -> rows 2, 3, 4, 5; sequence 1's chunks of 1: rank 1 holds 1 and 2 -> 1, 2.
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert sync_free.thd_positions(cu, 6, cp_size=2, cp_rank=1, global_offsets=False).tolist() == [2, 3, 4, 5, 1, 2]
    assert sync_free.thd_positions(cu, 6, cp_size=2, cp_rank=0, global_offsets=False).tolist() == [0, 1, 6, 7, 0, 3]
    assert sync_free.thd_positions(cu, 6, cp_size=2, cp_rank=0, global_offsets=True).tolist() == [0, 1, 6, 7, 8, 11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_norm_equals_megatron_bitwise_without_host_reads(dtype):
    gen = torch.Generator().manual_seed(3)
    grads = [
        torch.randn(shape, generator=gen).to(dtype) * scale
        for shape, scale in [((64, 32), 1e-3), ((32,), 5.0), ((7, 3, 5), 0.2), ((1,), 40.0)]
    ]
    want, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    with AtenOps() as ops:
        got, _ = sync_free.multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (1,)
    assert torch.equal(got, want)
    assert "_local_scalar_dense" not in ops.ops
    with AtenOps() as theirs:
        local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    # megatron's float(l2_reduced); its torch.tensor(list of 0-d tensors) reads each norm below the dispatcher,
    # unseen here (the H100's sync debug mode counted one sync per parameter tensor at that line)
    assert theirs.ops.count("_local_scalar_dense") == 1


def test_install_routes_megatron_to_the_sync_free_functions():
    assert rope_utils._apply_rotary_pos_emb_thd is sync_free.apply_rotary_pos_emb_thd
    assert clip_grads.l2_norm_impl is sync_free.multi_tensor_l2_norm  # no Apex / TE here: the fallback was in use

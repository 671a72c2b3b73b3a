"""The per-micro-batch path reads no device value on the host (issue 33, item 6): the routing agreement
counters are summed on the routers' device and read once per pass, and host tensors reach the GPU through
pinned, non-blocking copies (actor/staging.py), which leave CPU runs exact. On CPU the device-to-host
reads show up as aten ops: _local_scalar_dense (.item(), int(t)) and nonzero (boolean indexing)."""

from __future__ import annotations

import torch

from dapo_megatron.actor.routing_replay import agreement_counts
from dapo_megatron.actor.staging import to_device
from helpers_dispatch import AtenOps


def test_agreement_counts_by_hand_without_a_host_read():
    own = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
    engine = torch.tensor([[1, 0], [2, 0], [0, 3], [3, 2], [1, 3]], dtype=torch.uint8)  # the engine's dtype
    valid = torch.tensor([True, True, True, False, True])
    # overlaps 2, 1, 1, (2: not reported), 0 -> overlap 4, exact 1 (token 0), tokens 4
    with AtenOps() as recorded:
        counts = agreement_counts(own, engine, valid, topk=2)
    assert counts.tolist() == [4.0, 1.0, 4.0] and counts.dtype == torch.float64
    assert "_local_scalar_dense" not in recorded.ops and "nonzero" not in recorded.ops, recorded.ops


def test_staging_on_cpu_is_the_tensor_itself():
    t = torch.arange(6)
    assert to_device(t, "cpu") is t  # what .to("cpu") returns: no copy, exact

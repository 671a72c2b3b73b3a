"""Host -> device copies of the per-micro-batch inputs (tokens, positions, boundaries, targets, loss
inputs, routed experts) without stalling the host.

A copy from pageable host memory is synchronous for the host (the CUDA driver stages it through its own
pinned buffer and returns when the copy is done), once per tensor per micro-batch. From pinned memory
with non_blocking=True the copy is queued on the current stream and the host goes on launching; the
pinned block comes from torch's caching host allocator, which keeps it until the copy has completed
(it records an event on the stream), so the temporary may be dropped at once. Only where CUDA is in
use: on CPU the tensor is returned as `.to(device)` would (the same tensor: exact, no copy).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`; a host tensor bound for a GPU goes through pinned memory, non-blocking."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

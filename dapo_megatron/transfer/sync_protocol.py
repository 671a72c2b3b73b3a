"""What the trainer needs of a weight sync, whichever transport it is (transfer/weight_sync.py):
DistributedWeightSync (separate engines, a weight group) and TensorWeightSync (colocated engines,
update_weights_from_tensor) both satisfy WeightSync; engine_push.sync_dropping_dead, the Driver's
export pass, is typed against it.

SyncHistory is what a sync object keeps of its past syncs: a running summary and the last few
SyncStats, so that a run of any length holds a bounded record (a list of every SyncStats grew
~150 B per step on the driver; docs/LOG.md, issue 42 item 7).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.transfer.weight_sync import SyncStats


class WeightSync(Protocol):
    """One transport of the trainer's weights into a set of engines."""

    async def sync(
        self,
        clients: list[EngineClient],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str,
        manifest: dict[str, list[int]] | None = None,
        flush_cache: bool = True,
    ) -> SyncStats:
        """Every tensor to every engine in `clients`, tagged `weight_version`; the sync's statistics."""
        ...

    async def close(self, clients: list[EngineClient]) -> None:
        """Drop what the transport holds with these engines (the next sync sets it up again)."""
        ...


class SyncHistory:
    """The syncs done so far: their count and totals, and the last `keep` SyncStats (bounded)."""

    def __init__(self, *, keep: int = 4):
        self.count = 0
        self.total_bytes = 0  # to one engine, summed over syncs
        self.total_seconds = 0.0
        self.recent: deque[SyncStats] = deque(maxlen=keep)

    def record(self, stats: SyncStats) -> None:
        self.count += 1
        self.total_bytes += stats.bytes
        self.total_seconds += stats.seconds
        self.recent.append(stats)

    def __len__(self) -> int:
        return self.count

    @property
    def last(self) -> SyncStats | None:
        return self.recent[-1] if self.recent else None

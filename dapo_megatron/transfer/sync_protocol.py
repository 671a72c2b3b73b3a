"""What the trainer needs of a weight sync and what a sync reports, whichever transport it is
(transfer/weight_sync.py):
DistributedWeightSync (separate engines, a weight group) and TensorWeightSync (colocated engines,
update_weights_from_tensor) both satisfy WeightSync; engine_push.sync_dropping_dead, the Driver's
export pass, is typed against it. SyncStats is what one sync returns.

SyncHistory is what a sync object keeps of its past syncs: a running summary and the last few
SyncStats, so that a run of any length holds a bounded record (a list of every SyncStats grew
~150 B per step on the driver; docs/LOG.md, issue 42 item 7).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dapo_megatron.rollout.client import EngineClient


@dataclass
class SyncStats:
    num_tensors: int = 0
    num_buckets: int = 0  # update requests per engine
    num_collectives: int = 0  # broadcast calls by the trainer (distributed transport)
    bytes: int = 0  # bytes sent to ONE engine
    seconds: float = 0.0
    broadcast_seconds: float = 0.0  # the trainer's broadcast calls (the plan's send term), summed over buckets
    answer_seconds: float = 0.0  # from a bucket's broadcast end to every engine's answer (its load), summed
    export_seconds: float = 0.0  # producing buckets (the iterator: gathers, stage funnel), beside the previous send
    payload_seconds: float = 0.0  # checking and flattening buckets, beside the previous send
    num_engines: int = 0
    weight_version: str = ""
    missing: list[str] = field(default_factory=list)  # engine tensors the trainer did not send

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "weight_sync/tensors": self.num_tensors,
            "weight_sync/buckets": self.num_buckets,
            "weight_sync/collectives": self.num_collectives,
            "weight_sync/bytes": self.bytes,
            "weight_sync/seconds": self.seconds,
            "weight_sync/broadcast_seconds": self.broadcast_seconds,
            "weight_sync/answer_seconds": self.answer_seconds,
            "weight_sync/gb_per_s": self.gb_per_s,
            "weight_sync/engines": self.num_engines,
        }


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

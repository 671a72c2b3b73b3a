"""One export pass of the trainer's weights into the engines, dropping the ones that die during it.

    stats, redo = await sync_dropping_dead(pool, weight_sync, named, weight_version="step_3")

What Driver.push_weights runs for every export pass (trainer/driver.py); the loop's fault policy asks
every rank for another pass while `redo` is true (trainer/recovery.py: FaultPolicy.transfer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import torch

from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.transfer.sync_protocol import SyncStats, WeightSync
from dapo_megatron.transfer.weight_sync import engine_unreachable

if TYPE_CHECKING:
    from dapo_megatron.rollout.pool import EnginePool

# around(targets, sync): runs the sync coroutine, e.g. with the engines paused (rollout/async_rollout.py)
AroundSync = Callable[[list[EngineClient], Awaitable[SyncStats]], Awaitable[SyncStats]]


async def _drop_unreachable(pool, clients, *, why: str) -> list[str]:
    errors = await asyncio.gather(*(engine_unreachable(c.url) for c in clients))
    dead = [c.url for c, err in zip(clients, errors) if err is not None]
    for url, err in zip([c.url for c in clients], errors):
        if err is not None:
            pool.mark_dead(url, f"{why}: {type(err).__name__}: {err}")
    return dead


async def sync_dropping_dead(
    pool: EnginePool,
    weight_sync: WeightSync,
    named: Iterator[tuple[str, torch.Tensor]],
    *,
    weight_version: str,
    around: AroundSync | None = None,
) -> tuple[SyncStats | None, bool]:
    """One export pass into the live + pending engines (driver). Returns (stats or None, redo): redo is
    True when an engine died during the pass (dropped; the survivors need the whole sync again). The
    iterator `named` is always consumed to its end: the other ranks run its collectives."""
    await pool.discover()
    if pool.pending_urls():  # new incarnations join a new group (a restarted engine may keep its url)
        await weight_sync.close(pool.live_clients())
    targets = pool.weight_targets()
    try:
        if not targets:  # nothing to send to: the next rollout waits for an engine (FaultPolicy.rollout)
            return None, False
        sync = weight_sync.sync(targets, named, weight_version=weight_version)
        # around(targets, sync): e.g. the engines paused while steps overlap (rollout/async_rollout.py)
        stats = await (around(targets, sync) if around is not None else sync)
    except EngineError as err:
        why = f"died during weight sync {weight_version}"
        dead = await _drop_unreachable(pool, targets, why=why)
        # an engine whose session call was cut mid-sync is lost even if its port answers one probe right
        # after (its host going down); it is taken back and re-synced once it answers /health again
        cut = [url for url in err.cut_urls if url not in dead]
        for url in cut:
            pool.mark_dead(url, f"{why}: {err}")
        if not dead and not cut:
            raise  # every engine answers: not a dead engine (a refused bucket is a bug to see)
        await weight_sync.close(pool.live_clients())
        return None, True
    finally:
        for _ in named:  # what the failed or skipped sync left of this pass
            pass
    pool.admit(pool.pending_urls())
    return stats, False

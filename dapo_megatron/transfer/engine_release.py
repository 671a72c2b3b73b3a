"""The engines' side of colocated memory: release / resume (SGLang's /release_memory_occupation and
/resume_memory_occupation) and what each engine holds now, for the step's memory ledger.

    await release(clients, ["weights", "kv_cache"])   # engines idle -> nothing of theirs on the GPUs
    await resume(clients, ["weights"])                # weights' memory back (content undefined: sync next)
    gb = await resident_gb(clients, released={"kv_cache"})   # max over engines of one TP rank's GiB

SGLang 0.5.21 (managers/scheduler_components/weight_updater.py, release_memory_occupation) refuses a
release unless the scheduler is idle ("should be called only when server is idle"): the sampler's
aborts of left-over requests may still be draining when the rollout returns, so a refusal for that
reason is retried for a short while. Without --enable-weights-cpu-backup the released weights' bytes
are gone; the colocated step always re-sends every tensor after resuming them (colocated_sync.py
checks that none was left out).

Resident memory: the CPU engine reports its live storage (server_info "cpu_engine" ->
"resident_memory_bytes"); SGLang reports the sizes it measured at load (internal_states[i]
"memory_usage": "weight" and "kvcache" in GB per TP rank, scheduler_components/memory_usage.py) and
never updates them on a release, so for SGLang the released tags are counted as zero from our own
record of what we released.
"""

from __future__ import annotations

import asyncio
import time

from dapo_megatron.rollout.client import EngineClient, EngineError

GIB = 2**30
TAGS = ("weights", "kv_cache")


async def _each(clients: list[EngineClient], make) -> None:
    results = await asyncio.gather(*(make(c) for c in clients), return_exceptions=True)
    failures = {c.url: r for c, r in zip(clients, results) if isinstance(r, BaseException)}
    if failures:
        raise EngineError("; ".join(f"engine {url}: {err}" for url, err in failures.items()), url=next(iter(failures)))


async def release(clients: list[EngineClient], tags: list[str], *, idle_wait_s: float = 60.0) -> None:
    """Release these tags on every engine, waiting (bounded) for aborted requests to drain."""

    async def one(c: EngineClient) -> None:
        deadline = time.monotonic() + idle_wait_s
        while True:
            try:
                await c.release_memory(tags)
                return
            except EngineError as err:
                if "idle" not in str(err) or time.monotonic() > deadline:
                    raise EngineError(f"release_memory_occupation {tags} refused: {err}", url=c.url) from err
                await asyncio.sleep(0.05)

    await _each(clients, one)


async def resume(clients: list[EngineClient], tags: list[str]) -> None:
    await _each(clients, lambda c: c.resume_memory(tags))


def _engine_bytes(info: dict, released: set[str]) -> float:
    """One TP rank's resident bytes from an engine's /server_info."""
    cpu = info.get("cpu_engine")
    if cpu is not None:  # the CPU twin measures its live storage
        held = cpu.get("resident_memory_bytes", {})
        return float(held.get("weights", 0)) + float(held.get("kv_cache", 0))
    states = info.get("internal_states") or [{}]
    usage = states[0].get("memory_usage") or {}
    gb = (0.0 if "weights" in released else float(usage.get("weight", 0.0))) + (
        0.0 if "kv_cache" in released else float(usage.get("kvcache", 0.0))
    )
    return gb * GIB


async def resident_gb(clients: list[EngineClient], *, released: set[str]) -> float:
    """The most any engine TP rank holds now, in GiB (one GPU's share, as the trainer's ledger). An
    engine that does not answer holds nothing we can count: the ledger is no place to fail a step
    (the rollout that follows notices the engine and recovers: trainer/recovery.py)."""
    infos = await asyncio.gather(*(c.server_info() for c in clients), return_exceptions=True)
    held = [_engine_bytes(i, released) for i in infos if isinstance(i, dict)]
    return max(held, default=0.0) / GIB

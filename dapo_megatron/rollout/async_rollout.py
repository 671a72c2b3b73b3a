"""Overlapped steps (rollout.max_staleness = k >= 1): the engines generate the batches of the next k
steps while the trainer trains (docs/architecture.md, "Overlapped steps").

    overlap = AsyncRollout(driver.loop, driver.sampler, driver.prompts, max_staleness=1,
                           train_batch_size=16, total_steps=60)
    result, stats = overlap.next_batch(step)   # main thread: blocks until batch `step` is generated
    overlap.close()

The driver's asyncio loop runs forever on a background thread; a producer task on it collects batch
j (the sampler's dynamic sampling, unchanged) as the trainer has started step j - k, and puts
it in a queue. Why that bound keeps every sample within k: step j - k starts after the weights of
version j - k were pushed (end of step j - k - 1), so every request of batch j is answered by weights
>= j - k, and batch j is trained at step j. The sampler accepts only those versions
(sampler.accepted_versions); at consumption every group is checked again against the step it is
trained at and a group staler than k is dropped and counted (never trained on).

Weight pushes come from the main thread (Driver.push_weights, run on this loop) as an update
ends, inside a pause (`paused_sync`): without it the CPU engine and SGLang hold a weight update until
the running requests have finished (TokenizerManager's model_update_lock is writer-preferring:
sglang/srt/utils/aio_rwlock.py), so the trainer would wait for the whole generation round. Paused in
"retract" mode, the requests in flight continue under the new weights after the update (partial
rollouts): their tokens are tagged by version (meta_info.weight_versions spans), and the staleness
of a sample is taken from its OLDEST version.

Every phase start/end is stamped (time.time()) into `timeline`: "generate" (the producer's collect of
batch j), "engine" (the engines' own stamps of batch j's replies), "wait" (the trainer blocked on
batch j), and the driver adds "train" / "sync" (trainer/timeline.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Coroutine, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch

from dapo_megatron.algo.off_policy import staleness_histogram
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.rollout.sampler import INITIAL_WEIGHT_VERSION, RolloutResult, RolloutSampler

T = TypeVar("T")


def version_number(version: str) -> int:
    """The number of updates behind a weight version: "step_<n>" (Driver.push_weights) -> n; the
    engines' start-up version ("default") -> 0."""
    if version == INITIAL_WEIGHT_VERSION:
        return 0
    if version.startswith("step_") and version[5:].isdigit():
        return int(version[5:])
    raise ValueError(
        f"overlapped rollout: weight_version {version!r} is neither 'step_<n>' nor "
        f"{INITIAL_WEIGHT_VERSION!r} (engine meta_info.weight_version)"
    )


def accepted_versions(batch_step: int, max_staleness: int) -> set[str]:
    """The versions a reply of batch `batch_step` may come from: step_{j-k} .. step_j."""
    low = max(batch_step - max_staleness, 0)
    versions = {f"step_{v}" for v in range(low, batch_step + 1)}
    return versions | {INITIAL_WEIGHT_VERSION} if low == 0 else versions


def sample_staleness(sample: Sample, step: int) -> int:
    """Updates between the oldest weights that made the sample and the step it is trained at."""
    return step - min(version_number(v) for v in sample.extra["weight_versions"])


def filter_stale(
    groups: list[list[Sample]], step: int, max_staleness: int
) -> tuple[list[list[Sample]], dict[str, float]]:
    """Groups whose every sample is within max_staleness of `step`; the staleness histogram of the
    samples offered (bins 0..k and '>k', the refused ones) and the mean of those kept."""
    kept, staleness = [], []
    for group in groups:
        s = [sample_staleness(x, step) for x in group]
        staleness += s
        if max(s, default=0) <= max_staleness:
            kept.append(group)
    hist = staleness_histogram(torch.tensor(staleness, dtype=torch.int64), max_staleness).tolist()
    stats = {f"overlap/staleness_{i}": float(c) for i, c in enumerate(hist[:-1])}
    stats[f"overlap/staleness_gt{max_staleness}"] = float(hist[-1])
    stats["overlap/groups_dropped_stale"] = float(len(groups) - len(kept))
    # partial rollouts: samples whose tokens were made by more than one version (a push mid-request)
    stats["overlap/samples_partial"] = float(sum(len(set(x.extra["weight_versions"])) > 1 for g in groups for x in g))
    kept_s = [sample_staleness(x, step) for g in kept for x in g]
    stats["overlap/staleness_mean"] = sum(kept_s) / len(kept_s) if kept_s else 0.0
    for gi, group in enumerate(kept):
        for x in group:
            x.group_index = gi
    return kept, stats


class Stamps(Protocol):
    """Where the phase stamps (phase, step, start, end) go: a list, or the driver's Timeline."""

    def append(self, stamp: tuple[str, int, float, float], /) -> None: ...

    def extend(self, stamps: Iterable[tuple[str, int, float, float]], /) -> None: ...


class AsyncRollout:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sampler: RolloutSampler,
        prompts: Iterator[PromptRecord],
        *,
        max_staleness: int,
        train_batch_size: int,
        total_steps: int,
        timeline: Stamps | None = None,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncRollout: max_staleness must be >= 1, got {max_staleness}")
        self.loop, self.sampler, self.prompts = loop, sampler, prompts
        self.k, self.train_batch_size, self.total_steps = max_staleness, train_batch_size, total_steps
        # (phase, step, start, end) in time.time(): a list (list.append is atomic across the two threads) or
        # the driver's trainer/timeline.py Timeline, which streams them to disk
        self.timeline: Stamps = [] if timeline is None else timeline
        self.ready: queue.Queue = queue.Queue()  # (batch step, RolloutResult | BaseException)
        self._started = -1  # the newest step the trainer has started (set on the loop thread)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Future | None = None
        self._thread = threading.Thread(target=loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Run a coroutine on the loop thread and wait for it (the driver's engine calls)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _start_step(self, step: int) -> None:  # on the loop thread
        self._started = max(self._started, step)
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.ensure_future(self._produce(step, self._wake))
        assert self._wake is not None  # made with the first producer, never reset
        self._wake.set()

    def _forget_producer(self) -> None:  # on the loop thread, before any later _start_step
        self._task = None

    async def _produce(self, first: int, wake: asyncio.Event) -> None:
        j = first
        try:
            while j < self.total_steps:
                while self._started < j - self.k:  # batch j waits for step j - k (the module docstring)
                    wake.clear()
                    await wake.wait()
                self.sampler.accepted_versions = accepted_versions(j, self.k)
                tic = time.time()
                result = await self.sampler.collect(self.prompts, train_batch_size=self.train_batch_size)
                self.timeline.append(("generate", j, tic, time.time()))
                self.timeline.extend(engine_phases(self.sampler.engine_spans, j))  # the engines' own stamps
                self.sampler.engine_spans.clear()
                self.ready.put((j, result))
                j += 1
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            self.ready.put((j, err))

    def next_batch(self, step: int) -> tuple[RolloutResult, dict[str, float]]:
        """Batch `step` (blocking) and the overlap statistics; lets the producer run k steps ahead."""
        tic = time.time()
        self.loop.call_soon_threadsafe(self._start_step, step)
        j, result = self.ready.get()
        waited = time.time()
        self.timeline.append(("wait", step, tic, waited))
        if isinstance(result, BaseException):
            # the producer has stopped; the next next_batch starts a new one at its step (after the
            # recovery's re-sync when the engines were lost: trainer/recovery.py). The prompts the failed batch
            # drew stay used, as those of batches generated ahead do at a checkpoint.
            self.loop.call_soon_threadsafe(self._forget_producer)
            if isinstance(result, EngineError):  # trainer/recovery.py tells an engine loss by its type
                raise result
            raise RuntimeError(f"overlapped rollout: generating batch {j} failed") from result
        if j != step:
            raise RuntimeError(f"overlapped rollout: batch {j} arrived for step {step}")
        groups, stats = filter_stale(result.groups, step, self.k)
        result.groups = groups
        stats["overlap/wait_s"] = waited - tic
        return result, stats

    async def paused_sync(self, clients: Sequence[EngineClient], sync: Awaitable[T]) -> T:
        """Run the weight sync `sync` (a coroutine) with generation paused in "retract" mode on every
        engine, then continue: the requests in flight keep their tokens and finish under the new
        weights (a partial rollout; their weight_versions spans name both). SGLang 0.5.21:
        Scheduler.pause_generation (srt/managers/scheduler.py) - "in_place" leaves the running batch
        and its KV cache, so the update's flush_cache fails (io_struct.PauseGenerationReqInput);
        "retract" moves running requests back to the waiting queue, so the cache can be flushed and
        their KV is recomputed by the new weights after /continue_generation. Without a pause the
        update would wait for every running request (the writer side of model_update_lock)."""
        tic = time.time()
        await asyncio.gather(*(c.pause_generation("retract") for c in clients))
        try:
            return await sync
        finally:
            await asyncio.gather(*(c.continue_generation() for c in clients))
            self.timeline.append(("paused", -1, tic, time.time()))

    def close(self) -> None:
        """Cancel the producer (the sampler aborts its requests), leave the loop stopped, not closed."""

        async def cancel():
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)

        self.run(cancel())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


# the engines' own spans of a batch, as timeline entries (trainer/timeline.py draws them)
def engine_phases(spans: list[tuple[float, float]], step: int) -> list[tuple[str, int, float, float]]:
    """A batch's "engine" timeline entries: the union of the engines' own spans for its replies."""
    return [("engine", step, a, b) for a, b in _union(spans)]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]

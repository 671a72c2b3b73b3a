"""The CPU engine's scheduler and the asyncio lock SGLang's tokenizer manager uses around weight updates.

_Batcher (SGLang's Scheduler, as a client sees it): waiting sequences are taken into one padded decode
batch on a worker thread (up to --max-batch-size; no continuous batching: a batch runs to its end).
Each sequence replies as it finishes. Aborts match by rid prefix over the waiting queue and the
running batch (scheduler.py abort_request: `req.rid.startswith(recv_req.rid)`): a waiting one is
answered at once with finish_reason {"type": "abort", "message": "Abort in waiting queue"}
(tokenizer_manager.py _handle_abort_req), a running one ends at the next step with FINISH_ABORT's
{"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}. A scheduler pause
("retract" or "in_place", scheduler.py pause_generation) stops the decode loop between steps; retract
drops the batch's KV cache, which is recomputed on continue.

RWLock: TokenizerManager.model_update_lock (sglang/srt/utils/aio_rwlock.py): each /generate holds the
reader side while it runs; weight updates and begin/end_weight_update take the writer side unless
generation is paused, so an update waits for running requests, and a waiting writer blocks new readers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from dapo_megatron.cpu_engine.engine import CpuEngine
from dapo_megatron.cpu_engine.protocol import SequenceRequest
from dapo_megatron.rollout.sglang_api import FinishReason

ABORT_WAITING: FinishReason = {"type": "abort", "message": "Abort in waiting queue"}


class RWLock:
    """Writer-preferring asyncio readers/writer lock (the semantics of SGLang's aio_rwlock.RWLock)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self._writer = False
        self._waiting_writers = 0

    async def acquire_reader(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._waiting_writers == 0)
            self.readers += 1

    async def release_reader(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    async def acquire_writer(self) -> None:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self.readers == 0)
            finally:
                self._waiting_writers -= 1
            self._writer = True

    async def release_writer(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()

    def reader(self) -> _Held:
        return _Held(self.acquire_reader, self.release_reader)

    def writer(self) -> _Held:
        return _Held(self.acquire_writer, self.release_writer)


class _Held:
    def __init__(self, acquire, release):
        self._acquire, self._release = acquire, release

    async def __aenter__(self):
        await self._acquire()

    async def __aexit__(self, *exc):
        await self._release()


class _Item:
    __slots__ = ("seq", "fut", "loop")

    def __init__(self, seq: SequenceRequest, fut: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.seq, self.fut, self.loop = seq, fut, loop


class Batcher:
    """The scheduler: a worker thread running padded decode batches (module docstring)."""

    def __init__(self, engine: CpuEngine):
        self.engine = engine
        self.waiting: deque[_Item] = deque()
        self.running: list[_Item] = []
        self.paused: str | None = None  # scheduler pause: None, "retract" or "in_place"
        self.retracted = False  # the running batch went back to the waiting queue (retract pause)
        self.parked = False  # the decode loop waits at a step boundary (paused)
        self.last_finish = 0.0  # time.monotonic() of the last sequence that finished (health checks)
        self.cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker once the running batch is done (waiting sequences are not run)."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self._thread.join(60)

    def counts(self) -> dict:
        with self.cond:
            live = [i.seq for i in self.running if i.seq.finish_reason is None]
            return {
                "num_waiting_sequences": len(self.waiting) + (len(live) if self.retracted else 0),
                "num_running_sequences": 0 if self.retracted else len(live),
                "running": [{"rid": s.rid, "completion_tokens": len(s.output_ids)} for s in live],
            }

    # ------------------------------------------------------------------ from the event loop
    def submit(self, seqs: list[SequenceRequest]) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        items = [_Item(s, loop.create_future(), loop) for s in seqs]
        with self.cond:
            self.waiting.extend(items)
            self.cond.notify_all()
        return [i.fut for i in items]

    def abort(self, *, rid: str = "", abort_all: bool = False) -> list[str]:
        """Abort every waiting or running sequence whose rid starts with `rid` (or all); returns their rids."""
        hit: list[str] = []
        with self.cond:
            kept: deque = deque()
            for item in self.waiting:
                if abort_all or item.seq.rid.startswith(rid):
                    item.seq.aborted = True
                    item.seq.finish_reason = ABORT_WAITING.copy()
                    self._resolve(item)
                    hit.append(item.seq.rid)
                else:
                    kept.append(item)
            self.waiting = kept
            for item in self.running:
                if item.seq.finish_reason is None and (abort_all or item.seq.rid.startswith(rid)):
                    item.seq.aborted = True
                    hit.append(item.seq.rid)
            self.cond.notify_all()
        return hit

    def cancel(self, seqs: list[SequenceRequest]) -> None:
        """The client went away: drop these sequences from the queue, stop them if they run."""
        ids = {id(s) for s in seqs}
        with self.cond:
            self.waiting = deque(i for i in self.waiting if id(i.seq) not in ids)
            for s in seqs:
                s.aborted = True
            self.cond.notify_all()

    def set_pause(self, mode: str | None) -> None:
        """Pause ("retract"/"in_place") or continue (None). A pause returns once the running batch is
        parked at a step boundary (SGLang's scheduler handles the pause before any later request)."""
        with self.cond:
            self.paused = mode
            self.cond.notify_all()
            if mode is not None:
                self.cond.wait_for(lambda: self.parked or not any(i.seq.finish_reason is None for i in self.running))

    def is_fully_idle(self, *, ignore_waiting: bool = False) -> bool:
        """SGLang's Scheduler.is_fully_idle: nothing running (a retracted batch waits), nothing waiting."""
        with self.cond:
            live = any(i.seq.finish_reason is None for i in self.running)  # finished ones only await the batch end
            running = live and not self.retracted
            waiting = bool(self.waiting) or (live and self.retracted)
            return not running and (ignore_waiting or not waiting)

    # ------------------------------------------------------------------ engine hooks (worker thread)
    def pause_mode(self) -> str | None:
        with self.cond:
            return self.paused

    def wait_while_paused(self) -> None:
        """Wait (engine lock released: weight updates may run) until continue or an abort arrives."""
        self.engine.lock.release()
        try:
            with self.cond:
                self.retracted, self.parked = self.paused == "retract", True
                self.cond.notify_all()
                live = [i.seq for i in self.running if i.seq.finish_reason is None]
                self.cond.wait_for(lambda: self.paused is None or any(s.aborted for s in live))
                self.retracted, self.parked = False, False
        finally:
            self.engine.lock.acquire()

    def finished(self, seq: SequenceRequest) -> None:
        self.last_finish = time.monotonic()
        with self.cond:
            item = next((i for i in self.running if i.seq is seq), None)
        if item is not None:
            self._resolve(item)

    # ------------------------------------------------------------------ worker
    @staticmethod
    def _resolve(item: _Item, error: BaseException | None = None) -> None:
        def settle():
            if item.fut.done():
                return
            if error is not None:
                item.fut.set_exception(error)
            else:
                item.fut.set_result(item.seq)

        item.loop.call_soon_threadsafe(settle)

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self._closed or (self.waiting and self.paused is None))
                if self._closed:
                    return
                take: list = []
                while self.waiting and len(take) < self.engine.max_batch_size:
                    take.append(self.waiting.popleft())
                self.running = take
            error: BaseException | None = None
            try:
                with self.engine.lock:
                    self.engine.generate([i.seq for i in take], self)
            except Exception as err:  # noqa: BLE001 - reported to the waiting requests
                error = err
            with self.cond:
                self.running = []
                # wake a pause waiting for this batch to park: a batch that finished in its last step
                # never parks, and without this the pause would wait forever (seen with overlapped steps)
                self.cond.notify_all()
            for item in take:
                self._resolve(item, error)

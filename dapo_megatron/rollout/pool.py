"""EnginePool: many engines behind one generate() call.

    pool = EnginePool(urls=["http://10.0.0.5:30000", ...])         # fixed engines, or
    pool = await EnginePool.from_registry(run_dir + "/engines", min_engines=4, wait_s=1800)
    outs = await pool.generate(input_ids=[ids] * 2, rid=["g17-0.", "g17-1."], sampling_params={...})
    await pool.abort(["g17-0.", "g17-1."])                         # reaches the engines serving them

Placement: each request goes to the live engine with the fewest requests in flight.
Aborts are exact: SGLang matches /abort_request {"rid": r} against the rid of each sample it runs
(after a rid lookup in the tokenizer manager, the scheduler aborts every request whose rid starts with
r), so the pool aborts the samples' own rids, never a parent request's (a request with n > 1 gets fresh
uuid rids per sample, which no abort by the caller's rid reaches). Where every request this pool has
in flight on an engine is to be aborted, one {"abort_all": true} does it: exact because the run's
engines serve only this pool (eval and rollout never overlap).
Failure: a request whose engine stops answering (refused, reset, timed out) marks that engine
dead and is retried on the least-loaded live engine (up to max_retries times); nothing is lost
while one engine lives. HTTP 4xx/5xx answers are the request's own fault and are not retried.
Re-admission: `discover()` re-reads the registry (an engine restarted on the same host:port writes
a newer started_at; a new host:port is a new engine; a dropped engine whose registration is still
there, e.g. one whose host was cut off for a while, is probed again) or, for fixed URLs, probes dead
engines' /health; such engines become *pending*: they are not used until the trainer has pushed the current
weights to them (`weight_targets()` lists live + pending) and calls `admit(urls)`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from dapo_megatron.rollout.auth import EngineKeys
from dapo_megatron.rollout.client import EngineClient, EngineError, EngineUnreachable, SessionHolder, generate_request
from dapo_megatron.rollout.registry import read_engine_events, read_registrations
from dapo_megatron.rollout.sglang_api import GenerateOutput, SamplingParamsArg


class NoLiveEngine(EngineError):
    """Every engine of the pool has been dropped: an engine loss, whatever the pool looks like by the
    time the error is handled (while steps overlap, a restarted engine may be live again by then)."""


@dataclass
class _Engine:
    client: EngineClient
    state: str = "live"  # live | dead | pending
    started_at: str | None = None
    in_flight: int = 0
    served: int = 0  # requests completed (load statistics)
    failures: int = 0


class EnginePool:
    def __init__(
        self,
        urls: list[str] | None = None,
        *,
        registry_dir: str | None = None,
        timeout_s: float = 3600.0,
        max_retries: int = 3,
        keys: EngineKeys | None = None,
    ):
        if not urls and not registry_dir:
            raise ValueError("EnginePool: give engine urls (rollout.engine_urls) or a registry directory")
        self.registry_dir = registry_dir
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.keys = keys or EngineKeys()  # sent by every client (rollout/auth.py)
        self._sessions = SessionHolder()  # shared by this pool's clients
        self._engines: dict[str, _Engine] = {}
        self._where: dict[str, str] = {}  # rid -> url of the engine serving it now
        self._aborted: set[str] = set()  # rids aborted by abort(): never retried elsewhere
        self.events: list[tuple[float, str, str]] = []  # (time, event, url): dropped / pending / admitted
        self._records: dict[str, dict] = {}  # url -> its registry record (node, GPUs, tp_size ...)
        for url in urls or []:
            self._engines[url.rstrip("/")] = _Engine(self._client(url))

    @classmethod
    async def from_registry(
        cls,
        registry_dir: str,
        *,
        min_engines: int = 1,
        wait_s: float = 600.0,
        timeout_s: float = 3600.0,
        max_retries: int = 3,
        keys: EngineKeys | None = None,
        on_wait: Callable[[int], None] | None = None,
    ) -> EnginePool:
        """Wait until `min_engines` registered engines answer /health; all of them start live.
        on_wait(engines up so far) after every look (the driver's progress line)."""
        pool = cls(registry_dir=registry_dir, timeout_s=timeout_s, max_retries=max_retries, keys=keys)
        deadline = time.monotonic() + wait_s
        while True:
            await pool.discover()
            pool.admit([url for url, e in pool._engines.items() if e.state == "pending"])
            if on_wait is not None:
                on_wait(len(pool.live_urls()))
            if len(pool.live_urls()) >= min_engines:
                return pool
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(pool.live_urls())} of {min_engines} engines registered in "
                    f"{registry_dir} answered /health within {wait_s:.0f} s"
                )
            await asyncio.sleep(1.0)

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, timeout_s=self.timeout_s, sessions=self._sessions, keys=self.keys)

    async def close(self) -> None:
        await self._sessions.close()

    # ------------------------------------------------------------------ membership
    def live_urls(self) -> list[str]:
        return [url for url, e in self._engines.items() if e.state == "live"]

    def pending_urls(self) -> list[str]:
        return [url for url, e in self._engines.items() if e.state == "pending"]

    def live_clients(self) -> list[EngineClient]:
        return [e.client for e in self._engines.values() if e.state == "live"]

    def weight_targets(self) -> list[EngineClient]:
        """Engines the next weight sync must reach: the live ones and those waiting to be admitted."""
        return [e.client for e in self._engines.values() if e.state in ("live", "pending")]

    def registrations(self) -> list[dict]:
        """The registry records of the engines the next weight sync reaches (live + pending)."""
        targets = {c.url for c in self.weight_targets()}
        return [rec for url, rec in sorted(self._records.items()) if url in targets]

    def load(self) -> dict[str, dict]:
        return {
            url: {"state": e.state, "in_flight": e.in_flight, "served": e.served, "failures": e.failures}
            for url, e in self._engines.items()
        }

    def mark_dead(self, url: str, reason: str = "") -> None:
        engine = self._engines.get(url)
        if engine is not None and engine.state != "dead":
            engine.state = "dead"
            engine.failures += 1
            self.events.append((time.time(), f"dropped: {reason}", url))

    def admit(self, urls: list[str]) -> None:
        """Pending engines (now holding the current weights) start taking requests."""
        for url in urls:
            engine = self._engines.get(url)
            if engine is None or engine.state != "pending":
                raise ValueError(f"EnginePool.admit: {url} is not a pending engine")
            engine.state = "live"
            self.events.append((time.time(), "admitted", url))

    async def discover(self) -> list[str]:
        """New or restarted engines that answer /health become pending; returns the pending urls."""
        candidates: list[tuple[str, str | None]] = []
        if self.registry_dir:
            try:
                records = read_registrations(self.registry_dir)
            except FileNotFoundError:
                records = []
            for rec in records:
                url = rec["url"].rstrip("/")
                self._records[url] = rec
                known = self._engines.get(url)
                # a restarted engine (newer started_at), or the same one dropped because it stopped
                # answering (its host cut off, then back): either way pending, so re-synced before use
                if known is None or known.state == "dead":
                    candidates.append((url, rec["started_at"]))
                elif known.started_at is None:
                    known.started_at = rec["started_at"]
        else:
            candidates = [(url, None) for url, e in self._engines.items() if e.state == "dead"]
        for url, started_at in candidates:
            engine = self._engines.get(url) or _Engine(self._client(url), state="dead")
            if await engine.client.health(timeout_s=5.0):
                engine.state, engine.started_at, engine.in_flight = "pending", started_at, 0
                self._engines[url] = engine
                self.events.append((time.time(), "pending", url))
        return self.pending_urls()

    # ------------------------------------------------------------------ requests
    def _pick(self) -> _Engine:
        live = [e for e in self._engines.values() if e.state == "live"]
        if not live:
            raise NoLiveEngine("EnginePool: no live engine left (all dropped); restart engines and discover()")
        return min(live, key=lambda e: e.in_flight)

    @overload
    async def generate(
        self,
        *,
        input_ids: list[list[int]],
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> list[GenerateOutput]: ...

    @overload
    async def generate(
        self,
        *,
        input_ids: list[int],
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput: ...

    async def generate(
        self,
        *,
        input_ids: list[int] | list[list[int]],
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput | list[GenerateOutput]:
        """EngineClient.generate on the least-loaded engine, retried elsewhere if that engine dies
        (unless the request was aborted meanwhile: then the EngineUnreachable is raised)."""
        payload = generate_request(
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            return_routed_experts=return_routed_experts,
        )
        rids = [rid] if isinstance(rid, str) else list(rid or [])
        last: Exception | None = None
        try:
            for _ in range(self.max_retries + 1):
                engine = self._pick()
                engine.in_flight += 1
                for r in rids:
                    self._where[r] = engine.client.url
                try:
                    out = await engine.client.send_generate(payload)
                    engine.served += 1
                    return out
                except EngineUnreachable as err:
                    last = err
                    self.mark_dead(engine.client.url, str(err))
                    if any(r in self._aborted for r in rids):
                        raise
                finally:
                    engine.in_flight -= 1
                    for r in rids:
                        if self._where.get(r) == engine.client.url:
                            del self._where[r]
        finally:
            self._aborted.difference_update(rids)
        raise EngineError(f"EnginePool: request {rid} failed on {self.max_retries + 1} engines; last error: {last}")

    def in_flight_rids(self, url: str) -> set[str]:
        return {r for r, u in self._where.items() if u == url}

    async def abort(self, rids: list[str]) -> int:
        """Abort these samples wherever they run; returns the number of /abort_request calls made.
        The engines confirm in the aborted requests' own replies (finish_reason "abort")."""
        self._aborted.update(r for r in rids if r in self._where)  # finished ones need nothing
        by_engine: dict[str, list[str]] = {}
        for r in rids:
            url = self._where.get(r)
            if url is not None:
                by_engine.setdefault(url, []).append(r)
        calls = []
        for url, mine in by_engine.items():
            client = self._engines[url].client
            if self.in_flight_rids(url) <= set(mine):
                calls.append(client.abort(abort_all=True))
            else:
                calls.extend(client.abort(r) for r in mine)
        await asyncio.gather(*calls, return_exceptions=True)  # a dead engine has nothing left to abort
        return len(calls)

    async def seeds_honoured(self) -> bool:
        """Whether every live engine honours sampling_seed: SGLang only under
        --enable-deterministic-inference (layers/sampler.py reads the seed only then; the CPU engine
        always does and reports the flag true)."""
        infos = await asyncio.gather(*(c.server_info() for c in self.live_clients()))
        return bool(infos) and all(bool(i.get("enable_deterministic_inference")) for i in infos)


class EngineEventReport:
    """The pool's engine faults as a person and a dashboard see them: one console line per event since
    the last report (an engine dropped, back and waiting for weights, rejoined after a re-sync) and
    running counts (metrics engines/dropped_total, engines/returned_total, engines/rejoined_total,
    engines/live; engines/restarted_total with restart_events). Events before construction (the
    start-up admissions) are not reported. Restarts are the local launcher's: launch/local/supervise.py
    prints their console lines and writes them to `restart_events`, a JSON-lines file counted here."""

    def __init__(self, pool: EnginePool, *, restart_events: str | Path | None = None) -> None:
        self.pool = pool
        self.restart_events = restart_events
        self._seen = len(pool.events)
        self._dropped: set[str] = set()
        self.counts = {"dropped": 0, "returned": 0, "rejoined": 0}
        if restart_events:
            self.counts["restarted"] = 0

    def report(self, *, out: Callable[[str], None] = print) -> dict[str, float]:
        for _, event, url in self.pool.events[self._seen :]:
            if event.startswith("dropped"):
                self.counts["dropped"] += 1
                self._dropped.add(url)
                reason = event.removeprefix("dropped").lstrip(": ") or "no reason given"
                out(f"[engines] {url} dropped ({reason}); {len(self.pool.live_urls())} live")
            elif event == "pending" and url in self._dropped:
                self.counts["returned"] += 1
                out(f"[engines] {url} answers again; it rejoins after the next weight sync")
            elif event == "admitted" and url in self._dropped:
                self.counts["rejoined"] += 1
                out(f"[engines] {url} rejoined with the current weights; {len(self.pool.live_urls())} live")
        self._seen = len(self.pool.events)
        if self.restart_events:
            self.counts["restarted"] = sum(e["action"] == "restarted" for e in read_engine_events(self.restart_events))
        return {
            "engines/live": float(len(self.pool.live_urls())),
            **{f"engines/{kind}_total": float(n) for kind, n in self.counts.items()},
        }

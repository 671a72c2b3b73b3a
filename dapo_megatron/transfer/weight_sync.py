"""Push the trainer's weights into the rollout engines, bucket by bucket, as SGLang 0.5.21 expects.

Both transports run inside a weight-update session on every engine (`weight_update_session`: POST
/begin_weight_update before the first bucket, /end_weight_update after the last, also when a bucket
failed): SGLang refuses update_weights_from_distributed and update_weights_from_tensor outside one
(managers/scheduler_components/weight_updater.py, SchedulerWeightUpdaterManager). Every update carries
the sync's `weight_version`, which the engine then reports in every reply's meta_info (the sampler
checks it), and flush_cache=true (the engine's prefix cache holds KV of the old weights; each update
runs under SGLang's model_update_lock, so the engine is idle and the flush succeeds).

(a) DistributedWeightSync (separate engines): once per set of engines, POST /init_weights_update_group
    to every engine while the trainer opens its side (weight_group.open_weight_group, master address
    from weight_group.trainer_address: reachable by every engine). Per bucket: POST
    /update_weights_from_distributed {names, dtypes, shapes, load_format: "flattened_bucket"} to every
    engine and ONE broadcast of the bucket's bytes (flat_payload: a view when the bucket is already one
    flat buffer, as the stage exporters' are, else tensor_payload.flatten_bucket's copy), or one
    broadcast per tensor with flattened=False. Bucket k+1 is taken from the iterator (on the driver:
    the exporter's merge, the stage funnel) and made ready in a worker thread while bucket k is
    broadcast and loaded. The engines take one update at a time whatever the number of groups (SGLang's
    model_update_lock; docs/architecture.md "one sender"), so one sender per engine pool it is.
    The group's backend follows the engines, not the trainer
    (engine_group_backend): SGLang engines receive into GPU memory over nccl; the CPU engine joins gloo
    groups only, so a GPU trainer feeding it stages each CUDA bucket through host memory
    (collectives.pg_broadcast). A pool mixing both kinds is refused, naming the engines.
(b) TensorWeightSync (colocated engines): per bucket, POST /update_weights_from_tensor with one payload
    per engine TP rank, each serialized on its own (tensor_payload.serialize_for_engine_rank: CUDA IPC
    handles on GPUs, shared memory on CPU).

Names and shapes are checked against each engine's model (GET /model_info "parameters" where the
engine lists them, else the safetensors headers of its model_path) before a bucket is sent: a mismatch
is a ValueError naming the tensor and the engine. Pass `manifest` (every name and shape) to check the
whole sync before the first byte moves. SyncStats records bytes, seconds, GB/s and the number of
collective calls.

Trainer usage (every rank iterates the actor's weights, the TP all-gathers being collectives; rank 0
sends):
    sync = DistributedWeightSync(master_address=trainer_address(...))   # backend: from the engines
    stats = await sync.sync(clients, actor.iter_hf_weights(), weight_version="step_3")   # rank 0
    for _ in actor.iter_hf_weights(): pass                                               # other ranks
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from dapo_megatron.rollout.client import EngineClient, EngineError, EngineUnreachable
from dapo_megatron.transfer.sync_protocol import SyncHistory, SyncStats, WeightSync
from dapo_megatron.transfer.tensor_payload import flatten_bucket, serialize_for_engine_rank, split_for_alignment
from dapo_megatron.transfer.weight_group import broadcast_from_trainer, open_weight_group, trainer_address
from dapo_megatron.weights.export import bucketize  # the one bucketizer (size-bounded, order kept)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
FLATTENED = "flattened_bucket"
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- checks
def check_against(specs: dict[str, list[int]], bucket: list[tuple[str, torch.Tensor]], *, engine: str) -> None:
    for name, tensor in bucket:
        if name not in specs:
            raise ValueError(f"weight sync: tensor '{name}' does not exist in the model of engine {engine}")
        if list(tensor.shape) != list(specs[name]):
            raise ValueError(
                f"weight sync: tensor '{name}' has shape {list(tensor.shape)}, "
                f"engine {engine} expects {list(specs[name])}"
            )


def checkpoint_shapes(model_dir: str) -> dict[str, list[int]]:
    """Names and shapes from the safetensors headers of a checkpoint (no tensor data is read)."""
    shapes: dict[str, list[int]] = {}
    files = [f for f in sorted(os.listdir(model_dir)) if f.endswith(".safetensors")]
    if not files:
        raise ValueError(f"weight sync: no *.safetensors in {model_dir} to read parameter shapes from")
    for fname in files:
        with open(os.path.join(model_dir, fname), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


async def engine_shapes(client: EngineClient) -> dict[str, list[int]]:
    """The engine's own parameter list (the CPU engine's extra /model_info field), else its checkpoint's
    (SGLang's /model_info names model_path but lists no parameters)."""
    info = await client.model_info()
    if "parameters" in info:
        return {n: spec["shape"] for n, spec in info["parameters"].items()}
    return checkpoint_shapes(info["model_path"])


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _gather_per_engine(clients: list[EngineClient], calls) -> dict[str, BaseException]:
    """Run one call per engine concurrently; {url: error} of the engines whose call failed."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    return {c.url: r for c, r in zip(clients, results) if isinstance(r, BaseException)}


def _name_failures(what: str, failures: Mapping[str, BaseException | None]) -> str:
    return "; ".join(f"engine {url}: {what} failed: {err}" for url, err in failures.items())


async def engine_unreachable(url: str, timeout_s: float = 5.0) -> BaseException | None:
    """None if a TCP connection to the engine's HTTP port opens, else the error (refused: its process
    is gone; timed out: its host is)."""
    parsed = urlparse(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parsed.hostname, parsed.port), timeout_s)
    except (OSError, asyncio.TimeoutError) as err:
        return err if str(err) else TimeoutError(f"no TCP connection within {timeout_s:.0f} s")
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


# --------------------------------------------------------------------------------------- session
@contextlib.asynccontextmanager
async def weight_update_session(clients: list[EngineClient], *, end_timeout_s: float = 120.0) -> AsyncIterator[None]:
    """POST /begin_weight_update to every engine, run the body, then /end_weight_update to every engine
    whose session opened, whether the body succeeded or not. A refused begin closes the sessions that
    did open and raises EngineError naming the engine; a refused end raises likewise (after all were
    tried). A body error is re-raised as it is (failures to close the sessions then are logged)."""
    failures = await _gather_per_engine(clients, [c.begin_weight_update() for c in clients])
    opened = [c for c in clients if c.url not in failures]

    async def end_all() -> dict[str, BaseException]:
        calls = [asyncio.wait_for(c.end_weight_update(), end_timeout_s) for c in opened]
        return await _gather_per_engine(opened, calls)

    if failures:
        await end_all()
        # cut_urls: a host going down can still accept one TCP probe a moment later (engine_push.sync_dropping_dead)
        raise EngineError(
            f"weight sync: {_name_failures('begin_weight_update', failures)}",
            url=next(iter(failures)),
            cut_urls=[url for url, e in failures.items() if isinstance(e, EngineUnreachable)],
        )
    try:
        yield
    except BaseException:
        end_failures = await end_all()
        if end_failures:  # the body's error is the one to raise; these are logged beside it
            log.error(
                "weight sync: closing the sessions after a failed sync: %s",
                _name_failures("end_weight_update", end_failures),
            )
        raise
    end_failures = await end_all()
    if end_failures:
        raise EngineError(
            f"weight sync: {_name_failures('end_weight_update', end_failures)}", url=next(iter(end_failures))
        )


@dataclass
class _Prepared:
    """One bucket ready to leave: what the update request names, and the broadcast payloads."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    payloads: list[torch.Tensor]
    nbytes: int


def flat_payload(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket's bytes as one uint8 tensor (what SGLang's FlattenedTensorBucket holds): a view, no
    copy, where its tensors already lie back to back in one buffer (the stage exporters' flat buckets,
    transfer/stage_export.py), else a copy (tensor_payload.flatten_bucket)."""
    first = bucket[0][1]
    storage, start = first.untyped_storage(), first.storage_offset() * first.element_size()
    end = start
    for _, t in bucket:
        same = t.untyped_storage().data_ptr() == storage.data_ptr() and t.device == first.device
        if not (same and t.is_contiguous() and t.storage_offset() * t.element_size() == end):
            return flatten_bucket(bucket)
        end += t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, int(start), (int(end - start),), (1,))


def _buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, flattened: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    for bucket in bucketize(named_tensors, bucket_bytes):
        yield from (split_for_alignment(bucket) if flattened else [bucket])


def _check_sync_args(clients: list, weight_version: str) -> None:
    if not clients:
        raise ValueError("weight sync: no engines to sync")
    if not weight_version:
        raise ValueError("weight sync: weight_version must be a non-empty string (it tags every reply)")


def _check_manifest(shapes: dict[str, dict[str, list[int]]], manifest: dict[str, list[int]]) -> None:
    for url, engine_specs in shapes.items():
        check_against(engine_specs, [(n, torch.empty(s, device="meta")) for n, s in manifest.items()], engine=url)


# ----------------------------------------------------------------------------------- distributed
def engine_group_backend(server_infos: dict[str, dict]) -> str:
    """The weight group's backend for these engines (url -> /server_info): the one every engine joins.

    The CPU engine says which backend it joins (server_info cpu_engine.weight_group_backend: gloo);
    SGLang engines receive into GPU memory over nccl (init_weights_update_group's default, and what
    its GPU receive path is built for). Engines needing different backends cannot share one group."""
    if not server_infos:
        raise ValueError("weight sync: no engines to form a group with")
    by_backend: dict[str, list[str]] = {}
    for url, info in server_infos.items():
        backend = (info.get("cpu_engine") or {}).get("weight_group_backend") or "nccl"
        by_backend.setdefault(backend, []).append(url)
    if len(by_backend) > 1:
        kinds = "; ".join(f"{b}: {', '.join(sorted(urls))}" for b, urls in sorted(by_backend.items()))
        raise ValueError(
            f"weight sync: the engines join different weight-group backends ({kinds}); CPU rollout "
            "engines join gloo only, SGLang engines nccl: run one kind per pool (rollout.engine, "
            "rollout.engine_urls)"
        )
    (backend,) = by_backend
    return backend


def _check_trainer_can_join(backend: str) -> None:
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "weight sync: SGLang engines receive weights over nccl, which needs a GPU on the trainer "
            "side; this trainer has none (use rollout.engine=cpu, or run the trainer on GPUs)"
        )


@dataclass
class _GroupPlan:
    """Where and how large the next weight group is: engine i's TP rank t joins as rank_offsets[i] + t."""

    address: str
    port: int
    world_size: int
    rank_offsets: list[int]


class DistributedWeightSync:
    """Trainer side of update_weights_from_distributed. Re-forms the group whenever the set of engines
    changes (an engine dropped, a restarted one re-admitted): a process group's membership is fixed."""

    def __init__(
        self,
        *,
        master_address: str = "",
        master_port: int = 0,
        backend: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group_name: str = "dapo_weight_sync",
        timeout_s: float = 600.0,
        flattened: bool = True,
    ):
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"weight sync: backend must be gloo, nccl or None (follow the engines), got {backend!r}")
        self.master_address = master_address  # "" = weight_group.trainer_address(engines)
        self.master_port = master_port
        self.requested_backend = backend  # None: the engines decide at each connect (engine_group_backend)
        self.backend = backend or ""
        self.bucket_bytes = bucket_bytes
        self.base_group_name = group_name
        self.timeout_s = timeout_s
        self.flattened = flattened
        self._pg = None
        self._members: tuple[str, ...] = ()
        self._group_name = ""
        self._generation = 0
        self._shapes: dict[str, dict[str, list[int]]] = {}
        self.address = ""  # the master address of the current group
        self.history = SyncHistory()  # bounded: counts, totals, the last few

    async def connect(self, clients: list[EngineClient]) -> None:
        """Form a new weight group with exactly these engines (the old one destroyed first)."""
        await self.close(clients)
        plan = await self._plan_group(clients)
        self._pg = await self._form_group(clients, plan)
        self.address = plan.address
        self._members = tuple(c.url for c in clients)
        self._shapes = dict(zip(self._members, await asyncio.gather(*(engine_shapes(c) for c in clients))))
        log.info(
            "weight sync: group %s formed at %s:%d with %d engines (world size %d)",
            self._group_name,
            plan.address,
            plan.port,
            len(clients),
            plan.world_size,
        )

    async def _plan_group(self, clients: list[EngineClient]) -> _GroupPlan:
        """The group's backend (from the engines), name, address and port, and each engine's first rank."""
        infos = await asyncio.gather(*(c.server_info() for c in clients))
        self.backend = self.requested_backend or engine_group_backend(dict(zip((c.url for c in clients), infos)))
        _check_trainer_can_join(self.backend)
        tp_sizes = [int(i.get("tp_size", 1)) for i in infos]
        self._generation += 1
        # unique per trainer and membership: engines may still hold an older group of ours
        self._group_name = f"{self.base_group_name}_{uuid.uuid4().hex[:8]}_{self._generation}"
        address = self.master_address or trainer_address(engine_urls=[c.url for c in clients], backend=self.backend)
        return _GroupPlan(
            address=address,
            port=self.master_port or _free_port(address),
            world_size=1 + sum(tp_sizes),
            rank_offsets=[1 + sum(tp_sizes[:i]) for i in range(len(clients))],  # engine TP rank t: offset + t
        )

    async def _form_group(self, clients: list[EngineClient], plan: _GroupPlan):
        """The trainer opens its side (rank 0, a worker thread) while every engine joins; the first
        failure on either side ends the rendezvous at once, naming the engines (_join_failures)."""
        own = asyncio.get_running_loop().run_in_executor(
            None,
            lambda: open_weight_group(
                backend=self.backend,
                master_address=plan.address,
                master_port=plan.port,
                rank=0,
                world_size=plan.world_size,
                group_name=self._group_name,
                timeout_s=self.timeout_s,
            ),
        )
        joins = [
            asyncio.ensure_future(
                c.init_weights_update_group(
                    master_address=plan.address,
                    master_port=plan.port,
                    rank_offset=off,
                    world_size=plan.world_size,
                    group_name=self._group_name,
                    backend=self.backend,
                )
            )
            for c, off in zip(clients, plan.rank_offsets)
        ]
        # an engine that refuses to join leaves our rendezvous waiting (until timeout_s): fail fast
        done, _ = await asyncio.wait([own, *joins], return_when=asyncio.FIRST_EXCEPTION)
        failures = self._join_failures(clients, own, joins, done, plan)
        if failures:
            for j in joins:
                j.cancel()
            raise EngineError(
                f"weight sync: forming the group {self._group_name} at {plan.address}:{plan.port} failed: "
                f"{_name_failures('init_weights_update_group', failures)}",
                url=next(iter(failures)),
            )
        await asyncio.gather(*joins)
        return own.result()

    def _join_failures(
        self,
        clients: list[EngineClient],
        own: asyncio.Future,
        joins: Sequence[asyncio.Future],
        done: set,
        plan: _GroupPlan,
    ) -> dict[str, BaseException | None]:
        """url (or "trainer") -> why it failed to form the group; empty when every side is still fine."""
        failures = {c.url: j.exception() for c, j in zip(clients, joins) if j in done and j.exception() is not None}
        if own in done and own.exception() is not None:
            # our side timed out: the engines whose join has not returned never reached our store
            for c, j in zip(clients, joins):
                if not j.done():
                    failures[c.url] = TimeoutError(
                        f"did not join within {self.timeout_s:.0f} s; it must reach {plan.address}:{plan.port} (set "
                        f"rollout.weight_sync_address, or NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME)"
                    )
            failures = failures or {"trainer": own.exception()}
        return failures

    def _abandon_group(self) -> None:
        """Forget the trainer's side of a failed or closed group (re-formed at the next sync). Measured
        (torch 2.13, gloo): neither pg.abort() nor pg.shutdown() closes its sockets, so an engine still
        waiting in a broadcast of a failed group waits until the group's timeout: hence the
        reachability check before every bucket (_send_bucket)."""
        self._pg, self._members = None, ()

    async def close(self, clients: list[EngineClient]) -> None:
        """Destroy the group on the engines (also after a failed sync left it in an unknown state)."""
        if not self._members:
            return
        live = [c for c in clients if c.url in self._members]
        await asyncio.gather(
            *(asyncio.wait_for(c.destroy_weights_update_group(self._group_name), 60) for c in live),
            return_exceptions=True,
        )
        self._abandon_group()

    async def sync(
        self,
        clients: list[EngineClient],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str,
        manifest: dict[str, list[int]] | None = None,
        flush_cache: bool = True,
    ) -> SyncStats:
        """Send every tensor to every engine inside one session; returns the sync's statistics."""
        _check_sync_args(clients, weight_version)
        if self._pg is None or self._members != tuple(c.url for c in clients):
            await self.connect(clients)
        if manifest is not None:
            _check_manifest(self._shapes, manifest)
        stats, seen = SyncStats(num_engines=len(clients), weight_version=weight_version), set[str]()
        buckets = _buckets(named_tensors, self.bucket_bytes, flattened=self.flattened)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None  # per thread in CUDA

        def prepare_next() -> _Prepared | None:
            tic = time.perf_counter()
            bucket = next(buckets, None)  # the export: on the driver, its stage's gathers and the stage funnel
            stats.export_seconds += time.perf_counter() - tic
            return self._prepare(bucket, clients, stats, device=device)

        loop = asyncio.get_running_loop()
        tic = time.perf_counter()
        async with weight_update_session(clients):
            pending = loop.run_in_executor(None, prepare_next)
            try:
                while (ready := await pending) is not None:
                    # bucket k+1's export (gathers, stage transfers, merge) and payload run while bucket k is sent
                    pending = loop.run_in_executor(None, prepare_next)
                    await self._send_bucket(
                        clients, ready, stats, weight_version=weight_version, flush_cache=flush_cache
                    )
                    seen.update(ready.names)
            finally:  # never leave the iterator running in a thread: the caller drains it after a failure
                await asyncio.wait([pending])
                if not pending.cancelled():
                    pending.exception()  # retrieved: the error that matters is the one raised above
        stats.seconds = time.perf_counter() - tic
        stats.missing = sorted(set(self._shapes[clients[0].url]) - seen)
        self.history.record(stats)
        log.info(
            "weight sync %s: %d tensors in %d buckets, %d collective calls, %.1f MB in %.2f s to %d engines",
            weight_version,
            stats.num_tensors,
            stats.num_buckets,
            stats.num_collectives,
            stats.bytes / 1e6,
            stats.seconds,
            stats.num_engines,
        )
        return stats

    def _prepare(
        self,
        bucket: list[tuple[str, torch.Tensor]] | None,
        clients: list[EngineClient],
        stats: SyncStats,
        *,
        device: int | None,
    ) -> _Prepared | None:
        """One bucket checked against every engine and its payload made (a worker thread, while the
        previous bucket is broadcast)."""
        if bucket is None:
            return None
        tic = time.perf_counter()
        if device is not None:
            torch.cuda.set_device(device)
        for c in clients:
            check_against(self._shapes[c.url], bucket, engine=c.url)
        tensors = [t.detach() for _, t in bucket]
        payloads = [flat_payload(bucket)] if self.flattened else [t.contiguous() for t in tensors]
        stats.payload_seconds += time.perf_counter() - tic
        return _Prepared(
            names=[n for n, _ in bucket],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            payloads=payloads,
            nbytes=sum(t.numel() * t.element_size() for t in tensors),
        )

    async def _fail_if_unreachable(self, clients: list[EngineClient], *, where: str) -> None:
        """An engine that died since the last bucket: fail before the broadcast, which the others would
        otherwise wait in until the group's timeout (see _abandon_group); a refused connection says it."""
        errors = await asyncio.gather(*(engine_unreachable(c.url) for c in clients))
        down = {c.url: err for c, err in zip(clients, errors) if err is not None}
        if down:
            self._abandon_group()
            raise EngineError(f"{where}: {_name_failures('connecting', down)}", url=next(iter(down)))

    def _post_updates(
        self, clients: list[EngineClient], bucket: _Prepared, *, weight_version: str, flush_cache: bool
    ) -> list[asyncio.Future]:
        """Every engine's /update_weights_from_distributed for this bucket (it then joins the broadcasts)."""
        return [
            asyncio.ensure_future(
                c.update_weights_from_distributed(
                    names=bucket.names,
                    dtypes=bucket.dtypes,
                    shapes=bucket.shapes,
                    group_name=self._group_name,
                    flush_cache=flush_cache,
                    load_format=FLATTENED if self.flattened else None,
                    weight_version=weight_version,
                )
            )
            for c in clients
        ]

    async def _send_bucket(
        self,
        clients: list[EngineClient],
        bucket: _Prepared,
        stats: SyncStats,
        *,
        weight_version: str,
        flush_cache: bool,
    ) -> None:
        await self._fail_if_unreachable(clients, where=f"weight sync {weight_version}: bucket {stats.num_buckets}")
        names, payloads = bucket.names, bucket.payloads
        posts = self._post_updates(clients, bucket, weight_version=weight_version, flush_cache=flush_cache)
        pg = self._pg

        def send_all() -> float:
            tic = time.perf_counter()
            for payload in payloads:
                broadcast_from_trainer(pg, payload)
            return time.perf_counter() - tic

        send = asyncio.get_running_loop().run_in_executor(None, send_all)
        ended: dict[str, float] = {}  # when the broadcast returned, when the last engine answered
        send.add_done_callback(lambda _: ended.setdefault("send", time.perf_counter()))
        for p in posts:
            p.add_done_callback(lambda _: ended.__setitem__("answers", time.perf_counter()))
        # an engine that refuses the bucket never joins the broadcasts: fail at its answer instead of
        # waiting out the group timeout (the blocked broadcast thread ends at timeout_s)
        done, pending = await asyncio.wait([send, *posts], return_when=asyncio.FIRST_EXCEPTION)
        unanswered = [p for p in posts if p in pending]
        if unanswered and any(t.exception() is not None for t in done):  # hear every engine out, briefly
            await asyncio.wait(unanswered, timeout=30)
        failures = {c.url: p.exception() for c, p in zip(clients, posts) if p.done() and p.exception() is not None}
        if send.done() and send.exception() is not None:
            failures["trainer"] = send.exception()
        if not failures:
            await asyncio.gather(send, *posts)
            stats.broadcast_seconds += send.result()
            # the engines load the bucket after receiving it, then answer (an answer can precede our
            # return from the broadcast: gloo returns once the bytes are in the socket buffers)
            stats.answer_seconds += max(0.0, ended.get("answers", 0.0) - ended.get("send", 0.0))
            stats.num_buckets += 1
            stats.num_collectives += len(payloads)
            stats.num_tensors += len(names)
            stats.bytes += bucket.nbytes
            return
        self._abandon_group()  # the group's state is unknown now: re-form it next time
        for p in posts:
            p.cancel()
        raise EngineError(
            f"weight sync {weight_version}: bucket {stats.num_buckets} ({names[0]} ...): "
            f"{_name_failures('update_weights_from_distributed', failures)}",
            url=next(iter(failures)),
        )


# ------------------------------------------------------------------------------------ by tensor
class TensorWeightSync:
    """Trainer side of update_weights_from_tensor (engines sharing the trainer's host and devices)."""

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = bucket_bytes
        self.history = SyncHistory()  # bounded: counts, totals, the last few

    async def close(self, clients: list[EngineClient]) -> None:
        """Nothing to drop: each update_weights_from_tensor call stands alone (no group, no session left)."""

    async def sync(
        self,
        clients: list[EngineClient],
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        weight_version: str,
        manifest: dict[str, list[int]] | None = None,
        flush_cache: bool = True,
    ) -> SyncStats:
        _check_sync_args(clients, weight_version)
        shapes = dict(zip([c.url for c in clients], await asyncio.gather(*(engine_shapes(c) for c in clients))))
        tp_sizes = [int(i.get("tp_size", 1)) for i in await asyncio.gather(*(c.server_info() for c in clients))]
        if manifest is not None:
            _check_manifest(shapes, manifest)
        stats, seen = SyncStats(num_engines=len(clients), weight_version=weight_version), set[str]()
        tic = time.perf_counter()
        async with weight_update_session(clients):
            for bucket in bucketize(named_tensors, self.bucket_bytes):
                for c in clients:
                    check_against(shapes[c.url], bucket, engine=c.url)
                # one payload per engine TP rank, each serialized on its own (never one shared entry)
                calls = [
                    c.update_weights_from_tensor(
                        [serialize_for_engine_rank(bucket) for _ in range(tp)],
                        flush_cache=flush_cache,
                        weight_version=weight_version,
                    )
                    for c, tp in zip(clients, tp_sizes)
                ]
                failures = await _gather_per_engine(clients, calls)
                if failures:
                    raise EngineError(
                        f"weight sync {weight_version}: bucket {stats.num_buckets} ({bucket[0][0]} ...): "
                        f"{_name_failures('update_weights_from_tensor', failures)}",
                        url=next(iter(failures)),
                    )
                stats.num_buckets += 1
                stats.num_tensors += len(bucket)
                stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                seen.update(n for n, _ in bucket)
        stats.seconds = time.perf_counter() - tic
        stats.missing = sorted(set(shapes[clients[0].url]) - seen)
        self.history.record(stats)
        log.info(
            "weight sync %s: %d tensors in %d buckets by tensor, %.1f MB in %.2f s to %d engines",
            weight_version,
            stats.num_tensors,
            stats.num_buckets,
            stats.bytes / 1e6,
            stats.seconds,
            stats.num_engines,
        )
        return stats


# both transports are WeightSyncs (sync_protocol.py): mypy checks each class against the Protocol here
TRANSPORTS: tuple[type[WeightSync], ...] = (DistributedWeightSync, TensorWeightSync)

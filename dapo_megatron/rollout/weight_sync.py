"""Push the trainer's weights into the rollout engines, in size-bounded buckets.

Two transports, both driven from the trainer's global rank 0 over the engines' HTTP API:

(a) DistributedWeightSync (separate engines; SGLang's update_weights_from_distributed protocol):
    once per engine set: POST /init_weights_update_group to every engine (engine i of tp size t
    joins as ranks 1 + sum of earlier tp sizes ...) while rank 0 opens its side of the group
    (TCP rendezvous at master_address:master_port, PrefixStore(group_name), as SGLang's
    init_custom_process_group); then per bucket: POST /update_weights_from_distributed
    {names, dtypes, shapes} to every engine and broadcast each tensor from rank 0 in the same
    order. gloo on CPU, nccl on GPUs.
(b) update_weights_from_tensor (colocated SGLang engines sharing the trainer's GPUs):
    tensors travel as CUDA IPC handles pickled by SGLang's MultiprocessingSerializer
    (sglang.srt.utils.MultiprocessingSerializer + monkey_patch_torch_reductions), base64 in the
    JSON body. GPU-only, written against SGLang 0.5.21's API; NOT verified here. The CPU server
    takes the same field with tensors by value (`serialize_tensors_by_value`).

Names and shapes are checked against the engines' models (GET /get_model_info "parameters", or the
safetensors headers of the engine's checkpoint for engines that do not list them) before each
bucket is sent: a mismatch raises ValueError naming the tensor, before that bucket reaches any
engine. Pass `manifest` (every name and shape) to have the whole sync checked before the first
byte moves. Caches are flushed after; every sync records bytes, seconds and GB/s.

Usage on the trainer (every rank iterates the actor's weights: the TP all-gathers are collectives;
only rank 0 sends):
    sync = DistributedWeightSync(master_address=host, master_port=0, backend="gloo")
    stats = await sync.sync(clients, actor.iter_hf_weights())   # rank 0
    for _ in actor.iter_hf_weights(): pass                      # other ranks
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import json
import os
import socket
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from dapo_megatron.weights.export import bucketize as buckets  # the one bucketizer (size-bounded, order kept)
from dapo_megatron.rollout.client import EngineClient, EngineError

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclass
class SyncStats:
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0  # bytes sent to ONE engine (the broadcast payload)
    seconds: float = 0.0
    num_engines: int = 0
    missing: list[str] = field(default_factory=list)  # engine tensors the trainer did not send

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"weight_sync/tensors": self.num_tensors, "weight_sync/buckets": self.num_buckets,
                "weight_sync/bytes": self.bytes, "weight_sync/seconds": self.seconds,
                "weight_sync/gb_per_s": self.gb_per_s, "weight_sync/engines": self.num_engines}


def check_against(specs: dict[str, list[int]], bucket: list[tuple[str, torch.Tensor]], *, engine: str) -> None:
    for name, tensor in bucket:
        if name not in specs:
            raise ValueError(f"weight sync: tensor '{name}' does not exist in the model of engine {engine}")
        if list(tensor.shape) != list(specs[name]):
            raise ValueError(f"weight sync: tensor '{name}' has shape {list(tensor.shape)}, "
                             f"engine {engine} expects {list(specs[name])}")


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
    """The engine's own parameter list (CPU server), else its checkpoint's (SGLang)."""
    info = await client.model_info()
    if "parameters" in info:
        return {n: spec["shape"] for n, spec in info["parameters"].items()}
    return checkpoint_shapes(info["model_path"])


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_weight_group(*, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, timeout_s: float = 600.0):
    """One side of the trainer<->engines group: rank 0 (the trainer) hosts the TCP store.

    Same rendezvous as SGLang's init_custom_process_group (tcp://addr:port, PrefixStore(group_name)).
    gloo: a bare ProcessGroupGloo (needs no default process group, so a CPU engine can join);
    nccl: torch's _new_process_group_helper, exactly as SGLang builds its side.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import PrefixStore

    timeout = datetime.timedelta(seconds=timeout_s)
    # An explicit TCPStore, not rendezvous("tcp://..."): under torchrun (TORCHELASTIC_USE_AGENT_STORE
    # set) rendezvous makes rank 0 a mere client of a store nobody hosts, and the group never forms.
    store = TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                     wait_for_workers=False)
    store = PrefixStore(group_name, store)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

        pg, _ = _new_process_group_helper(world_size, rank, [], Backend("nccl"), store,
                                          group_name=group_name, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg
    raise ValueError(f"weight sync: backend must be gloo or nccl, got {backend!r}")


def _broadcast(pg, tensor: torch.Tensor) -> None:
    pg.broadcast(tensor, 0).wait()  # ProcessGroup and bare ProcessGroupGloo both have (tensor, root)


class DistributedWeightSync:
    """Trainer side of update_weights_from_distributed. Re-forms the group whenever the set of
    engines changes (an engine dropped, a restarted one re-admitted), since a process group's
    membership is fixed."""

    def __init__(self, *, master_address: str = "127.0.0.1", master_port: int = 0, backend: str = "gloo",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, group_name: str = "dapo_weight_sync",
                 timeout_s: float = 600.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight sync: backend must be gloo or nccl, got {backend!r}")
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.base_group_name = group_name
        self.timeout_s = timeout_s
        self._pg = None
        self._members: tuple[str, ...] = ()
        self._group_name = ""
        self._generation = 0
        self._shapes: dict[str, dict[str, list[int]]] = {}
        self.history: list[SyncStats] = []

    async def connect(self, clients: list[EngineClient]) -> None:
        await self.close(clients)
        infos = await asyncio.gather(*(c.server_info_or_empty() for c in clients))
        tp_sizes = [int(i.get("tp_size", 1)) for i in infos]
        world_size = 1 + sum(tp_sizes)
        self._generation += 1
        # unique per trainer and membership: engines may still hold an older group of ours
        self._group_name = f"{self.base_group_name}_{uuid.uuid4().hex[:8]}_{self._generation}"
        port = self.master_port or _free_port(self.master_address)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(clients))]
        loop = asyncio.get_running_loop()
        own = loop.run_in_executor(None, lambda: open_weight_group(
            backend=self.backend, master_address=self.master_address, master_port=port, rank=0,
            world_size=world_size, group_name=self._group_name, timeout_s=self.timeout_s))
        joins = [c.init_weights_update_group(master_address=self.master_address, master_port=port,
                                             rank_offset=off, world_size=world_size,
                                             group_name=self._group_name, backend=self.backend)
                 for c, off in zip(clients, offsets)]
        # an engine that refuses to join leaves our rendezvous waiting (until timeout_s): fail fast
        tasks = [asyncio.ensure_future(j) for j in joins]
        done, _ = await asyncio.wait([own, *tasks], return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in done if t.exception() is not None]
        if errors:
            for t in tasks:
                t.cancel()
            raise EngineError(f"weight sync: forming the group {self._group_name} failed: {errors[0]}")
        self._pg = own.result()
        self._members = tuple(c.url for c in clients)
        self._shapes = dict(zip(self._members, await asyncio.gather(*(engine_shapes(c) for c in clients))))

    async def close(self, clients: list[EngineClient]) -> None:
        if self._pg is None:
            return
        live = [c for c in clients if c.url in self._members]
        await asyncio.gather(*(c.destroy_weights_update_group(self._group_name) for c in live), return_exceptions=True)
        self._pg, self._members = None, ()

    async def sync(self, clients: list[EngineClient], named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                   manifest: dict[str, list[int]] | None = None, flush_cache: bool = True) -> SyncStats:
        """Send every tensor to every engine; returns the sync's statistics (also in .history)."""
        if not clients:
            raise ValueError("weight sync: no engines to sync")
        if self._pg is None or self._members != tuple(c.url for c in clients):
            await self.connect(clients)
        if manifest is not None:
            for c in clients:
                check_against(self._shapes[c.url], [(n, torch.empty(s, device="meta")) for n, s in manifest.items()],
                              engine=c.url)
        stats, seen = SyncStats(num_engines=len(clients)), set()
        tic = time.perf_counter()
        loop = asyncio.get_running_loop()
        for bucket in buckets(named_tensors, self.bucket_bytes):
            for c in clients:
                check_against(self._shapes[c.url], bucket, engine=c.url)
            names = [n for n, _ in bucket]
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            posts = [asyncio.ensure_future(c.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=self._group_name, flush_cache=False))
                for c in clients]
            tensors = [t.detach().contiguous() for _, t in bucket]
            send = loop.run_in_executor(None, lambda: [_broadcast(self._pg, t) for t in tensors])
            # an engine that refuses the bucket never joins the broadcasts: fail at its answer instead
            # of waiting out the group timeout (the blocked broadcast thread ends at timeout_s)
            done, _ = await asyncio.wait([send, *posts], return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if t.exception() is not None]
            if not errors:
                await asyncio.gather(send, *posts)
            if errors:
                self._pg = None  # the group's state is unknown now: re-form it next time
                raise EngineError(f"weight sync: bucket {stats.num_buckets} ({names[0]} ...) failed: {errors[0]}")
            stats.num_buckets += 1
            stats.num_tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for t in tensors)
            seen.update(names)
        if flush_cache:
            await asyncio.gather(*(c.flush_cache() for c in clients))
        stats.seconds = time.perf_counter() - tic
        stats.missing = sorted(set(self._shapes[clients[0].url]) - seen)
        self.history.append(stats)
        return stats


# ---------------------------------------------------------------------------------- by tensor
def serialize_tensors_by_value(named: list[tuple[str, torch.Tensor]]) -> str:
    """The CPU server's update_weights_from_tensor payload: base64(torch.save(list of (name, tensor)))."""
    buf = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named], buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_tensors_cuda_ipc(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang colocated payload: CUDA IPC handles (no copy) pickled by SGLang's serializer.
    GPU only; needs sglang importable in the trainer's environment. Unverified on these machines."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # device uuids instead of indices (trainer/engine see different orders)
    return MultiprocessingSerializer.serialize(list(named), output_str=True)


async def sync_by_tensor(clients: list[EngineClient], named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: str = "value",
                         flush_cache: bool = True) -> SyncStats:
    """update_weights_from_tensor to every engine, bucket by bucket. transport "value" (CPU server)
    or "cuda_ipc" (colocated SGLang: one payload per engine TP rank)."""
    if transport not in ("value", "cuda_ipc"):
        raise ValueError(f"weight sync: transport must be 'value' or 'cuda_ipc', got {transport!r}")
    serialize = serialize_tensors_by_value if transport == "value" else serialize_tensors_cuda_ipc
    shapes = dict(zip([c.url for c in clients], await asyncio.gather(*(engine_shapes(c) for c in clients))))
    infos = await asyncio.gather(*(c.server_info_or_empty() for c in clients))
    stats, seen = SyncStats(num_engines=len(clients)), set()
    tic = time.perf_counter()
    for bucket in buckets(named_tensors, bucket_bytes):
        for c in clients:
            check_against(shapes[c.url], bucket, engine=c.url)
        payload = serialize(bucket)
        await asyncio.gather(*(c.update_weights_from_tensor([payload] * int(info.get("tp_size", 1)), flush_cache=False)
                               for c, info in zip(clients, infos)))
        stats.num_buckets += 1
        stats.num_tensors += len(bucket)
        stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        seen.update(n for n, _ in bucket)
    if flush_cache:
        await asyncio.gather(*(c.flush_cache() for c in clients))
    stats.seconds = time.perf_counter() - tic
    stats.missing = sorted(set(shapes[clients[0].url]) - seen)
    return stats

"""Weights into colocated engines: each trainer rank hands the engine TP rank on its own GPU its own
CUDA-IPC handles, bucket by bucket, inside one SGLang weight-update session.

    slots = assign_engine_slots(records, trainer_devices())       # once: who feeds which engine TP rank
    transfer = ColocatedTransfer(slots, driver=driver, bucket_bytes=512 << 20)
    stats = transfer.send(actor.iter_hf_weights(), weight_version="step_3")   # collective, every rank

Why per GPU. A colocated engine's TP rank r runs on a GPU that also holds trainer ranks. SGLang's
update_weights_from_tensor takes `serialized_named_tensors`, one entry per engine TP rank, and rank r
deserializes entry r only (managers/tp_worker.py: `MultiprocessingSerializer.deserialize(
recv_req.serialized_named_tensors[self.tp_rank])`); an entry holds CUDA IPC handles, so the tensors
it names must live on rank r's own GPU, or every engine rank reads from one trainer GPU across the
bus and that GPU holds the whole model a second time. So the trainer rank on the engine rank's GPU
serializes its own full copy of the bucket (every rank holds the full tensors: iter_hf_weights
all-gathers over TP/EP and broadcasts over PP), the payloads are gathered on the driver (global rank
0, which speaks HTTP to the engines) and posted as one list per engine, and every rank keeps its
bucket alive until the driver reports that the engines have copied it (the IPC handles point into
it). slime's colocated update does the same gather of per-rank handles
(slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py: gather_object over the
ranks of one engine, then update_weights_from_tensor with the list), and verl's SGLang rollout
serializes per TP rank for the same reason.

The CPU twin runs this code as it is: a trainer rank's "GPU" is its local rank, the CPU engine is
registered with the slot it occupies (serve-rollout --base-gpu-id), and the handles are POSIX
shared-memory segments (tensor_payload.serialize_for_engine_rank), the one function that differs.

Which rank feeds which engine: an engine registers its node and first GPU (registry records "node",
"base_gpu_id", "tp_size": it occupies GPUs base_gpu_id .. base_gpu_id + tp_size - 1 of that node, as
SGLang's --base-gpu-id does with gpu_id_step 1), every trainer rank reports (node, local device), and
the engine TP rank on GPU g of node n is fed by the lowest trainer rank on that GPU. A slot no trainer
rank sits on is an error naming the engine, node and GPU: colocated engines must live on the trainer's
GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from dapo_megatron.actor.parallel import launch_env
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.driver_decides import driver_decides
from dapo_megatron.rollout.client import EngineError
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from dapo_megatron.transfer.weight_sync import SyncStats, check_against, engine_shapes
from dapo_megatron.weights.export import bucketize

T = TypeVar("T")


@dataclass(frozen=True)
class EngineSlot:
    """One engine TP rank: the entry `tp_rank` of the engine's serialized_named_tensors list."""

    url: str
    tp_rank: int
    tp_size: int


def trainer_device() -> tuple[str, int]:
    """(node, local device index) of this process: the GPU it drives, or its local rank on the CPU twin."""
    if torch.cuda.is_available():
        recorded = coll.rank_device()  # the GPU set at start-up, whatever thread asks (collectives.py)
        device = recorded.index if recorded is not None else torch.cuda.current_device()
    else:
        device = launch_env().local_rank  # torchrun's LOCAL_RANK, srun's SLURM_LOCALID
    return socket.gethostname(), device


def assign_engine_slots(records: list[dict], devices: list[tuple[str, int]]) -> dict[int, list[EngineSlot]]:
    """{trainer rank: the engine TP ranks it feeds} from the engines' registrations and every trainer
    rank's (node, device) (devices[rank]). Raises ValueError naming an engine slot no rank sits on."""
    by_device: dict[tuple[str, int], int] = {}
    for rank, where in enumerate(devices):
        by_device.setdefault((where[0], int(where[1])), rank)  # the lowest rank on each GPU feeds it
    out: dict[int, list[EngineSlot]] = {}
    for rec in sorted(records, key=lambda r: r["url"]):
        if rec.get("base_gpu_id") is None or not rec.get("node"):
            raise ValueError(
                f"colocated placement: engine {rec['url']} did not register its node and GPUs "
                f"(registry keys 'node', 'base_gpu_id'): start it with the trainer's launcher "
                f"(launch/slurm/colocated.py, or `dapo-megatron train` locally), or use "
                f"rollout.placement=disaggregated"
            )
        tp = int(rec["tp_size"])
        for r in range(tp):
            where = (rec["node"], int(rec["base_gpu_id"]) + r)
            feeder = by_device.get(where)
            if feeder is None:
                raise ValueError(
                    f"colocated placement: engine {rec['url']} TP rank {r} runs on node {where[0]} "
                    f"GPU {where[1]}, where no trainer rank runs (trainer GPUs: "
                    f"{sorted(set(devices))}); colocated engines must use the trainer's GPUs "
                    f"(rollout.num_engines x rollout.engine_tp <= the trainer's GPUs per node)"
                )
            out.setdefault(feeder, []).append(EngineSlot(rec["url"].rstrip("/"), r, tp))
    return out


@dataclass
class _EngineLists:
    """The driver's per-engine payload lists of one bucket, filled from the gathered slots."""

    tp_sizes: dict[str, int]
    lists: dict[str, list] = field(default_factory=dict)

    def add(self, slot: EngineSlot, payload: str) -> None:
        entries = self.lists.setdefault(slot.url, [None] * slot.tp_size)
        entries[slot.tp_rank] = payload

    def complete(self) -> dict[str, list[str]]:
        for url, tp in self.tp_sizes.items():
            entries = self.lists.get(url, [None] * tp)
            if any(e is None for e in entries):
                missing = [r for r, e in enumerate(entries) if e is None]
                raise RuntimeError(f"colocated weight transfer: no payload for engine {url} TP ranks {missing}")
        return self.lists


class ColocatedTransfer:
    """Collective: every rank calls send() with the same named-tensor stream (iter_hf_weights)."""

    def __init__(
        self, slots: dict[int, list[EngineSlot]], *, driver=None, bucket_bytes: int, verify: bool = False
    ) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.mine = slots.get(self.rank, [])
        self.tp_sizes = {s.url: s.tp_size for feeds in slots.values() for s in feeds}
        self.driver = driver
        self.bucket_bytes = bucket_bytes
        self.verify = verify  # the driver reads every tensor back (GET-weights) and compares bit for bit
        self._shapes: dict[str, dict[str, list[int]]] = {}

    def send(self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str) -> SyncStats:
        """Every tensor to every engine inside one weight-update session. Raises on every rank alike
        (the driver's error, distributed/driver_decides.py) so no rank is left inside a collective."""
        stats = SyncStats(num_engines=len(self.tp_sizes), weight_version=weight_version)
        tic = time.perf_counter()
        seen: set[str] = set()
        try:
            self._on_driver(self._begin, weight_version)
            for bucket in bucketize(named, self.bucket_bytes):
                payloads = [(slot, serialize_for_engine_rank(bucket)) for slot in self.mine]
                gathered = _gather_to_driver(payloads)
                self._on_driver(self._post, bucket, gathered, weight_version)  # the stream is abandoned on all alike
                del payloads, gathered  # the engines have copied the bucket: its handles may go
                stats.num_buckets += 1
                stats.num_tensors += len(bucket)
                stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                seen.update(n for n, _ in bucket)
        except BaseException:
            with contextlib.suppress(EngineError):  # the session is closed; the first error is the one raised
                self._on_driver(self._end)
            raise
        self._on_driver(self._end)
        self._on_driver(self._check_complete, seen)
        stats.seconds = time.perf_counter() - tic
        return stats

    # --- the driver's side (HTTP to the engines); every method returns "" or an error message ------
    def _on_driver(self, fn, *args) -> None:
        """fn on the driver; its error message, or what it raised, is an EngineError on every rank."""

        def decide() -> None:
            try:
                message = fn(*args)
            except Exception as err:  # noqa: BLE001 - every rank must hear about it, not only the driver
                message = f"{type(err).__name__}: {err}"
            if message:
                raise EngineError(message)

        driver_decides(decide)

    def _clients(self):
        clients = {c.url: c for c in self.driver.pool.weight_targets()}
        missing = [u for u in self.tp_sizes if u not in clients]
        if missing:
            raise EngineError(f"colocated weight transfer: engines {missing} are not in the pool (dead?)")
        return [clients[u] for u in self.tp_sizes]

    def _run(self, coro):
        return self.driver.run(coro)

    def _begin(self, weight_version: str) -> str:
        clients = self._clients()
        if not self._shapes:

            async def shapes():
                return await asyncio.gather(*(engine_shapes(c) for c in clients))

            self._shapes = dict(zip(self.tp_sizes, self._run(shapes())))
        failures = self._run(_each(clients, [c.begin_weight_update() for c in clients]))
        if failures:
            self._run(_each(clients, [c.end_weight_update() for c in clients if c.url not in failures]))
            return _describe(f"weight sync {weight_version}: begin_weight_update", failures)
        return ""

    def _post(self, bucket, gathered, weight_version: str) -> str:
        lists = _EngineLists(self.tp_sizes)
        for per_rank in gathered:
            for slot, payload in per_rank:
                lists.add(slot, payload)
        clients = self._clients()
        for c in clients:
            check_against(self._shapes[c.url], bucket, engine=c.url)
        complete = lists.complete()
        failures = self._run(
            _each(
                clients,
                [
                    c.update_weights_from_tensor(complete[c.url], flush_cache=True, weight_version=weight_version)
                    for c in clients
                ],
            )
        )
        if failures:
            return _describe(
                f"weight sync {weight_version}: bucket {bucket[0][0]} ...: update_weights_from_tensor", failures
            )
        if self.verify:
            return self._run(_compare(clients, bucket))
        return ""

    def _end(self) -> str:
        clients = self._clients()
        failures = self._run(_each(clients, [c.end_weight_update() for c in clients]))
        return _describe("weight sync: end_weight_update", failures) if failures else ""

    def _check_complete(self, seen: set[str]) -> str:
        """Colocated engines resumed their weights without content (SGLang's memory saver does not keep
        them): a tensor the trainer did not send would be served as garbage."""
        for url, specs in self._shapes.items():
            missing = sorted(n for n in specs if n not in seen and not _tied_alias(n, seen))
            if missing:
                return (
                    f"colocated weight transfer: engine {url} has tensors the trainer did not send: "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; after a release their content "
                    f"is undefined"
                )
        return ""


def _tied_alias(name: str, seen: set[str]) -> bool:
    """lm_head.weight of a model with tied embeddings is the embedding (SGLang's loaders skip it)."""
    return name == "lm_head.weight" and "model.embed_tokens.weight" in seen


def _gather_to_driver(payloads: list[T]) -> list[list[T]]:
    """Every rank's payloads on rank 0, in rank order ([] on the other ranks)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [payloads]
    out: list[object] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # gather fills it
    coll.gather_object(payloads, out, dst=0)
    return cast(list[list[T]], out or [])  # gather_object put a rank's payloads in every slot


async def _each(clients, calls) -> dict[str, BaseException]:
    results = await asyncio.gather(*calls, return_exceptions=True)
    return {c.url: r for c, r in zip(clients, results) if isinstance(r, BaseException)}


def _describe(what: str, failures: dict[str, BaseException]) -> str:
    return "; ".join(f"engine {url}: {what} failed: {err}" for url, err in failures.items())


async def _compare(clients, bucket) -> str:
    """Read every tensor of the bucket back from every engine (/get_weights_by_name, whole tensor)
    and compare bit for bit; "" or the first difference."""
    for c in clients:
        for name, tensor in bucket:
            rows = tensor.shape[0] if tensor.dim() else 1
            got = torch.tensor(await c.get_weights_by_name(name, truncate_size=rows), dtype=torch.float64)
            want = tensor.detach().to(torch.float64).reshape(got.shape)
            if not torch.equal(got, want):
                diff = (got - want).abs().max().item()
                return (
                    f"weight sync verify: engine {c.url} holds '{name}' differing from the trainer's "
                    f"by up to {diff:.3g}"
                )
    return ""

"""Each pipeline stage exports its own parameters as full HF tensors, gathered over tensor
parallelism onto ONE rank of the stage, in flat buckets.

    exporter = StageExporter(chunks, hf_config, layout, bucket_bytes=512 << 20)   # every rank
    for bucket in exporter.buckets():        # collective within the stage's exporting TP group
        send(bucket.flat, bucket.named)      # on the exporter: one uint8 buffer, HF-named views into it
        del bucket                           # before the next one is merged (at most two buckets live)

Who does what (roles.py): the stage's exporter is its TP rank 0 of DP rank 0 and CP rank 0. Its
TP peers send it their shards (a gather by point-to-point, not an all-gather: nobody else holds a
full tensor); every other DP / CP replica returns at once (their weights are the same). Only the
exporter materialises full tensors, and only a bucket or two of them at a time:

    gather bucket 0 | merge 0 | start gather 1 | yield 0 (consumer sends) | wait 1 | merge 1 | start 2 | yield 1 ...

so bucket k+1's shards travel while bucket k is sent, and the exporter holds at most two buckets
(bucket k's flat buffer and bucket k+1's gathered shards, its own shard not copied). A bucket's
tensors are views of one flat byte buffer, back to back: exactly the bytes of SGLang's
FlattenedTensorBucket for the same names (sglang/srt/weight_sync/tensor_bucket.py), so a bucket
can leave in one broadcast without a copy, and the HF shard writer streams it to disk as it is.

The bucket plan is known before any data moves: each parameter's full size follows from the HF
config (`stage_manifest`), and buckets are consecutive greedy groups of at most bucket_bytes (a
larger parameter alone). `gather_manifests` hands every stage's manifest to the driver (one small
exchange of names and shapes over the exporters' pipeline group).

Per-stage senders (each exporter in its own weight group with the engines, slime's
"slime-pp_{pp_rank}") were weighed against SGLang 0.5.21's source and not built: an engine takes one
update at a time whatever the number of groups (its model_update_lock, the scheduler's loop: receive,
load, answer), so a second stage's broadcast into the same engines would wait for the first's; the
funnel's hop to the driver already runs while the driver broadcasts (docs/architecture.md, "one sender").

slime (THUDM/slime, slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py,
commit 02a644a): every PP stage's DP=TP=0 rank forms its own NCCL group "slime-pp_{pp_rank}" with
the engines and broadcasts its own buckets; its TP ranks all-gather every parameter (each TP rank
holds the full tensor) and it waits for each bucket's broadcast before gathering the next. Here
only the exporter receives the shards, and the next bucket's gather overlaps the current send.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.weights.export import _local_maps
from dapo_megatron.weights.mapping import Dims, expected_hf_shapes, merge_shards_into

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def covers_layout(layout: ParallelLayout) -> bool:
    """Whether this layout's weights can leave by stage exporters. Not yet with expert parallelism
    (actor.ep > 1, or experts split over an expert-TP group other than TP): a stage's experts then
    live on several DP ranks, which this exporter (one DP replica, a TP gather) does not visit.
    Those layouts keep the funnel, weights/export.py's iter_hf_weights, which gathers experts over
    EP on every rank (trainer/placement.py, checkpointing.save_step)."""
    return layout.ep_size == 1 and layout.etp_size == layout.tp_size


@dataclass(frozen=True)
class ExportItem:
    """One megatron parameter of this stage and the full HF tensors it becomes."""

    key: str  # its first HF name
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    kind: str  # shard layout (mapping.py): replicated, vocab, row, qkv, fc1

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def sizes(self) -> list[int]:
        return [self.element_size * int(torch.Size(s).numel()) for s in self.shapes]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes())


def plan_buckets(items: Sequence[ExportItem], max_bytes: int) -> list[list[ExportItem]]:
    """Consecutive groups of at most max_bytes of full tensors (a bigger parameter alone). A new
    group also starts where a tensor's byte offset would not be a multiple of its element size
    (mixed dtypes), the rule of SGLang's flattened buckets: every tensor must view back out."""
    if max_bytes <= 0:
        raise ValueError(f"rollout.weight_bucket_mb: bucket bound must be positive, got {max_bytes} bytes")
    buckets: list[list[ExportItem]] = []
    size = 0
    for item in items:
        if buckets and size + item.nbytes <= max_bytes and size % item.element_size == 0:
            buckets[-1].append(item)
            size += item.nbytes
        else:
            buckets.append([item])
            size = item.nbytes
    return buckets


def bucket_layout(items: Sequence[ExportItem]) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """(name, shape, dtype, byte offset, byte size) of each tensor in the bucket's flat buffer: back
    to back in order, the bytes SGLang's FlattenedTensorBucket holds for the same names."""
    out, offset = [], 0
    for item in items:
        for name, shape, size in zip(item.names, item.shapes, item.sizes()):
            out.append((name, shape, item.dtype, offset, size))
            offset += size
    return out


def bucket_bytes(items: Sequence[ExportItem]) -> int:
    layout = bucket_layout(items)
    return layout[-1][3] + layout[-1][4] if layout else 0


def views_of(flat: torch.Tensor, items: Sequence[ExportItem]) -> list[tuple[str, torch.Tensor]]:
    """The HF-named tensors inside a flat bucket buffer (views, no copy)."""
    return [
        (name, flat[offset : offset + size].view(dtype).view(shape))
        for name, shape, dtype, offset, size in bucket_layout(items)
    ]


@dataclass
class Bucket:
    flat: torch.Tensor  # uint8 [bucket_bytes(items)]
    named: list[tuple[str, torch.Tensor]]
    items: list[ExportItem]


@dataclass
class ExportStats:
    num_buckets: int = 0
    bytes: int = 0  # full-tensor bytes this rank produced (exporter) or 0
    largest_tensor: int = 0  # the largest tensor this rank materialised: a gathered shard list entry or a merged tensor
    peak_held: int = 0  # most bytes held at once by the export on this rank (flat buckets + gathered shards)
    largest_bucket: int = 0


def stage_manifest(
    model_chunks: Sequence[torch.nn.Module], hf_config: PretrainedConfig
) -> list[tuple[ExportItem, torch.Tensor]]:
    """(item, parameter) for every parameter this rank holds, in HF streaming order (no communication)."""
    dims = Dims.from_hf(hf_config)
    local = _local_maps(list(model_chunks), dims)
    shapes = expected_hf_shapes(dims)
    out = []
    for first in (n for n in shapes if n in local):
        pmap, param = local[first]
        names = tuple(pmap.hf_names)
        out.append(
            (
                ExportItem(
                    key=first,
                    names=names,
                    shapes=tuple(tuple(shapes[n]) for n in names),
                    dtype=param.dtype,
                    kind=pmap.kind,
                ),
                param,
            )
        )
    return out


class StageExporter:
    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        hf_config: PretrainedConfig,
        layout: ParallelLayout,
        *,
        bucket_bytes: int,
    ) -> None:
        if not covers_layout(layout):
            raise ValueError(
                f"per-stage weight export: actor.ep={layout.ep_size}, actor.etp={layout.etp_size} "
                f"(tp={layout.tp_size}) is not supported yet; use iter_hf_weights (covers_layout())"
            )
        self.layout = layout
        self.dims = Dims.from_hf(hf_config)
        self.params = stage_manifest(model_chunks, hf_config)
        self.items = [item for item, _ in self.params]
        self.plan = plan_buckets(self.items, bucket_bytes)
        self.bucket_bytes = bucket_bytes
        self.tp_group, self.tp_size = layout.tp_group, layout.tp_size
        self.participates = layout.dp_rank == 0 and layout.cp_rank == 0
        self.is_exporter = self.participates and layout.tp_rank == 0
        self.exporter_rank = dist.get_global_rank(self.tp_group, 0) if self.tp_size > 1 else dist.get_rank()
        self.stats = ExportStats()
        self._held = 0

    # --- the pipeline: gather k+1 while k is consumed ---------------------------------------------
    def buckets(self) -> Iterator[Bucket]:
        """Collective over the exporting TP group of this stage; yields on every participating rank
        (full buckets on the exporter, empty ones on its TP peers), nothing on the other replicas."""
        if not self.participates:
            return
        self.stats = ExportStats()
        by_key = {item.key: param for item, param in self.params}
        pending = self._start(self.plan[0], by_key) if self.plan else None
        for k, items in enumerate(self.plan):
            shards, pending = self._wait(pending), None  # no reference left once a parameter is merged
            bucket = self._merge(items, shards)
            del shards
            pending = self._start(self.plan[k + 1], by_key) if k + 1 < len(self.plan) else None
            self.stats.num_buckets += 1
            yield bucket
            self._release(bucket)
            del bucket  # consumers `del` theirs too: bucket k is gone before bucket k+1 is merged

    def _start(self, items: list[ExportItem], by_key: dict) -> list[tuple[list[torch.Tensor] | None, list]]:
        """Post the TP gathers of one bucket; returns (shards or None, pending works) per item.

        A gather by point-to-point: the exporter posts one irecv per TP peer straight into that
        shard's buffer and keeps its own shard as it is (gloo's gather would stage all shards in one
        temporary on the root and copy them out: one parameter's gathered size more)."""
        started: list[tuple[list[torch.Tensor] | None, list]] = []
        for item in items:
            shard = by_key[item.key].detach()
            if self.tp_size == 1 or item.kind == "replicated":
                started.append(([shard] if self.is_exporter else None, []))
                continue
            shard = shard.contiguous()
            if not self.is_exporter:
                started.append((None, [coll.isend(shard, dst=self.exporter_rank, group=self.tp_group)]))
                continue
            buffers = [shard] + [torch.empty_like(shard) for _ in range(self.tp_size - 1)]
            self._hold(sum(b.numel() * b.element_size() for b in buffers[1:]))
            works = [
                coll.irecv(buf, src=dist.get_global_rank(self.tp_group, r), group=self.tp_group)
                for r, buf in enumerate(buffers)
                if r > 0
            ]
            started.append((buffers, works))
        return started

    def _wait(self, started) -> list[list[torch.Tensor] | None]:
        out = []
        for buffers, works in started or []:
            for work in works:
                work.wait()
            out.append(buffers)
        return out

    def _merge(self, items: list[ExportItem], shards: list[list[torch.Tensor] | None]) -> Bucket:
        """Full HF tensors written into one flat buffer (exporter); an empty bucket on TP peers."""
        if not self.is_exporter:
            return Bucket(flat=torch.empty(0, dtype=torch.uint8), named=[], items=items)
        size = bucket_bytes(items)
        device = shards[0][0].device if shards and shards[0] else "cpu"
        flat = torch.empty(size, dtype=torch.uint8, device=device)
        self._hold(size)
        named = views_of(flat, items)
        out = iter(named)
        for index, item in enumerate(items):
            parts = shards[index]
            assert parts is not None, f"{item.key}: the exporter holds every item's shards"
            views = [next(out)[1] for _ in item.names]
            merge_shards_into(item.kind, parts, views, dims=self.dims)  # no full-size temporary
            self.stats.largest_tensor = max([self.stats.largest_tensor, *(v.numel() * v.element_size() for v in views)])
            if self.tp_size > 1 and item.kind != "replicated":
                self._hold(-sum(b.numel() * b.element_size() for b in parts[1:]))
            shards[index] = None  # the shards go as the parameter is merged
        self.stats.bytes += size
        self.stats.largest_bucket = max(self.stats.largest_bucket, size)
        return Bucket(flat=flat, named=named, items=items)

    def _hold(self, nbytes: int) -> None:
        self._held += nbytes
        self.stats.peak_held = max(self.stats.peak_held, self._held)

    def _release(self, bucket: Bucket) -> None:
        if self.is_exporter:
            self._hold(-bucket.flat.numel())


# ------------------------------------------------------------------------ stages -> the driver


def gather_manifests(exporter: StageExporter) -> list[list[ExportItem]] | None:
    """Every stage's items, in stage order, on the stage exporters (the driver among them): one
    all_gather_object of names and shapes over their pipeline group. None on every other rank."""
    layout = exporter.layout
    if not exporter.is_exporter:
        return None
    if layout.pp_size == 1:
        return [exporter.items]
    out: list = [None] * layout.pp_size
    coll.all_gather_object(out, exporter.items, group=layout.pp_group)
    return out


def weights_for_driver(
    exporter: StageExporter,
    manifests: list[list[ExportItem]] | None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Collective generator, iterated to the end on every rank. The driver (global rank 0) gets
    every stage's buckets of (HF name, full tensor): its own stage's as they are merged, the
    others' received from their exporters, one flat transfer per bucket over the exporters'
    pipeline group, the next bucket's receive posted before the current one is handed on. Later
    stages' exporters send their buckets; their TP peers take part in the gathers; every other
    rank yields nothing. Consumers drop each bucket before asking for the next (at most two live).

    The funnel stays: per-stage senders would gain nothing, an engine taking one update at a time
    (module docstring); a later stage's buckets reach the driver while it broadcasts earlier ones.
    """
    layout = exporter.layout
    if dist.get_rank() == 0:
        assert manifests is not None, "the driver passes every stage's manifest (gather_manifests)"
        yield from _driver_stream(exporter, manifests)
        return
    for bucket in exporter.buckets():
        if exporter.is_exporter and layout.pp_size > 1:
            coll.send(bucket.flat, dst=dist.get_global_rank(layout.pp_group, 0), group=layout.pp_group)
        del bucket


def _driver_stream(
    exporter: StageExporter,
    manifests: list[list[ExportItem]],
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    for bucket in exporter.buckets():
        named = bucket.named
        del bucket
        yield named
        del named
    if exporter.layout.pp_size == 1:
        return
    group = exporter.layout.pp_group
    device = exporter.params[0][1].device
    incoming = [
        (stage, items)
        for stage in range(1, len(manifests))
        for items in plan_buckets(manifests[stage], exporter.bucket_bytes)
    ]

    def post(index):
        stage, items = incoming[index]
        flat = torch.empty(bucket_bytes(items), dtype=torch.uint8, device=device)
        return flat, coll.irecv(flat, src=dist.get_global_rank(group, stage), group=group)

    pending = post(0) if incoming else None
    for index, (_, items) in enumerate(incoming):
        assert pending is not None  # posted for every incoming bucket
        flat, work = pending
        work.wait()
        pending = post(index + 1) if index + 1 < len(incoming) else None
        named = views_of(flat, items)
        del flat
        yield named
        del named


def actor_exporter(actor, *, bucket_bytes: int) -> StageExporter:
    """This rank's part of the per-stage weight export of an Actor: iterate its buckets() on every
    rank; only the stage's exporter holds full tensors."""
    return StageExporter(actor.export_chunks(), actor.hf_config, actor.layout, bucket_bytes=bucket_bytes)

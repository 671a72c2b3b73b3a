"""Send each data-parallel rank its share of the step, as tensors of exact sizes.

    share, stats = scatter_batch(batch if roles.driver else None, layout=layout, settings=...,
                                 sequences_per_mini_batch=...)

Collective over the world. Two levels, so that no rank receives more than its own share:
  1. the driver (global rank 0, holding the whole RolloutBatch) plans every DP rank's share
     (share.plan_shares) and sends share r to the batch source of replica r (its TP/CP/PP rank 0)
     point to point over the data-parallel group: a small header (field names, dtypes, shapes,
     the step's sequence count), then each tensor at its exact size, nothing padded to the largest
     share. All sends are posted before any is waited on.
  2. each batch source broadcasts its share over its replica group (its tensor-, context- and
     pipeline-parallel peers: layout.replica_group, distributed/layout.py).
With NCCL the tensors travel on the current device and come back to the host (the packing works
on the host); with gloo they stay on the CPU. The header is a pickled dict of a few names and
integers (send_object_list), O(fields), never O(tokens).

slime splits the rollout data per DP rank as well (THUDM/slime, slime/ray/rollout.py,
RolloutManager._split_train_data_by_dp: sequence-length-balanced partitions with --balance-data,
one Ray object per DP rank, still Python lists per sample, which every rank of that DP replica
reads from Ray's object store). Here the share is tensors from the start, split per mini-batch
with the actor's own packing plan, and travels over the process groups that already exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.dataplane.share import BatchShare, PackSettings, SharePlan, plan_shares
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout

PLAN_FIELDS = ("micro_batch_sizes", "micro_batches_per_mini", "mini_batch_lengths")


@dataclass
class ScatterStats:
    bytes_received: int = 0  # tensor bytes + header bytes that reached this rank
    share_bytes: int = 0  # bytes of this rank's share tensors (RolloutBatch.nbytes)
    seconds: float = 0.0
    largest_received: int = 0  # the largest single tensor received, bytes


def _header(share: BatchShare) -> dict:
    tensors = _share_tensors(share)
    return {
        "step_sequences": share.step_sequences,
        "tensors": [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()],
    }


def _share_tensors(share: BatchShare) -> dict[str, torch.Tensor]:
    out = {
        f"batch.{k}": v for k, v in share.batch.tensors().items() if k not in ("old_logprobs", "ref_logprobs")
    }  # computed by the ranks themselves
    out.update({f"plan.{k}": getattr(share, k) for k in PLAN_FIELDS})
    return out


def _share_from_tensors(header: dict, tensors: dict[str, torch.Tensor]) -> BatchShare:
    batch_fields = {k.removeprefix("batch."): v for k, v in tensors.items() if k.startswith("batch.")}
    token_fields = {
        k.removeprefix("token_fields."): batch_fields.pop(k)
        for k in list(batch_fields)
        if k.startswith("token_fields.")
    }
    batch = RolloutBatch(**batch_fields, token_fields=token_fields)
    return BatchShare(
        batch=batch, step_sequences=int(header["step_sequences"]), **{k: tensors[f"plan.{k}"] for k in PLAN_FIELDS}
    )


def _wire(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes as uint8 [nbytes]: every field travels as bytes, so dtypes that a backend
    cannot send (int16 routed experts: neither gloo nor NCCL has int16) arrive bit for bit."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).to(device)


def _empty_like_header(header: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """uint8 receive buffers of each field's bytes (_wire's layout)."""
    return {
        name: torch.empty(torch.Size(shape).numel() * getattr(torch, dtype).itemsize, dtype=torch.uint8, device=device)
        for name, dtype, shape in header["tensors"]
    }


def _unwire(header: dict, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        name: buffers[name].cpu().view(getattr(torch, dtype)).view(shape) for name, dtype, shape in header["tensors"]
    }


def _header_bytes(header: dict) -> int:
    import pickle

    return len(pickle.dumps(header))


def scatter_batch(
    batch: RolloutBatch | None, *, layout: ParallelLayout, settings: PackSettings, sequences_per_mini_batch: int
) -> tuple[BatchShare, ScatterStats]:
    """Collective: every rank returns its DP replica's share (module docstring). `batch` on the
    driver (global rank 0), None elsewhere. `layout` gives the process groups (its dp_group and
    replica_group)."""
    tic = time.perf_counter()
    stats = ScatterStats()
    rank, dp_group, replica = dist.get_rank(), layout.dp_group, layout.replica_group
    replica_ranks = dist.get_process_group_ranks(replica)
    source = min(replica_ranks)
    if rank == 0:
        if batch is None:
            raise ValueError("scatter_batch: the driver (rank 0) must pass the step's batch")
        share = _send_shares(
            batch, settings=settings, sequences_per_mini_batch=sequences_per_mini_batch, dp_group=dp_group
        )
    elif rank == source:
        # megatron's order (tp-cp-ep-dp-pp) puts each replica's first rank in rank 0's DP group
        assert 0 in dist.get_process_group_ranks(dp_group), f"rank {rank}: batch source outside the driver's DP group"
        share = _receive(src=0, group=dp_group, stats=stats)
    else:
        share = None
    if len(replica_ranks) > 1:
        share = _broadcast_share(share, src=source, group=replica, stats=stats)
    assert share is not None, f"rank {rank}: no share (not a source and no replica group to receive it)"
    stats.share_bytes = share.batch.nbytes()
    stats.seconds = time.perf_counter() - tic
    return share, stats


def _send_shares(batch: RolloutBatch, *, settings: PackSettings, sequences_per_mini_batch: int, dp_group) -> BatchShare:
    """Driver: plan, cut and post one share per DP source; returns the driver's own (DP rank 0)."""
    dp_ranks = dist.get_process_group_ranks(dp_group)  # the batch sources, DP rank order
    plans: list[SharePlan] = plan_shares(
        batch.seq_lengths, sequences_per_mini_batch=sequences_per_mini_batch, settings=settings, dp_size=len(dp_ranks)
    )
    shares = [BatchShare.from_plan(batch, plan, step_sequences=batch.num_sequences) for plan in plans]
    device = coll.backend_device(dp_group)
    pending = []  # (work, tensor): the sent copy must outlive its send
    for dst, share in zip(dp_ranks[1:], shares[1:]):
        coll.send_object_list([_header(share)], dst=dst, group=dp_group)
        for tensor in _share_tensors(share).values():
            if tensor.numel():  # empty fields (a share of no sequence) are known from the header alone
                sent = _wire(tensor, device)
                pending.append((coll.isend(sent, dst=dst, group=dp_group), sent))
    for work, _ in pending:
        work.wait()
    return shares[0]


def _receive(*, src: int, group, stats: ScatterStats) -> BatchShare:
    box: list[dict | None] = [None]
    coll.recv_object_list(box, src=src, group=group)
    header = box[0]
    assert header is not None, f"no share header from rank {src}"
    tensors = _empty_like_header(header, coll.backend_device(group))
    works = [coll.irecv(t, src=src, group=group) for t in tensors.values() if t.numel()]
    for work in works:
        work.wait()
    _count(stats, header, tensors)
    return _share_from_tensors(header, _unwire(header, tensors))


def _broadcast_share(share: BatchShare | None, *, src: int, group, stats: ScatterStats) -> BatchShare:
    device = coll.backend_device(group)
    box = [_header(share) if share is not None else None]
    coll.broadcast_object_list(box, src=src, group=group)
    header = box[0]
    assert header is not None, f"no share header from rank {src}"
    if share is not None:
        tensors = {k: _wire(v, device) for k, v in _share_tensors(share).items()}
    else:
        tensors = _empty_like_header(header, device)
    for tensor in tensors.values():
        if tensor.numel():
            coll.broadcast(tensor, src=src, group=group)
    if share is not None:
        return share
    _count(stats, header, tensors)
    return _share_from_tensors(header, _unwire(header, tensors))


def _count(stats: ScatterStats, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    stats.bytes_received += sum(sizes) + _header_bytes(header)
    stats.largest_received = max([stats.largest_received, *sizes])

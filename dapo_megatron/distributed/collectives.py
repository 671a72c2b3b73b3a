"""Every collective of the package, with its tensors on the device the group's backend needs.

NCCL moves CUDA tensors only (a CPU tensor fails with "No backend type associated with device type
cpu": the first H100 run died so in parallel.py, 2026-11-25); gloo moves CPU tensors (some of its
ops take CUDA tensors, not all of them, and slowly). A tensor is staged to the backend's device when
it lives elsewhere and the result is copied back into it, so a caller may hand over any tensor:
one made on the default device (CPU) for a handful of counters, or a CUDA bucket for a weight group
that gloo carries (a GPU trainer feeding CPU rollout engines). A tensor already on the right device
moves nothing.

    from dapo_megatron.distributed import collectives as coll
    coll.all_reduce(counts, group=dp_group)                  # in place, like torch.distributed
    coll.broadcast_object_list(box, src=0)                   # the device NCCL needs for the pickle
    coll.pg_broadcast(weight_pg, flat_bucket, src=0)         # a weight group's own ProcessGroup

tests/unit/test_collective_sites.py checks statically that no other module of dapo_megatron calls a
torch.distributed collective itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


# The GPU this rank drives, recorded once at start-up (actor/parallel.init_distributed, right where it
# calls torch.cuda.set_device). torch.cuda.current_device() is per THREAD: a thread that never called
# set_device sees device 0, so the weight-sync executor threads and the rollout-loop thread of local
# rank 3 would stage NCCL tensors on GPU 0 (right only for local rank 0).
_RANK_DEVICE: torch.device | None = None


def set_rank_device(device) -> None:
    """Record this rank's GPU (start-up, once); every later collective stages there, whatever thread calls."""
    global _RANK_DEVICE
    _RANK_DEVICE = torch.device(device)


def rank_device() -> torch.device | None:
    """The GPU recorded by set_rank_device, or None before start-up / on CPU ranks."""
    return _RANK_DEVICE


def compute_device() -> torch.device:
    """The device this rank computes on, from any thread: its GPU recorded at start-up (set_rank_device),
    else the calling thread's current CUDA device (a process that set CUDA up itself: the GPU tests,
    the tools), else the CPU (the gloo twin). The one place the package asks where its tensors go."""
    if _RANK_DEVICE is not None:
        return _RANK_DEVICE
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def staging_device(backend: str, *, current_cuda_index: Callable[[], int] | None = None) -> torch.device:
    """Where a collective of `backend` takes its tensors: NCCL -> the rank's recorded GPU (the calling
    thread's current device only when none was recorded: a process that set up NCCL itself, e.g. the
    GPU tests); any other backend -> CPU. current_cuda_index: None = torch.cuda.current_device (a
    parameter so that a test can stand in for CUDA's per-thread device on a machine without one)."""
    if backend == "nccl":
        if _RANK_DEVICE is not None:
            return _RANK_DEVICE
        return torch.device("cuda", (current_cuda_index or torch.cuda.current_device)())
    return torch.device("cpu")


def backend_device(group=None) -> torch.device:
    """The device a collective over `group` (None: the default group) must get its tensors on."""
    return staging_device(dist.get_backend(group))


def _staged(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _restore(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


class _CopyBackWork:
    """A Work whose wait() also copies the staged receive buffer into the caller's tensor."""

    def __init__(self, work, tensor: torch.Tensor, staged: torch.Tensor):
        self._work, self._tensor, self._staged = work, tensor, staged

    def wait(self, *args, **kwargs) -> bool:
        done = self._work.wait(*args, **kwargs)
        _restore(self._tensor, self._staged)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


# ---------------------------------------------------------------------------------------- tensors
def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    staged = _staged(tensor, backend_device(group))
    dist.all_reduce(staged, op=op, group=group)
    return _restore(tensor, staged)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """torch.distributed.all_gather: rank r's `tensor` lands in tensor_list[r] (on its own device)."""
    device = backend_device(group)
    staged_out = [_staged(t, device) for t in tensor_list]
    dist.all_gather(staged_out, _staged(tensor, device), group=group)
    for out, staged in zip(tensor_list, staged_out):
        _restore(out, staged)
    return tensor_list


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`src` is a global rank, as in torch.distributed.broadcast."""
    staged = _staged(tensor, backend_device(group))
    dist.broadcast(staged, src=src, group=group)
    return _restore(tensor, staged)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    dist.send(_staged(tensor, backend_device(group)), dst=dst, group=group)


def isend(tensor: torch.Tensor, dst: int, group=None):
    """The staged copy (if any) is kept alive by the Work until it completes."""
    staged = _staged(tensor, backend_device(group))
    work = dist.isend(staged, dst=dst, group=group)
    return _CopyBackWork(work, staged, staged) if staged is not tensor else work


def irecv(tensor: torch.Tensor, src: int, group=None):
    """Receive into `tensor`; with a staged buffer the data reaches `tensor` at wait()."""
    staged = _staged(tensor, backend_device(group))
    work = dist.irecv(staged, src=src, group=group)
    return _CopyBackWork(work, tensor, staged) if staged is not tensor else work


def pg_broadcast(pg, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Broadcast over a ProcessGroup object made outside the world's group registry's normal path (a
    trainer<->engines weight group, transfer/weight_group.open_weight_group); `src` is its group rank."""
    device = backend_device(pg)
    staged = _staged(tensor, device)
    held = staged._use_count()  # type: ignore[attr-defined]  # torch's private refcount
    pg.broadcast(staged, src).wait()
    if device.type == "cpu":  # gloo; NCCL's watchdog keeps its Works until the GPU is done: not waited for
        _wait_for_worker_release(staged, held)
    return _restore(tensor, staged)


def _wait_for_worker_release(tensor: torch.Tensor, held: int, timeout_s: float = 10.0) -> None:
    """Return once gloo's worker thread has dropped its references to `tensor` (its use count is back to
    `held`, what the caller held before the collective).

    Why: gloo's Work.wait() returns when the data has arrived, before the worker thread that ran the
    collective destroys the Work, and the Work holds references to the tensor. Giving back the last
    C++ reference to a tensor made in Python takes the GIL (torch 2.13, TensorImpl::decref_pyobject).
    When the caller returns and its process exits at once (an engine's receive, then shutdown), the
    worker can reach that GIL after interpreter finalization has begun: the thread is then unwound out
    of a noexcept destructor and the process aborts with "terminate called without an active exception"
    (gdb on the core: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> decref_pyobject ->
    take_gil -> pthread_exit). Measured on a loaded 2-core machine: 3 aborts in 30 exits without this
    wait; the release itself takes microseconds to a few milliseconds."""
    deadline = time.monotonic() + timeout_s
    while tensor._use_count() > held:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:  # someone else holds it too: the data is there, move on
            uses = tensor._use_count()  # type: ignore[attr-defined]
            log.warning(
                "pg_broadcast: the tensor still has %d references %.0f s after the collective (had %d)",
                uses,
                timeout_s,
                held,
            )
            return
        time.sleep(0.0002)  # releases the GIL, which the worker needs for the release


# ---------------------------------------------------------------------------------------- objects
# torch pickles objects into byte tensors on `device`; the ones without a device argument pick it
# from the group's backend themselves (distributed_c10d._get_object_coll_device).
def broadcast_object_list(object_list: list, src: int = 0, group=None) -> list:
    dist.broadcast_object_list(object_list, src=src, group=group, device=backend_device(group))
    return object_list


def all_gather_object(object_list: list, obj, group=None) -> list:
    dist.all_gather_object(object_list, obj, group=group)
    return object_list


def gather_object(obj, object_gather_list: list | None, dst: int = 0, group=None) -> list | None:
    dist.gather_object(obj, object_gather_list, dst=dst, group=group)
    return object_gather_list


def send_object_list(object_list: list, dst: int, group=None) -> None:
    dist.send_object_list(object_list, dst=dst, group=group, device=backend_device(group))


def recv_object_list(object_list: list, src: int, group=None) -> list:
    dist.recv_object_list(object_list, src=src, group=group, device=backend_device(group))
    return object_list

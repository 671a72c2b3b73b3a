"""Tensor payloads of SGLang's weight-update protocol, for both ends (trainer and CPU engine).

Flattened buckets (update_weights_from_distributed with load_format "flattened_bucket"): the engine
allocates every tensor of the bucket, concatenates their bytes (`tensor.flatten().view(torch.uint8)`,
in the order of `names`) into one uint8 tensor and receives ONE broadcast into it, then views each
tensor back out (sglang/srt/weight_sync/tensor_bucket.py, FlattenedTensorBucket; model_runner_components/
weight_updater.py, _receive_bucketed_weights_from_distributed). `flatten_bucket` builds the same bytes on
the trainer; `unflatten_bucket` is the engine's reading. A tensor's bytes must start at a multiple of
its element size (torch's view(dtype) rule), which `split_for_alignment` guarantees.

update_weights_from_tensor payloads: `serialized_named_tensors` holds one entry per engine TP rank, each
a base64 pickle of [(name, tensor), ...] made by SGLang's MultiprocessingSerializer (ForkingPickler with
torch's tensor reductions: sglang/srt/utils/common.py), serialized separately for every rank (rank r
reads entry r, tp_worker.py deserialize_own_rank; a shared entry breaks CUDA-IPC reference counting).
`serialize_for_engine_rank` is the trainer's side. The tensors do not travel in the body: CUDA tensors
become CUDA IPC handles (SGLang's own serializer, with its device-uuid patch, patch_torch.py), and CPU
tensors become POSIX shared-memory segments (`_cpu_shared_memory`, the one place the CPU path differs:
torch's "file_system" sharing strategy, which, unlike the default file-descriptor passing, needs no
connection between the two processes). Both ends must be on one host: this is the colocated transport.
`deserialize_payload` is the CPU engine's reading, restricted to the globals such a pickle needs (a
subset of SGLang's SafeUnpickler allow list).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import os
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions for tensors and storages


# ------------------------------------------------------------------------------------ flattened
def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_for_alignment(bucket: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Split a bucket where a tensor's byte offset in the flattened bucket would not be a multiple of its
    element size (e.g. an odd count of bf16 elements before an fp32 tensor): the engine could not view
    it back (torch requires the offset of a dtype view to be a multiple of the new element size)."""
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    offset = 0
    for name, tensor in bucket:
        if parts[-1] and offset % tensor.element_size():
            parts.append([])
            offset = 0
        parts[-1].append((name, tensor))
        offset += tensor_nbytes(tensor)
    return parts


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The uint8 tensor SGLang's FlattenedTensorBucket holds for these tensors (same bytes, same order)."""
    if not named:
        raise ValueError("flatten_bucket: empty bucket")
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named])


def unflatten_bucket(
    flat: torch.Tensor, specs: list[tuple[str, torch.dtype, list[int]]]
) -> list[tuple[str, torch.Tensor]]:
    """Views of `flat` as the named tensors (the engine side of one flattened bucket)."""
    out, offset = [], 0
    for name, dtype, shape in specs:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes, the tensors need {offset}")
    return out


def flattened_size(specs: list[tuple[str, torch.dtype, list[int]]]) -> int:
    total = 0
    for _, dtype, shape in specs:
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


# ------------------------------------------------------------------------------- by-tensor payload
@contextlib.contextmanager
def _cpu_shared_memory() -> Iterator[None]:
    """CPU tensors pickled while this is active travel as named shared-memory segments (torch's
    "file_system" strategy: the receiver opens the segment by name). The default strategy passes file
    descriptors through a socket the two processes must share (multiprocessing's resource_sharer, keyed
    by the parent's authkey), which unrelated processes such as a trainer and a server do not."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        _start_shm_manager_off_our_stdio()
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


@functools.cache
def _start_shm_manager_off_our_stdio() -> None:
    """Start torch_shm_manager (libshm forks it at this process's first file_system share) with its stdin
    and stderr on /dev/null instead of ours; its stdout is its own pipe to us. It outlives this process
    while the engine still maps our segments, and under srun our stdio is the job step's: slurmstepd
    waited 60 s for that IO at every end of a colocated Slurm run, requeue included (slurmd.log:
    "Abandoning IO 60 secs after job shutdown initiated", 2026-11-27)."""
    null = os.open(os.devnull, os.O_RDWR)
    saved = {fd: os.dup(fd) for fd in (0, 2)}
    try:
        for fd in saved:
            os.dup2(null, fd)
        torch.empty(1).share_memory_()  # the manager's start; the segment is freed with the tensor
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def _forking_pickle_b64(obj: object) -> str:
    """sglang.srt.utils.MultiprocessingSerializer.serialize(obj, output_str=True), CPU side."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_for_engine_rank(named: list[tuple[str, torch.Tensor]]) -> str:
    """One engine TP rank's entry of update_weights_from_tensor's serialized_named_tensors. Call once per
    rank: each call shares the tensors anew (its own CUDA IPC handles or shared-memory reference)."""
    devices = {t.device.type for _, t in named}
    if devices - {"cpu", "cuda"} or len(devices) > 1:
        raise ValueError(
            f"update_weights_from_tensor: tensors must all be on cpu or all on cuda, got {sorted(devices)}"
        )
    if devices == {"cuda"}:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            # no SGLang in the trainer's environment (a one-GPU machine feeding the CPU engine on its GPU):
            # torch's own CUDA reductions, the handles SGLang's serializer makes, with the device as an
            # index rather than a uuid; both SGLang and the CPU engine read it (rebuild_cuda_tensor is on
            # SGLang's allow list) when trainer and engine see the same CUDA_VISIBLE_DEVICES
            return _forking_pickle_b64([(n, t.detach()) for n, t in named])
        monkey_patch_torch_reductions()  # device uuids, not indices: trainer and engine number GPUs differently
        return MultiprocessingSerializer.serialize([(n, t.detach()) for n, t in named], output_str=True)
    with _cpu_shared_memory():
        shared = []
        for name, tensor in named:
            segment = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()  # one copy, into shm
            segment.copy_(tensor.detach())
            shared.append((name, segment))
        return _forking_pickle_b64(shared)


# Globals a CPU payload may name: what ForkingPickler writes for CPU tensors under the file_system
# strategy. Every entry is also in SGLang's SafeUnpickler.ALLOWED_GLOBALS (checked by the conformance
# tests); file-descriptor passing (rebuild_storage_fd) is left out on purpose (see _cpu_shared_memory).
_DTYPE_NAMES = (
    "float32",
    "float",
    "float16",
    "half",
    "bfloat16",
    "float64",
    "double",
    "int8",
    "uint8",
    "int16",
    "short",
    "int32",
    "int",
    "int64",
    "long",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)
ALLOWED_GLOBALS = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "UntypedStorage"),
        *(("torch", name) for name in _DTYPE_NAMES),
    }
)


class PayloadError(ValueError):
    """An update_weights_from_tensor entry that is not a payload this engine can read."""


# CUDA IPC handles (an engine holding its model on a GPU, serve-rollout --device cuda): torch's rebuild, and
# SGLang's patched one, whose device argument is the GPU's uuid (sglang/srt/utils/patch_torch.py)
CUDA_GLOBALS = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    }
)
# Data types a CUDA IPC payload names beside the rebuild: torch's reduce_tensor passes the storage's class,
# type(tensor._typed_storage()) = torch.storage.TypedStorage, as rebuild_cuda_tensor's storage_cls. Missed until a
# GPU ran it (2026-11-26, H100, torch 2.11: the payload's globals were rebuild_cuda_tensor, torch.Tensor, torch.Size,
# torch.storage.TypedStorage, torch.float32); also on SGLang's allow list.
CUDA_DATA_GLOBALS = frozenset({("torch.storage", "TypedStorage")})
_DEVICE_ARG = (
    6  # the device's position in rebuild_cuda_tensor's arguments (patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX)
)


def _device_index(device: int | str) -> int:
    """SGLang's _device_from_maybe_uuid: an index as is, a uuid to the visible GPU that has it."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise PayloadError(f"the payload's GPU {device} is not visible to this engine")


def _rebuild_cuda_tensor_from_uuid(*args):
    """What SGLang's _rebuild_cuda_tensor_modified does, without importing SGLang."""
    from torch.multiprocessing import reductions

    args = (*args[:_DEVICE_ARG], _device_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, *, cuda: bool = False):
        super().__init__(file)
        self.cuda = cuda

    def find_class(self, module: str, name: str):
        if self.cuda and (module, name) in CUDA_GLOBALS:
            if module.startswith("sglang"):
                return _rebuild_cuda_tensor_from_uuid
            return super().find_class(module, name)
        if self.cuda and (module, name) in CUDA_DATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) not in ALLOWED_GLOBALS:
            where = (
                " (CUDA IPC handles need an engine on a GPU: serve-rollout --device cuda)"
                if (module, name) in CUDA_GLOBALS | CUDA_DATA_GLOBALS
                else ""
            )
            raise PayloadError(f"the payload names {module}.{name}, which a tensor payload never needs{where}")
        return super().find_class(module, name)


def deserialize_payload(data: str, *, cuda: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The CPU engine's reading of one serialized_named_tensors entry: [(name, tensor), ...]. cuda: the
    engine holds its model on a GPU and opens CUDA IPC handles too."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as err:
        raise PayloadError(f"not base64: {err}") from None
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), cuda=cuda).load()
    except PayloadError:
        raise
    except Exception as err:  # noqa: BLE001 - a corrupt pickle, a segment that no longer exists ...
        raise PayloadError(f"cannot unpickle ({type(err).__name__}: {err})") from None
    if not isinstance(obj, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise PayloadError("must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]

"""Run megatron-core on a machine without CUDA (CI, laptops): one start-up call, a no-op on GPUs.

    from dapo_megatron.actor.compat import apply_megatron_compat
    apply_megatron_compat()     # before building any Megatron module (CPU patches: no-op on GPUs)

megatron-core 0.16.1 works on CPU with gloo except for a handful of CUDA-only call sites
(docs/architecture.md, "Running Megatron-Core on CPU"). This module neutralizes exactly those:

  call site (megatron-core 0.16.1)                         what it becomes on CPU
  torch.cuda.current_device()   rotary_pos_embedding.py,   the CPU device
                                param_and_grad_buffer.py
  torch.cuda.get/set_rng_state, manual_seed,              the default CPU generator, so the RNG
  tensor_parallel/random.py _get/_set_cuda_rng_state        tracker's fork() really forks dropout
  torch.cuda.synchronize()      p2p_communication.py        no-op (CPU ops are synchronous)
  device="cuda", .cuda(), pin_memory (~30 files)           CPU, through a TorchFunctionMode
  tensor.type() == 'torch.cuda.FloatTensor' (optimizer,    CPU tensors report the cuda type name
  clip_grads, distrib_optimizer)                           inside the same mode

Mixture-of-experts layers (measured with a Qwen3-MoE GPTModel, EP=2, "alltoall" dispatcher) need
four more:
  torch.cuda.Stream() / current_stream() / stream(s)      one stand-in stream (CPU work is ordered
                      token_dispatcher.py __init__ and        already): wait_stream, record_event,
                      _maybe_dtoh_and_synchronize            synchronize are no-ops
  torch.cuda.Event()  same call sites                      a stand-in event (synchronize: no-op)
  moe_utils.te_general_gemm  router_gating_linear reads    None, the value it has when TE imports
                      the name, which is never bound        (the torch.mm path is then taken)
                      when Transformer Engine is missing
  torch.distributed.all_to_all_single  the dispatcher's    split sizes given as tensors / numpy
                      split sizes (tensors or numpy on      arrays become lists of int (gloo's
                      CPU: maybe_move_tensor_to_cpu only     binding accepts only those)
                      converts CUDA tensors)

`check_patch_targets()` lists the patched symbols that no longer exist (or are imported by value
somewhere, which would escape the patch); tests/distributed/test_compat.py fails on any of them
so a megatron-core upgrade cannot silently bring a CUDA call back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from dapo_megatron.actor import sync_free

if TYPE_CHECKING:
    from torch.types import Device

# (module, attribute, why we patch it). The module path is also where check_patch_targets looks.
PATCH_TARGETS: tuple[tuple[str, str, str], ...] = (
    ("torch.cuda", "current_device", "rotary_pos_embedding.py get_emb, param_and_grad_buffer.py"),
    ("torch.cuda", "get_rng_state", "tensor_parallel/random.py CudaRNGStatesTracker.add"),
    ("torch.cuda", "set_rng_state", "tensor_parallel/random.py"),
    ("torch.cuda", "manual_seed", "tensor_parallel/random.py model_parallel_cuda_manual_seed"),
    ("torch.cuda", "synchronize", "pipeline_parallel/p2p_communication.py"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "CudaRNGStatesTracker.add/fork"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "CudaRNGStatesTracker.add/fork"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "the tracker whose fork() we rely on"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", "called by parallel.py"),
    ("torch.cuda", "Stream", "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__"),
    ("torch.cuda", "Event", "token_dispatcher.py _maybe_dtoh_and_synchronize (d2h_event)"),
    ("torch.cuda", "current_stream", "token_dispatcher.py _maybe_dtoh_and_synchronize"),
    ("torch.cuda", "stream", "token_dispatcher.py _maybe_dtoh_and_synchronize"),
    ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction", "reads te_general_gemm"),
    ("torch.distributed", "all_to_all_single", "tensor_parallel/mappings.py _AllToAll (the MoE dispatcher)"),
    ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_thd", "host syncs (sync_free.py)"),
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl", "host syncs without Apex/TE (sync_free.py)"),
)

# Call sites whose CUDA use the TorchFunctionMode / patches above must cover; a moved file or a
# renamed function means the compat layer needs a fresh look (file relative to megatron/core).
CALL_SITES: tuple[tuple[str, str], ...] = (
    ("models/common/embeddings/rotary_pos_embedding.py", "torch.cuda.current_device()"),
    ("tensor_parallel/random.py", "def _get_cuda_rng_state("),
    ("tensor_parallel/random.py", "def _set_cuda_rng_state("),
    ("pipeline_parallel/p2p_communication.py", "torch.cuda.synchronize()"),
    ("optimizer/clip_grads.py", "'torch.cuda.FloatTensor'"),
    ("optimizer/optimizer.py", "'torch.cuda.FloatTensor'"),
    ("optimizer/distrib_optimizer.py", "'torch.cuda.FloatTensor'"),
    ("transformer/moe/token_dispatcher.py", "torch.cuda.Stream()"),
    ("transformer/moe/token_dispatcher.py", "with torch.cuda.stream(self.cuda_dtoh_stream):"),
    ("transformer/moe/token_dispatcher.py", "self.d2h_event = self.cuda_dtoh_stream.record_event()"),
    ("transformer/moe/moe_utils.py", "if te_general_gemm is not None"),
    ("tensor_parallel/mappings.py", "torch.distributed.all_to_all_single("),
    ("models/common/embeddings/rope_utils.py", "return _apply_rotary_pos_emb_thd("),
    ("optimizer/clip_grads.py", "l2_norm_impl = local_multi_tensor_l2_norm"),
)

_CPU = torch.device("cpu")
_APPLIED = False
_MODE: _CudaToCpuMode | None = None

# CPU tensor type name -> the CUDA name megatron compares against ('torch.FloatTensor' ->
# 'torch.cuda.FloatTensor').
_CUDA_TYPE_NAME = {
    f"torch.{n}": f"torch.cuda.{n}"
    for n in (
        "FloatTensor",
        "DoubleTensor",
        "HalfTensor",
        "BFloat16Tensor",
        "IntTensor",
        "LongTensor",
        "ByteTensor",
        "CharTensor",
        "ShortTensor",
        "BoolTensor",
    )
}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False  # ints are CUDA ordinals only to CUDA code; we never see them on CPU paths


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement to CPU for every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAME.get(name, name)
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False
        if "device" in kwargs and (_is_cuda_device(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and (_is_cuda_device(args[1]) or isinstance(args[1], int)):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _current_device() -> torch.device:
    return _CPU


def _get_rng_state(device: Device = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Device = "cuda") -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # not torch.manual_seed: that calls torch.cuda.manual_seed_all (left unpatched: lazy, harmless)
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(device: Device = -1, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # already a copy


def _megatron_set_cuda_rng_state(new_state: torch.Tensor, device: Device = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class _CpuEvent:
    """Stand-in for torch.cuda.Event: CPU work is complete when the call returns."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, stream: _CpuStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: _CpuStream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for torch.cuda.Stream: one stream, because CPU kernels run in program order. A class
    (other libraries use torch.cuda.Stream in type annotations such as `Stream | None`) whose
    constructor returns the one instance."""

    _instance: _CpuStream | None = None

    def __new__(cls, *args: object, **kwargs: object) -> _CpuStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, stream: _CpuStream) -> None:
        pass

    def wait_event(self, event: _CpuEvent) -> None:
        pass

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _split_sizes_as_ints(sizes: None | list[int] | torch.Tensor | Iterable[int]) -> list[int] | None:
    """Tensor / numpy split sizes -> list of int (what gloo's all_to_all_single accepts)."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    if hasattr(sizes, "tolist"):
        return [int(v) for v in sizes.tolist()]
    return [int(v) for v in sizes]


def _patch_moe() -> None:
    import torch.distributed as dist

    cuda: Any = torch.cuda  # patched on purpose: its classes and functions are replaced by CPU stand-ins
    cuda.Stream = _CpuStream
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Event = _CpuEvent
    bind_missing_te_gemm()
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        return original(
            output,
            input,
            _split_sizes_as_ints(output_split_sizes),
            _split_sizes_as_ints(input_split_sizes),
            group=group,
            async_op=async_op,
        )

    patched: Any = all_to_all_single  # a function attribute: the original, for undoing the patch
    patched._dapo_original = original
    dist.all_to_all_single = all_to_all_single


def bind_missing_te_gemm() -> None:
    """megatron-core's MoE router (moe_utils.RouterGatingLinearFunction) reads `te_general_gemm`, a name
    bound only when Transformer Engine imports: without TE every MoE forward dies with NameError, on
    GPUs too (first H100 run, 2026-11-25). Bound to None, the router takes megatron's own torch path
    (torch.mm / addmm in the router dtype, the same tensors saved for backward): no TE needed.
    Idempotent; leaves TE's GEMM in place where TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _deferred_compile(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile's signature (`compile(fn, **options)` or `compile(**options)(fn)`), compiling with
    `compile_now` at a function's first call instead of when it is decorated."""

    def deferred(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def import_megatron_core() -> None:
    """Import megatron.core; on CPU without importing torch's compiler. megatron decorates its fusions
    with torch.compile at import time (megatron/core/jit.py: jit_fuser), and the first decoration imports
    torch._dynamo and inductor's compile_fx, for functions the CPU path never calls: 6.3 -> 3.7 s of CPU
    for `import megatron.core`; a train rank, which imports torch._dynamo anyway at its first optimizer
    (torch.optim's _disable_dynamo), still saves inductor: 1.3 s of a tiny run's ~6-7.5 s per rank
    (2026-11-27). Every test that starts ranks pays this, so it is the suite's time too. While megatron.core imports,
    torch.compile is a deferred one (jit_fuser keeps it for the life of the process): a decorated
    function is compiled by the real torch.compile at its first call, as torch.compile itself compiles
    at the first call, so one that does run behaves as before. GPUs: the plain import."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        importlib.import_module("megatron.core")
        return
    torch_module: Any = torch  # torch.compile replaced for the import only
    compile_now = torch_module.compile
    torch_module.compile = _deferred_compile(compile_now)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch_module.compile = compile_now


def apply_megatron_compat() -> None:
    """Start-up patches for every machine: what a missing Transformer Engine leaves unbound, megatron's
    host-syncing RoPE (packed sequences) and gradient-norm fallbacks (actor/sync_free.py), then the CPU
    patches (a no-op on GPUs)."""
    import_megatron_core()  # first: the import itself is cheaper on CPU (import_megatron_core)
    bind_missing_te_gemm()
    sync_free.install()
    apply_cpu_compat()


def apply_cpu_compat() -> None:
    """Patch the CUDA-only call sites of megatron-core to CPU. Idempotent; no-op when CUDA exists."""
    global _APPLIED, _MODE
    if _APPLIED or torch.cuda.is_available():
        return
    import_megatron_core()
    cuda: Any = torch.cuda  # patched on purpose (CPU stand-ins; current_device returns the CPU device)
    cuda.current_device = _current_device
    torch.cuda.get_rng_state = _get_rng_state
    torch.cuda.set_rng_state = _set_rng_state
    torch.cuda.manual_seed = _manual_seed
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.random.get_rng_state = _get_rng_state
    torch.cuda.random.set_rng_state = _set_rng_state
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _megatron_get_cuda_rng_state
    mcore_random._set_cuda_rng_state = _megatron_set_cuda_rng_state
    _patch_moe()
    # The mode stays on for the life of the process (it is entered, never exited). Torch function
    # modes are per thread: work done in other threads does not see it (Megatron's CPU paths do
    # not create threads).
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True


def is_applied() -> bool:
    return _APPLIED


def check_patch_targets() -> list[str]:
    """Problems that would make apply_cpu_compat incomplete after a megatron-core upgrade.

    Returns one line per problem (empty list = all good): a patched symbol that no longer exists,
    a patched megatron function imported by value elsewhere (the patch would not reach it), or a
    known call site whose file or text moved.
    """
    problems: list[str] = []
    for module_name, attr, why in PATCH_TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            problems.append(f"{module_name} (patched for {why}) cannot be imported: {err}")
            continue
        if not hasattr(module, attr):
            problems.append(f"{module_name}.{attr} no longer exists (patched for {why}) in {module.__file__}")
    core_file = importlib.import_module("megatron.core").__file__
    assert core_file is not None  # a regular package (an __init__.py), not a namespace package
    core_dir = os.path.dirname(core_file)
    for rel_path, text in CALL_SITES:
        path = os.path.join(core_dir, rel_path)
        if not os.path.exists(path):
            problems.append(f"call site file {path} is gone (expected it to contain {text!r})")
            continue
        with open(path, encoding="utf-8") as handle:
            if text not in handle.read():
                problems.append(f"{path} no longer contains {text!r}: re-check the CPU patch for it")
    by_value = re.compile(r"from\s+[\w.]*random\s+import\s+[^\n]*\b(_get_cuda_rng_state|_set_cuda_rng_state)\b")
    for root, _, files in os.walk(core_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8", errors="replace") as handle:
                match = by_value.search(handle.read())
            if match:
                problems.append(f"{path} imports {match.group(1)} by value: the module patch misses it")
    return problems

"""Where the Triton kernels can run, and how the launchers pick their tile configurations.

Two modes, fixed when dapo_kernels is imported (Triton reads TRITON_INTERPRET when @triton.jit
decorates a kernel):
- compiled (TRITON_INTERPRET unset): CUDA tensors, autotuned over a few Hopper configurations;
- interpreter (TRITON_INTERPRET=1): CPU tensors, one small fixed configuration (multi-config
  autotune needs a driver), and bf16 tiles are cast to fp32 before tl.dot because the
  interpreter's bf16 dot multiplies raw bit patterns.

Anything else (CPU tensors without the interpreter, CUDA tensors with it) raises RuntimeError:
the fused ops never fall back silently. The plain-torch fallback is explicit:
dapo_kernels.linear_logprob_entropy_reference / policy_loss_reference (same signatures).
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


DEBUG_ENV = "DAPO_KERNELS_DEBUG"


def debug_checks() -> bool:
    """DAPO_KERNELS_DEBUG=1 (read at each call): the input checks that need device values on the host.

    Off by default because each costs a device-to-host sync per call (the target-range check reads
    targets.min() and targets.max(): two syncs per micro-batch on a GPU, and a stall of the CPU's launch
    queue). Turn it on to find a packing bug that produces out-of-range token ids; without it such ids
    are not detected (the fused kernel finds no target logit: a wrong log-prob, no error)."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


AUTOTUNE_ENV = "DAPO_KERNELS_AUTOTUNE"


def autotune_every_config() -> bool:
    """DAPO_KERNELS_AUTOTUNE=0 (read when a kernel module is imported): the compiled kernels use their first
    configuration instead of compiling and timing every one for each new (V, H, dtype). For correctness tests
    on a GPU, where that tuning is most of the time (the first H100 run, 2026-11-26: 11 kernel tests in the
    120 s budget). Training and benchmarks keep the default (tune)."""
    return os.environ.get(AUTOTUNE_ENV, "1") not in ("", "0")


def why_not_runnable(device_type: str) -> str | None:
    """None when the fused kernels run on `device_type` tensors in this process, else the reason."""
    if INTERPRET and device_type != "cpu":
        return (
            f"TRITON_INTERPRET=1 is set, so the kernels run in the Triton interpreter, which needs CPU "
            f"tensors; got {device_type} tensors"
        )
    if not INTERPRET and device_type != "cuda":
        return (
            f"the fused Triton kernels need CUDA tensors (got {device_type}); on CPU they run only in the "
            "Triton interpreter: set TRITON_INTERPRET=1 in the environment before the process starts "
            "(slow: tiny models and tests)"
        )
    return None


def require_runnable(*tensors: torch.Tensor, op: str) -> None:
    """RuntimeError when the Triton path cannot run on these tensors in this process."""
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device; got {sorted(devices)}")
    device = devices.pop()
    if INTERPRET and device != "cpu":
        raise RuntimeError(
            f"{op}: TRITON_INTERPRET=1 is set, so the kernels run in the Triton "
            f"interpreter, which needs CPU tensors; got {device} tensors"
        )
    if not INTERPRET and device != "cuda":
        raise RuntimeError(
            f"{op}: the fused Triton kernel needs CUDA tensors (got {device}). Use the plain-torch "
            "fallback dapo_kernels.*_reference (same signature), or set TRITON_INTERPRET=1 in the "
            "environment before importing dapo_kernels to run the kernels in the interpreter (slow, tests only)."
        )


def cast_dot_inputs_to_fp32(dtype: torch.dtype) -> bool:
    """Interpreter workaround: its tl.dot is wrong for bf16 inputs (fp16/fp32 are right)."""
    return INTERPRET and dtype == torch.bfloat16


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count

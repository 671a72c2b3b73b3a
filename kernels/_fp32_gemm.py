"""GEMMs with an fp32 result from 16-bit inputs (the backward's accumulators in logprob.py): on CUDA
torch.mm/addmm(..., out_dtype=float32) (torch >= 2.9; cuBLAS accumulates in fp32 either way, this skips
the rounding of the product to 16 bits); the first failure warns once and falls back to 16-bit products
added in fp32. On CPU (the interpreter tests) plain fp32 matmuls."""

from __future__ import annotations

import warnings

import torch

_OUT_DTYPE_MM = True  # torch.mm/addmm(..., out_dtype=float32) on CUDA (torch >= 2.9); probed on first use


def _out_dtype_mm_failed(err: Exception) -> None:
    global _OUT_DTYPE_MM
    _OUT_DTYPE_MM = False
    warnings.warn(
        f"torch.mm(out_dtype=float32) is unavailable ({err}); falling back to 16-bit products "
        "added in fp32 (one extra rounding per chunk)",
        stacklevel=3,
    )


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (cuBLAS accumulates in fp32 either way; this skips the rounding)."""
    if a.dtype == torch.float32:
        return a @ b
    if not a.is_cuda:
        return a.float() @ b.float()
    if _OUT_DTYPE_MM:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError) as err:
            _out_dtype_mm_failed(err)
    return (a @ b).float()


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc(fp32) += a @ b for 16-bit a, b without an fp32 copy of the inputs."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif not a.is_cuda:
        acc.addmm_(a.float(), b.float())
    else:
        if _OUT_DTYPE_MM:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                return
            except torch.OutOfMemoryError:
                raise
            except (TypeError, RuntimeError, NotImplementedError) as err:
                _out_dtype_mm_failed(err)
        rows = max(1, (64 << 20) // (acc.shape[1] * a.element_size()))  # 16-bit temporaries <= 64 MiB
        for r0 in range(0, acc.shape[0], rows):
            acc[r0 : r0 + rows].add_(a[r0 : r0 + rows] @ b)

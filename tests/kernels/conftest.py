"""tests/kernels run wherever the fused kernels can run: in the Triton interpreter on CPU tensors
(TRITON_INTERPRET=1, set by tests/conftest.py when there is no CUDA), or compiled on a CUDA GPU
(TRITON_INTERPRET unset: tests/gpu/run_all.sh runs `pytest tests/kernels` there). Every test
takes the `device` fixture, so the same assertions check both.

    pytest tests/kernels -q                                   # CPU: interpreter
    env -u TRITON_INTERPRET pytest tests/kernels -q           # on a GPU node: compiled
"""

from __future__ import annotations

import pytest
from kernels_device import DEVICE, RUNNABLE

import dapo_kernels


@pytest.fixture
def device() -> str:
    if not RUNNABLE:
        pytest.skip("the fused kernels need CUDA, or TRITON_INTERPRET=1 set before dapo_kernels is imported")
    return DEVICE


@pytest.fixture(autouse=True)
def _small_interpreter_tiles(monkeypatch):
    """In the interpreter, pin small tiles (16 x 64 x 32): the odd shapes below then span several
    vocab tiles per program (the online rescaling) and partial tiles on every edge. Compiled
    launches autotune over the Hopper configurations as in production, or use the first of them under
    DAPO_KERNELS_AUTOTUNE=0 (tests/gpu/run_all.sh's kernel_tests step)."""
    import dapo_kernels.logprob as logprob_mod

    if dapo_kernels.INTERPRET:
        monkeypatch.setattr(logprob_mod, "INTERPRET_TILE_CAPS", {"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32})

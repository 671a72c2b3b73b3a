"""Where tests/kernels run: CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py when there is no CUDA), else CUDA tensors and compiled kernels. A module of its
own (not conftest.py) so test files can import it by a name no other test folder uses."""

import torch

import dapo_kernels
from helpers_dispatch import AtenOps  # noqa: F401 - the kernel tests import it from here

DEVICE = "cpu" if dapo_kernels.INTERPRET else "cuda"
RUNNABLE = dapo_kernels.INTERPRET or torch.cuda.is_available()

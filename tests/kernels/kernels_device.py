"""Where tests/kernels run: CPU tensors in the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py when there is no CUDA), else CUDA tensors and compiled kernels. A module of its
own (not conftest.py) so test files can import it by a name no other test folder uses."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dapo_kernels

DEVICE = "cpu" if dapo_kernels.INTERPRET else "cuda"
RUNNABLE = dapo_kernels.INTERPRET or torch.cuda.is_available()


class AtenOps(TorchDispatchMode):
    """Records the name of every aten op run inside it. A host read of a tensor's value (.item(), int(t),
    float(t)) is aten._local_scalar_dense: on a GPU, a device-to-host sync."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

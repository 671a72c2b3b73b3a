"""Recording the aten ops a piece of code runs (the kernel and host-sync tests share it)."""

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """Records the name of every aten op run inside it. A host read of a tensor's value (.item(), int(t),
    float(t)) is aten._local_scalar_dense: on a GPU, a device-to-host sync."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

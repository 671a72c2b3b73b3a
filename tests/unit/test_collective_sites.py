"""Every torch.distributed collective of dapo_megatron goes through distributed/collectives.py, the one
place that puts a collective's tensors on the device the group's backend needs.

The class of bug this catches: a tensor made on the default device (CPU) handed to a collective over
an NCCL group ("No backend type associated with device type cpu"), as actor/parallel.py's replica
group set-up did on the first H100 (2026-11-25): on CPU every group is gloo, so no CPU run can see it.
A call site that reaches torch.distributed (or a ProcessGroup object) directly is named here with its
file and line; through the helper the tensor is staged to the backend's device by construction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"
HELPER = PACKAGE / "distributed" / "collectives.py"

# torch.distributed functions that move tensors (or pickled objects in tensors) between ranks
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
    "all_reduce_coalesced",
    "all_gather_coalesced",
}
# ProcessGroup methods (a weight group is a bare ProcessGroup: pg.broadcast(t, 0).wait())
PG_METHODS = {
    "broadcast",
    "allreduce",
    "allgather",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "send",
    "recv",
    "alltoall",
    "alltoall_base",
    "gather",
    "scatter",
}


def _dist_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to torch.distributed, and collective functions imported by name from it."""
    modules, functions = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "torch.distributed",
            "torch.distributed.distributed_c10d",
        ):
            for a in node.names:
                if a.name in COLLECTIVES:
                    functions.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "distributed":
                    modules.add(a.asname or a.name)
    return modules, functions


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def direct_collective_calls(source: str, filename: str = "<src>") -> list[str]:
    """`file:line name` of every collective called on torch.distributed or a ProcessGroup object."""
    tree = ast.parse(source, filename)
    modules, functions = _dist_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in functions:
            found.append(f"{filename}:{node.lineno} {func.id}")
        elif isinstance(func, ast.Attribute):
            owner = _dotted(func.value)
            if (
                owner in modules
                and func.attr in COLLECTIVES
                or (
                    owner
                    and owner.split(".")[-1] in ("pg", "group", "process_group", "weight_pg")
                    and func.attr in PG_METHODS
                )
            ):
                found.append(f"{filename}:{node.lineno} {owner}.{func.attr}")
    return found


def test_no_collective_bypasses_the_device_helper():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HELPER:
            continue
        offenders += direct_collective_calls(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not offenders, (
        "collectives called directly (use dapo_megatron.distributed.collectives, which puts "
        "the tensors on the device the group's backend needs):\n" + "\n".join(offenders)
    )


def test_checker_finds_each_spelling():
    """The check itself: each way of reaching a collective is reported, with its line."""
    src = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "import torch.distributed",
            "from torch.distributed import all_gather as ag",
            "from torch import distributed as d2",
            "def f(pg, group):",
            "    mine = torch.tensor([1])",
            "    dist.all_gather([mine], mine)",  # 8: actor/parallel.py:152's call, 2026-11-25
            "    torch.distributed.all_reduce(mine)",  # 9
            "    ag([mine], mine)",  # 10
            "    d2.broadcast_object_list([1], src=0)",  # 11
            "    pg.broadcast(mine, 0).wait()",  # 12
            "    dist.barrier()",  # not a tensor collective
            "    dist.get_rank()",
        ]
    )
    lines = [int(x.split(":")[1].split()[0]) for x in direct_collective_calls(src)]
    assert lines == [8, 9, 10, 11, 12]


# --------------------------------------------------------------------------- the helper's decisions
def test_backend_device_follows_the_group(monkeypatch):
    from dapo_megatron.distributed import collectives as coll

    monkeypatch.setattr(coll.dist, "get_backend", lambda group=None: {"w": "gloo", "n": "nccl"}[group])
    monkeypatch.setattr(coll.torch.cuda, "current_device", lambda: 3)
    assert coll.backend_device("w") == torch.device("cpu")
    assert coll.backend_device("n") == torch.device("cuda", 3)


def test_a_tensor_already_on_the_backend_device_moves_nothing():
    from dapo_megatron.distributed import collectives as coll

    x = torch.tensor([1.0, 2.0])
    assert coll._staged(x, torch.device("cpu")) is x  # in place, no copy (the staging itself runs in
    # tests/gpu/test_transfer_gpu.py: CPU tensors over NCCL, CUDA tensors over gloo)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

"""megatron's parallel_state is read in one place: actor/parallel.py builds this rank's ParallelLayout
(distributed/layout.py) from it once, and every other component receives that layout as an argument.

Only megatron's own model construction still reads it, as megatron's layers do (actor/model.py,
moe.py, attention.py, compat.py). A getter call anywhere else hides what a function depends on (the
layout is not in its signature) and reads a global that model_parallel() destroys on exit. Issue 42
item 3 moved the last 26 such calls (weights/export.py, weights/load.py, tools/parity.py) onto the
layout; this test keeps it so, by walking the syntax trees (no import runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_megatron"
ALLOWED = {
    "actor/parallel.py",  # builds the layout (layout_from_megatron) and owns the groups' lifetime
    "distributed/layout.py",  # the layout itself
    # megatron's model construction, which reads parallel_state inside megatron's own layers
    "actor/model.py",
    "actor/moe.py",
    "actor/attention.py",
    "actor/compat.py",
}
MODULE = "megatron.core.parallel_state"


def parallel_state_uses(source: str, filename: str = "<src>") -> list[str]:
    """`file:line how` of every import of megatron's parallel_state (and of any name from it), and of
    every attribute reached through (megatron.)core.parallel_state after an `import megatron...`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno} import {a.name}" for a in node.names if a.name.startswith(MODULE)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module.startswith(MODULE):
                found.append(f"{filename}:{node.lineno} from {module} import ...")
            elif module == "megatron.core":
                names = [a.name for a in node.names if a.name == "parallel_state"]
                found += [f"{filename}:{node.lineno} from {module} import {n}" for n in names]
        elif isinstance(node, ast.Attribute) and node.attr == "parallel_state":
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "core") or (
                isinstance(owner, ast.Name) and owner.id == "core"
            ):
                found.append(f"{filename}:{node.lineno} core.parallel_state")
    return found


def test_parallel_state_is_read_only_where_the_layout_is_built_and_the_model_constructed():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative not in ALLOWED:
            offenders += parallel_state_uses(path.read_text(), f"dapo_megatron/{relative}")
    assert not offenders, (
        "megatron's parallel_state read outside actor/parallel.py and the model construction: take the "
        "ParallelLayout (distributed/layout.py) as an argument instead:\n" + "\n".join(offenders)
    )


def test_the_checker_finds_each_spelling():
    src = "\n".join(
        [
            "import megatron.core.parallel_state as ps",  # 1
            "from megatron.core import parallel_state",  # 2
            "from megatron.core.parallel_state import get_tensor_model_parallel_rank",  # 3
            "from megatron.core import tensor_parallel",  # not parallel_state
            "import megatron.core",
            "def f():",
            "    from megatron.core import parallel_state, tensor_parallel",  # 7: inside a function too
            "    return megatron.core.parallel_state.get_data_parallel_rank()",  # 8
            "from megatron import core",
            "core.parallel_state.get_tensor_model_parallel_group()",  # 10
            "# from megatron.core import parallel_state: a comment is no use",
        ]
    )
    lines = sorted(int(x.split(":")[1].split()[0]) for x in parallel_state_uses(src))
    assert lines == [1, 2, 3, 7, 8, 10]


def test_every_allowed_file_exists():
    """A moved or renamed module must take its entry along (an entry for a file that is gone allows nothing)."""
    assert sorted(f for f in ALLOWED if not (PACKAGE / f).is_file()) == []

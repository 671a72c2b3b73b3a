"""Rules of the code's shape that a reader relies on, checked by walking the syntax trees:

- a test module never imports another test module: shared test code lives in a conftest.py or a
  helper module (tests/helpers_*.py, tests/integration/rollout_helpers.py), so running, moving or
  deleting one test file never changes another's collection;
- the project's own modules are imported at the top of a file: an import inside a function hides a
  dependency (and an import cycle) from the reader and from tests/unit/test_layers.py. Inside functions
  only heavy third-party imports belong (megatron, transformers, modelopt, sglang: seconds of start-up
  the CLI must not pay for a command that does not use them), plus a small budget of own imports that
  must stay lazy (a module that pulls one of those packages in at import time);
- a function of the package reads as one responsibility: at most MAX_FUNCTION_LINES lines (def to last
  line, nested functions included), the longer ones named in LONG_FUNCTIONS with their length today, a
  list that can only shrink (a function may get shorter, never longer; one split below the limit must
  leave the list), and none over MAX_ANY_FUNCTION_LINES (issue 42 item 4).

    pytest tests/unit/test_code_shape.py
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"dapo_megatron": REPO / "dapo_megatron", "dapo_kernels": REPO / "kernels"}

# issue 35 item 5: at most 40 own imports inside functions in the whole package.
MAX_OWN_IMPORTS_IN_FUNCTIONS = 40

# issue 42 item 4: functions by responsibility. Target: at most 10 functions over 60 lines, none over 100.
MAX_FUNCTION_LINES = 60
MAX_ANY_FUNCTION_LINES = 100
# (file, qualified name) -> its length when the rule came (2026-11-27; 38 over 60 and 6 over 100 before
# issue 42). Shrink only.
LONG_FUNCTIONS: dict[tuple[str, str], int] = {}  # empty since issue 42 (2026-11-27): no function over 60 lines
OVER_100_ALLOWED: set[tuple[str, str]] = set()  # none: the launch sequence is named steps (issue 42)


def _test_module_imports(tests_root: Path) -> list[str]:
    """'file:line imports test_x' for every import of a test module (test_*.py) by any file under tests_root."""
    found = []
    for path in sorted(tests_root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = ["." * node.level + (node.module or "")]
                if node.module is None or node.level:  # `from . import test_x`
                    prefix = "." * node.level + (f"{node.module}." if node.module else "")
                    modules += [prefix + alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.rsplit(".", 1)[-1].startswith("test_"):
                    found.append(f"{path.relative_to(tests_root.parent)}:{node.lineno} imports {module}")
    return found


def own_imports_in_functions(packages: dict[str, Path] = PACKAGES, repo: Path = REPO) -> dict[str, list[int]]:
    """{file relative to the repo: [line of each import of dapo_megatron / dapo_kernels inside a function]}."""
    own = tuple(packages)
    found: dict[str, list[int]] = {}
    for root in packages.values():
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            lines = []
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Import):
                        lines += [node.lineno for a in node.names if a.name.split(".")[0] in own]
                    elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in own):
                        lines.append(node.lineno)
            if lines:
                found[str(path.relative_to(repo))] = sorted(set(lines))  # a nested function: counted once
    return found


def test_no_test_module_imports_another_test_module():
    found = _test_module_imports(REPO / "tests")
    assert not found, "move the shared code into a conftest.py or a tests/helpers_*.py module:\n" + "\n".join(found)


def test_the_rule_sees_an_import_of_a_test_module(tmp_path):
    suite = tmp_path / "suite"  # a test tree of its own (not named tests/: test_repo_references reads paths)
    (suite / "unit").mkdir(parents=True)
    (suite / "unit" / "test_a.py").write_text(
        "import os\nfrom helpers_x import y\n\ndef f():\n    from test_b import helper\n    import tests.unit.test_c\n"
    )
    (suite / "conftest.py").write_text("from .unit import test_a\n")
    assert _test_module_imports(suite) == [
        "suite/conftest.py:1 imports .unit.test_a",
        "suite/unit/test_a.py:5 imports test_b",
        "suite/unit/test_a.py:6 imports tests.unit.test_c",
    ]


def test_own_imports_inside_functions_stay_within_budget():
    found = own_imports_in_functions()
    total = sum(map(len, found.values()))
    listing = "\n".join(
        f"{len(lines):3d} {f}: lines {lines}" for f, lines in sorted(found.items(), key=lambda kv: -len(kv[1]))
    )
    assert total <= MAX_OWN_IMPORTS_IN_FUNCTIONS, (
        f"{total} imports of dapo_megatron/dapo_kernels inside functions (at most {MAX_OWN_IMPORTS_IN_FUNCTIONS}): "
        f"import them at the top of the file; where that module pulls a heavy package at import time, make "
        f"that import lazy at its use instead\n{listing}"
    )


def test_the_count_sees_nested_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import os\nimport pkg.top\n\ndef f():\n    import json\n    from pkg import a\n    from . import b\n"
        "    def g():\n        import pkg.c, os\n\nclass K:\n    def h(self):\n        from .d import e\n"
    )
    assert own_imports_in_functions({"pkg": pkg}, tmp_path) == {"pkg/m.py": [6, 7, 9, 13]}


def function_lengths(root: Path = PACKAGES["dapo_megatron"], repo: Path = REPO) -> dict[tuple[str, str], int]:
    """(file relative to the repo, Class.method / outer.inner name) -> lines from `def` to its last line."""
    found: dict[tuple[str, str], int] = {}

    def walk(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found[(path, name)] = (child.end_lineno or child.lineno) - child.lineno + 1
                walk(child, name + ".", path)
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".", path)

    for path in sorted(root.rglob("*.py")):
        walk(ast.parse(path.read_text(), filename=str(path)), "", str(path.relative_to(repo)))
    return found


def long_function_findings(
    lengths: dict[tuple[str, str], int], long_functions: dict[tuple[str, str], int] = LONG_FUNCTIONS
) -> list[str]:
    """What breaks the rule: a long function not in LONG_FUNCTIONS, one that grew, an entry that is
    gone or no longer long (take it out of the list), one over MAX_ANY_FUNCTION_LINES not allowed."""
    out = []
    for key, n in sorted(lengths.items()):
        if n > MAX_ANY_FUNCTION_LINES and key not in OVER_100_ALLOWED:
            out.append(f"{key[0]} {key[1]}: {n} lines (over {MAX_ANY_FUNCTION_LINES}): split it")
        elif n > MAX_FUNCTION_LINES and key not in long_functions:
            out.append(f"{key[0]} {key[1]}: {n} lines (over {MAX_FUNCTION_LINES}): split it by responsibility")
        elif key in long_functions and n > long_functions[key]:
            out.append(f"{key[0]} {key[1]}: {n} lines, {long_functions[key]} allowed: it may only get shorter")
    for key in sorted(long_functions):
        if lengths.get(key, 0) <= MAX_FUNCTION_LINES:
            out.append(
                f"{key[0]} {key[1]}: no longer over {MAX_FUNCTION_LINES} lines (or gone): drop it from LONG_FUNCTIONS"
            )
    return out


def test_functions_stay_within_their_length():
    findings = long_function_findings(function_lengths())
    assert not findings, "\n".join(findings)


def test_the_length_rule_sees_growth_new_long_functions_and_stale_entries():
    allowed = {("suite/z.py", "h"): 70, ("suite/w.py", "k"): 65}
    lengths = {("suite/z.py", "h"): 71, ("suite/x.py", "C.f"): 61, ("suite/y.py", "g"): 101, ("suite/v.py", "j"): 60}
    assert long_function_findings(lengths, allowed) == [
        "suite/x.py C.f: 61 lines (over 60): split it by responsibility",
        "suite/y.py g: 101 lines (over 100): split it",
        "suite/z.py h: 71 lines, 70 allowed: it may only get shorter",
        "suite/w.py k: no longer over 60 lines (or gone): drop it from LONG_FUNCTIONS",
    ]


def test_the_length_counts_methods_and_nested_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("class K:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert function_lengths(pkg, tmp_path) == {("pkg/m.py", "K.f"): 4, ("pkg/m.py", "K.f.g"): 2}

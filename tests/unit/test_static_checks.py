"""The package, the kernels and the tests are clean under ruff (lint and format), the package and kernels
under mypy, all configured in pyproject.toml.

    ruff check dapo_megatron kernels tests
    ruff format --check dapo_megatron kernels tests
    mypy                      (files and options: pyproject.toml [tool.mypy])

Each check runs as the command a developer types, so a failure here reads the same as there. Together
they take ~10-25 s of CPU on a 2-core machine (mypy from a cold cache most of it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# everything ruff checks: the tests too (issue 42 item 1), so a test file is held to the same rules as the code
LINTED = ["dapo_megatron", "kernels", "tests"]


def _tool(name: str) -> str:
    """The tool installed beside this interpreter (the test extra pins it: constraints.txt)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -c constraints.txt -e '.[test]'")
    return found


def _run(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_ruff_lint_is_clean():
    # E501 (line length) is checked with the format below: ruff format wraps the code lines, and what it
    # cannot wrap (strings, comments) must be short already
    proc = _run(_tool("ruff"), "check", "--output-format", "json", "--extend-ignore", "E501", *LINTED)
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode in (0, 1), proc.stderr
    rows = [
        f"{Path(f['filename']).relative_to(REPO)}:{f['location']['row']}: {f['code']} {f['message']}" for f in findings
    ]
    assert not rows, "ruff check (fix them, or `ruff check --fix`):\n" + "\n".join(rows)


def test_ruff_format_is_clean_and_no_line_is_too_long():
    proc = _run(_tool("ruff"), "format", "--check", *LINTED)
    assert proc.returncode == 0, "ruff format --check (run `ruff format dapo_megatron kernels tests`):\n" + proc.stdout
    proc = _run(_tool("ruff"), "check", "--select", "E501", "--output-format", "concise", *LINTED)
    assert proc.returncode == 0, proc.stdout


def test_mypy_is_clean():
    proc = _run(
        sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(REPO / ".mypy_cache"), timeout=300
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 2: mypy itself failed (config, crash)
    errors = [line for line in proc.stdout.splitlines() if re.match(r"^\S+\.py:\d+: error:", line)]
    assert not errors, "mypy:\n" + "\n".join(errors)

"""Session fixtures built once per test run, also when pytest-xdist runs the suite on several workers.

xdist gives each worker its own session, so a session fixture would be built once per worker: the
tiny model's warm start and the reference runs would then be paid twice. `built_once` builds the value
in a directory shared by the run's workers (the parent of the workers' base temp directories) under a
file lock: the first worker to ask builds it, the others wait and read the same value. A build that
failed fails every worker that asks, with the first worker's error, instead of being retried.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """build(root) once per test run, root a fresh directory named `name`; returns its value (pickled
    for the other workers: paths, lists, dicts)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # .../pytest-N/, above every worker's popen-gwK/
    root = shared / name
    value_file, failure_file = shared / f"{name}.pickle", shared / f"{name}.failed"
    skip_file = shared / f"{name}.skipped"
    with FileLock(str(shared / f"{name}.lock")):
        if failure_file.exists():
            pytest.fail(f"{name}, built by another worker, failed:\n{failure_file.read_text()}", pytrace=False)
        if skip_file.exists():
            pytest.skip(skip_file.read_text())
        if value_file.exists():
            return pickle.loads(value_file.read_bytes())
        root.mkdir()
        try:
            value = build(root)
        except pytest.skip.Exception as skipped:
            skip_file.write_text(str(skipped))
            raise
        except BaseException:
            failure_file.write_text(traceback.format_exc())
            raise
        value_file.write_bytes(pickle.dumps(value))
        return value

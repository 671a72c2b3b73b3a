"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (munged, slurmctld, slurmd) on localhost for the whole session
    (tests/slurm_cluster.py). Skips only when the Debian binaries are not installed; teardown stops
    the daemons by their pid files and fails if any is left running."""
    from slurm_cluster import LocalSlurm, missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm binaries not installed ({', '.join(missing)}): run .ci/system_deps.sh")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        pids = dict(cluster.started)
        cluster.stop()  # raises if a daemon survives
        assert not cluster.still_running(), f"Slurm daemons left running: {pids}"


@pytest.fixture(scope="session")
def tiny_run_a(tmp_path_factory):
    """The uninterrupted 4-step tiny run (tiny_cpu.yaml, disaggregated; test_train_tiny.py's settings)
    and its warm-start cache, made once for the session: test_train_tiny.py checks it, and the
    colocated and fault tests compare their runs with it (same cache, so the same model)."""
    from helpers_train import train_tiny

    root = tmp_path_factory.mktemp("train")
    cache = root / "cache"
    return {"root": root, "cache": cache, "a": train_tiny(root / "a", cache, "trainer.total_steps=4")}

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

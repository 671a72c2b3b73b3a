"""Fixtures of the integration tests. The costly ones are built once per session and shared by every
test that names them (issue 42 item 9), also across pytest-xdist's workers where built_once
(tests/helpers_shared.py) shares them: ask for them by name, and read each one's docstring for what
a test may do with it.

    slurm_cluster       one-node Slurm on localhost                     ~3 s      session
    multihost_cluster   three network-namespace hosts under one Slurm   ~3-10 s   session, healed per test
    tiny_cache          tiny_cpu.yaml's model, warm-started 300 steps   ~15 s     session
    multihost_tiny      engine interpreter + one-host reference run     ~35 s     session
    tiny_run_a          the 4-step tiny run (from tiny_cache)           ~25 s     session
    multihost_binaries  skips the test where the multi-host binaries are missing
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (munged, slurmctld, slurmd) on localhost for the whole session
    (tests/slurm_cluster.py; ~3 s to start). Skips only when the Debian binaries are not installed;
    teardown stops the daemons by their pid files and fails if any is left running.
    A test may submit jobs (each into its own tmp_path) and must wait for or cancel them; it must never
    stop, kill or reconfigure the daemons (a test of stopping starts its own LocalSlurm:
    test_slurm_jobs.py::test_cluster_stop_leaves_nothing_running)."""
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
def tiny_cache(tmp_path_factory):
    """tiny.cache_dir holding tiny_cpu.yaml's tiny model warm-started 300 steps on its 2000 train
    prompts (`python -m dapo_megatron.launch.prepare`), built once for the session: the tiny runs
    (tiny_run_a and the tests comparing with it) and the multi-host tests' model (helpers_multihost:
    same data, steps and seed, hence the same cache entry) all read it. Read-only for every test."""
    import subprocess
    import sys

    from helpers_shared import built_once
    from helpers_train import ROOT

    def build(root):
        cache = root / "cache"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dapo_megatron.launch.prepare",
                str(ROOT / "configs/runs/tiny_cpu.yaml"),
                f"trainer.output_dir={root / 'prep'}",
                f"tiny.cache_dir={cache}",
                "tiny.warm_start_steps=300",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return cache

    return built_once(tmp_path_factory, "tiny_cache", build)


@pytest.fixture(scope="session")
def tiny_run_a(tmp_path_factory, tiny_cache):
    """The uninterrupted 4-step tiny run (tiny_cpu.yaml, disaggregated; test_train_tiny.py's settings)
    and its warm-start cache (tiny_cache), made once for the session (~40 s on 2 idle cores): test_train_tiny.py
    checks it, and the colocated, overlap and fault tests compare their runs with it (same cache, so
    the same model). Returns {"root", "cache", "a": helpers_train.train_tiny's result for root/"a"}.
    A test may read everything and start its own runs in new folders under "root" with "cache" as
    their tiny.cache_dir (the warm start is then a cache hit); it must not write, move or delete
    anything under root/"a" or in the cache (later tests read them)."""
    from helpers_shared import built_once
    from helpers_train import train_tiny

    def build(root):
        return {"root": root, "cache": tiny_cache, "a": train_tiny(root / "a", tiny_cache, "trainer.total_steps=4")}

    return built_once(tmp_path_factory, "train", build)


@pytest.fixture(scope="session")
def multihost_binaries():
    """Skips the test where a multi-host cluster cannot start (Slurm, munge, ip, unshare, nsenter not
    installed), as slurm_cluster does; for tests that build their own MultiHostSlurm."""
    from multihost_cluster import missing_binaries

    missing = missing_binaries()
    if missing:
        pytest.skip(f"multi-host binaries not installed ({', '.join(missing)}): run .ci/system_deps.sh")


@pytest.fixture(scope="session")
def _multihost_session(tmp_path_factory, multihost_binaries):
    from multihost_cluster import MultiHostSlurm

    # stop() on exit raises naming any namespace, link, daemon or /etc/netns entry left behind
    with MultiHostSlurm(tmp_path_factory.mktemp("mh3"), hosts=3) as cluster:
        yield cluster


@pytest.fixture
def multihost_cluster(_multihost_session):
    """Three hosts (network namespaces with their own address, hostname and Debian-style /etc/hosts)
    joined by one real Slurm (tests/multihost_cluster.py), started once for the session (~3 s idle,
    ~10 s loaded) and stopped at its end (teardown fails naming anything left behind). Skips where the
    binaries are missing (multihost_binaries).
    A test may submit jobs, run commands on hosts (cluster.on_host), cut links, kill hosts and restart
    their slurmd: after each test heal() cancels our jobs, restores every link and slurmd and waits
    until every node is idle, so the next test finds the cluster as started. A test must not stop the
    cluster or its slurmctld/munged, nor change slurm.conf; a test of the cluster's own start and stop
    builds its own MultiHostSlurm (test_multihost_cluster.py). Tests needing two hosts take hosts[:2]."""
    yield _multihost_session
    _multihost_session.heal()


@pytest.fixture(scope="session")
def multihost_tiny(tmp_path_factory, tiny_cache):
    """The multi-host tests' tiny run, prepared once for the session (helpers_multihost.prepare_multihost_tiny,
    ~50 s on 2 idle cores): {"root", "model": the warm-started model's directory, "engine_python": a
    second interpreter path for the engines, "one_host": the metrics records of the one-host reference
    run of helpers_multihost.SHORT's layout}. Read-only: a test runs from "model" (model.path=...,
    tiny.enabled=false) into its own tmp_path and compares with "one_host"; it must not write under
    "root"."""
    from helpers_multihost import prepare_multihost_tiny
    from helpers_shared import built_once

    return built_once(tmp_path_factory, "mhshared", lambda root: prepare_multihost_tiny(root, cache=tiny_cache))

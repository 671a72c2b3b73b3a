"""The whole tiny run across three hosts (tests/multihost_cluster.py: network namespaces with their own
address, hostname and Debian-style /etc/hosts, one real Slurm): `dapo-megatron slurm submit` of
configs/runs/tiny_cpu.yaml (shortened) with slurm.nodes=2, so the two DP ranks are on two hosts, and
an engine array of one CPU engine, which lands on the third host (--exclusive: each job owns its
nodes). The engines run another interpreter path than the trainer (slurm.engine_python: a second
venv directory sharing the packages).

Learning: the code is deterministic for a given layout (same prompts, same per-sample seeds, the same
sampled tokens; the DP all-reduce of two gloo ranks sums in the same order over a veth as over
loopback), so the three-host run must give the same per-step metrics as the one-host run of the same
layout (`dapo-megatron train`: torchrun with 2 ranks and one engine on this machine), exactly, fp32
losses and gradient norms included, and the same held-out avg@k.

    pytest -m slurm tests/integration/test_multi_host.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers_multihost import REPO, STEPS, run_env, write_config
from helpers_runs import logs as run_logs
from helpers_runs import metrics
from helpers_train import EXACT_KEYS, FLOAT_KEYS

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]


def logs(run_dir: Path, *, tail: int = 5000) -> str:
    return run_logs(run_dir, named=True, tail=tail)


@pytest.fixture
def cluster(multihost_cluster):
    """The session's three-host cluster (conftest.py), healed after each test: these tests cut links and
    lose hosts, and heal() brings every host and node back for the next."""
    return multihost_cluster


@pytest.fixture
def shared(multihost_tiny):
    return multihost_tiny


def submit(cluster, shared, run_dir: Path, *overrides: str, env_extra: dict | None = None) -> dict[str, str]:
    cfg = write_config(run_dir.parent / f"{run_dir.name}.yaml", trainer={"output_dir": str(run_dir)})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "slurm",
            "submit",
            str(cfg),
            "--engines",
            "1",
            "--skip-data-check",
            f"model.path={shared['model']}",
            "tiny.enabled=false",
            f"slurm.engine_python={shared['engine_python']}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**run_env(), **cluster.env, **(env_extra or {})},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ids = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.startswith(("train: ", "engines: ")))
    assert set(ids) == {"train", "engines"}, out.stdout
    return ids


def node_of(cluster, job: str) -> list[str]:
    out = cluster.run(["squeue", "-h", "-j", job, "-o", "%N"], check=False).stdout.strip()
    return cluster.run(["scontrol", "show", "hostnames", out], check=False).stdout.split() if out else []


def engine_interpreters(run_dir: Path) -> set[str]:
    """argv[0] of each registered engine process (the registration names its pid; one pid space here)."""
    seen = set()
    for path in (run_dir / "engines").glob("*.json"):
        try:
            pid = json.loads(path.read_text())["pid"]
            seen.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except (OSError, ValueError, KeyError):
            continue
    return seen


def test_run_across_three_hosts_learns_as_on_one_host(cluster, shared, tmp_path):
    run_dir = tmp_path / "run"
    ids = submit(cluster, shared, run_dir)
    started = time.monotonic()
    trainer_nodes, engine_nodes, interpreters = [], [], set()
    while cluster.job_states([ids["train"]]).get(ids["train"]) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() - started < 600, logs(run_dir)
        trainer_nodes = trainer_nodes or node_of(cluster, ids["train"])
        engine_nodes = engine_nodes or node_of(cluster, ids["engines"])
        interpreters |= engine_interpreters(run_dir)
        time.sleep(1)
    assert cluster.job_states([ids["train"]]) == {ids["train"]: "COMPLETED"}, logs(run_dir)
    hosts = {h.name for h in cluster.hosts}
    # the trainer's two ranks on two hosts, the engine on the third
    assert len(trainer_nodes) == 2 and len(engine_nodes) == 1 and set(trainer_nodes + engine_nodes) == hosts, (
        trainer_nodes,
        engine_nodes,
    )
    assert interpreters == {str(shared["engine_python"])}, interpreters  # not the trainer's sys.executable
    text = logs(run_dir, tail=10**6)
    # each rank chose its host's eth0 toward the other host, never 127.0.1.1
    by_name = {h.name: h.address for h in cluster.hosts}
    for node in trainer_nodes:
        assert f"gloo/nccl interface eth0 ({by_name[node]})" in text, text[-4000:]
    ours, theirs = metrics(run_dir), shared["one_host"]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(STEPS + 1))
    for mine, ref in zip(ours, theirs):
        for key in EXACT_KEYS + FLOAT_KEYS + ("eval/avg@k", "eval/pass@k"):
            assert mine.get(key) == ref.get(key), (mine["step"], key, mine.get(key), ref.get(key))
    assert ours[-1]["eval/avg@k"] is not None
    print(
        f"\n[multi-host] three-host run: {time.monotonic() - started:.0f} s; trainer on {trainer_nodes}, "
        f"engine on {engine_nodes}; step rewards {[r.get('reward/mean') for r in ours[1:]]}"
    )


# ------------------------------------------------------------------------------------------- faults
def _engine_record(run_dir: Path) -> dict | None:
    for path in (run_dir / "engines").glob("*.json"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def _server_info(url: str, run_dir: Path) -> dict | None:
    import urllib.request

    from dapo_megatron.rollout.auth import read_secret_file, run_secret_path

    try:
        headers = read_secret_file(run_secret_path(run_dir)).header_for("GET", "/server_info")
        with urllib.request.urlopen(urllib.request.Request(f"{url}/server_info", headers=headers), timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _host_named(cluster, name: str):
    (host,) = [h for h in cluster.hosts if h.name == name]
    return host


def _wait_for(what, check, *, timeout_s: float, poll_s: float = 0.2, logs_of: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while (value := check()) in (None, False, [], {}):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s\n" + (
            logs(logs_of) if logs_of else ""
        )
        time.sleep(poll_s)
    return value


def _finish(cluster, ids, run_dir: Path, timeout_s: float = 600) -> None:
    states = cluster.wait_done([ids["train"]], timeout_s=timeout_s)
    assert states == {ids["train"]: "COMPLETED"}, logs(run_dir)


def _same_as_one_host(run_dir: Path, shared) -> None:
    ours, theirs = metrics(run_dir), shared["one_host"]
    assert [r["step"] for r in ours] == list(range(STEPS + 1)), [r["step"] for r in ours]  # none lost, none twice
    for mine, ref in zip(ours, theirs):
        for key in EXACT_KEYS + ("eval/avg@k",):
            assert mine.get(key) == ref.get(key), (mine["step"], key, mine.get(key), ref.get(key))


def test_engine_host_cut_off_for_20_s_mid_rollout(cluster, shared, tmp_path):
    """The engine host's cable pulled (its bridge port down) while step 2's rollout runs, plugged back
    20 s later: the requests wait in TCP retransmission and the run goes on; every step once, with the
    one-host run's data."""
    run_dir = tmp_path / "run"
    ids = submit(cluster, shared, run_dir)
    _wait_for("step 1 logged", lambda: any(r["step"] == 1 for r in metrics(run_dir)), timeout_s=400, logs_of=run_dir)
    engine = _host_named(cluster, node_of(cluster, ids["engines"])[0])
    seen = len(_train_log(run_dir))
    cluster.cut_link(engine)
    try:
        time.sleep(20)
    finally:
        cluster.restore_link(engine)
    _finish(cluster, ids, run_dir)
    _same_as_one_host(run_dir, shared)
    # what the run did meanwhile: waited in TCP retransmission (no [engines] line), or dropped the
    # engine and took it back once it answered (pool.discover), re-synced, and redid the rollout
    said = [line for line in _train_log(run_dir)[seen:].splitlines() if line.startswith("[engines]")]
    step2 = next(r for r in metrics(run_dir) if r["step"] == 2)
    print(
        f"\n[multi-host] link cut 20 s: step 2 generation {step2.get('time/gen_s', float('nan')):.1f} s; "
        f"engine events: {said or 'none (the requests waited)'}"
    )


def _train_log(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm/logs").glob("train-*.out")))


def test_engine_host_lost_during_weight_sync_is_requeued_and_resynced(cluster, shared, tmp_path):
    """The engine frozen (SIGSTOP) as soon as a weight-update session is open, so that the trainer is
    inside the sync (a tiny model's session lasts ~0.1 s), then every process of its host SIGKILLed
    (slurmd too: the host is gone) and the host back 3 s later (a reboot: its slurmd starts again).
    The sync fails at once (the engine's sockets are reset), Slurm requeues the engine's array task
    (its batch job is missing from the node that came back), the engine registers again and the
    trainer re-syncs it before sending it any request: the run's data equal the one-host run's.
    The CPU engine holds each session open 1 s (DAPO_CPU_ENGINE_SESSION_HOLD_S, a fault-test knob of the
    stand-in): polling for a 0.1 s session missed every one of a 2-step run on a quiet machine (then
    waited out 400 s and failed, 2026-11-26)."""
    import signal

    run_dir = tmp_path / "run"
    ids = submit(cluster, shared, run_dir, env_extra={"DAPO_CPU_ENGINE_SESSION_HOLD_S": "1"})
    record = _wait_for("engine registered", lambda: _engine_record(run_dir), timeout_s=400, logs_of=run_dir)
    engine = _host_named(cluster, node_of(cluster, ids["engines"])[0])
    _wait_for(
        "a weight-update session open",
        lambda: (_server_info(record["url"], run_dir) or {}).get("cpu_engine", {}).get("weight_update_session_open"),
        timeout_s=400,
        poll_s=0.02,
        logs_of=run_dir,
    )
    os.kill(int(record["pid"]), signal.SIGSTOP)
    seen = len(_train_log(run_dir))
    time.sleep(2)
    assert "[engines]" not in _train_log(run_dir)[seen:]  # frozen, not failed: the sync waits on it
    killed_at = time.monotonic()
    assert cluster.kill_host(engine)
    noticed = _wait_for(
        "the trainer gives up on the engine",
        lambda: [line for line in _train_log(run_dir)[seen:].splitlines() if line.startswith("[engines]")],
        timeout_s=120,
        poll_s=0.1,
        logs_of=run_dir,
    )
    failed_after = time.monotonic() - killed_at
    time.sleep(max(0.0, 3 - failed_after))
    cluster.start_slurmd(engine)
    _finish(cluster, ids, run_dir)
    text = logs(run_dir, tail=10**6)
    assert "restart 1)" in text, text[-4000:]  # the engine's array task ran again (--requeue)
    assert "registered after" in text and "re-syncing the weights of step" in text, text[-4000:]
    _same_as_one_host(run_dir, shared)
    print(
        f"\n[multi-host] engine host lost during a sync: the trainer gave up on it {failed_after:.1f} s after "
        f"the kill ({noticed[0][:160]}); the run finished {time.monotonic() - killed_at:.0f} s after the kill"
    )


def test_trainer_host_lost_requeues_and_resumes_from_the_newest_checkpoint(cluster, shared, tmp_path):
    """Every process of the second trainer host SIGKILLed once step 1's checkpoint is complete (the host
    is gone). The rank on the first host fails at once, but srun waits for the lost host's tasks: the job
    ends when Slurm marks the node DOWN (SlurmdTimeout, 30 s here, 300 s by default) and requeues it
    (--requeue). The host comes back (a reboot) and the requeued job resumes from the newest
    checkpoint, logging the steps after it with the one-host run's data."""
    run_dir = tmp_path / "run"
    ids = submit(cluster, shared, run_dir)
    _wait_for(
        "checkpoint of step 1",
        lambda: (run_dir / "checkpoints" / "step_000001").is_dir(),
        timeout_s=400,
        logs_of=run_dir,
    )
    first, second = node_of(cluster, ids["train"])
    lost = _host_named(cluster, second)
    killed_at = time.monotonic()
    assert cluster.kill_host(lost)
    _wait_for(
        "the lost node marked down", lambda: cluster.node_state(lost).startswith("down"), timeout_s=180, logs_of=run_dir
    )
    _wait_for(
        "the job requeued",
        lambda: "Restarts=1" in cluster.run(["scontrol", "-o", "show", "job", ids["train"]], check=False).stdout,
        timeout_s=120,
        logs_of=run_dir,
    )
    requeued_after = time.monotonic() - killed_at
    cluster.start_slurmd(lost)  # back after a reboot: the requeued job gets its two nodes again
    _finish(cluster, ids, run_dir)
    text = logs(run_dir, tail=10**6)
    assert f"job {ids['train']} restart 1:" in text, text[-4000:]
    # the lost node's job kept its engines for the requeue (on 3eb0efe's script it cancelled them)
    assert (
        "Slurm requeues the job (--requeue)" in text
        and "cancelling the rollout engines" not in text.split(f"job {ids['train']} restart 1:")[0]
    ), text[-4000:]
    (resumed,) = [line for line in text.splitlines() if line.startswith("[job] requeued (restart 1): resuming from")]
    assert resumed.endswith(("step_000001", "step_000002")), resumed  # the newest complete checkpoint
    _same_as_one_host(run_dir, shared)
    print(
        f"\n[multi-host] trainer host lost: job requeued {requeued_after:.0f} s after the kill, finished "
        f"{time.monotonic() - killed_at:.0f} s after it"
    )

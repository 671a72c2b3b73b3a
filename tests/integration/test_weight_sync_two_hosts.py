"""Weight sync across two hosts: two network namespaces joined by a veth pair made here (root and
`ip netns` needed; skipped with the reason otherwise). The CPU engine serves in one, the trainer's sync
runs in the other (two_host_trainer.py): the weight group's master address must be the trainer's
address on the link (chosen from the route to the engine, or GLOO_SOCKET_IFNAME's interface), every
tensor arrives bit for bit, and a loopback master address (what trainer/driver.py passed before) fails naming
the engine that could not join, instead of hanging.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rollout_helpers import REPO, make_tiny_checkpoint

HERE = Path(__file__).resolve().parent


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def two_hosts():
    """(engine namespace, trainer namespace, engine address, trainer address, engine ifname, trainer ifname)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed (.ci/system_deps.sh installs it)")
    tag = uuid.uuid4().hex[:6]
    ns_engine, ns_trainer, if_engine, if_trainer = f"dmE{tag}", f"dmT{tag}", f"veE{tag}", f"veT{tag}"
    net = f"10.{random.randint(16, 250)}.{random.randint(0, 250)}"
    probe = _ip("netns", "add", ns_engine)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here (`ip netns add`: {probe.stderr.strip()}); needs root")
    try:
        steps = [("netns", "add", ns_trainer),
                 ("link", "add", if_engine, "type", "veth", "peer", "name", if_trainer),
                 ("link", "set", if_engine, "netns", ns_engine), ("link", "set", if_trainer, "netns", ns_trainer),
                 ("-n", ns_engine, "addr", "add", f"{net}.1/24", "dev", if_engine),
                 ("-n", ns_trainer, "addr", "add", f"{net}.2/24", "dev", if_trainer),
                 ("-n", ns_engine, "link", "set", if_engine, "up"), ("-n", ns_trainer, "link", "set", if_trainer, "up"),
                 ("-n", ns_engine, "link", "set", "lo", "up"), ("-n", ns_trainer, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build the two-namespace network (`ip {' '.join(step)}`: {done.stderr.strip()})")
        yield ns_engine, ns_trainer, f"{net}.1", f"{net}.2", if_engine, if_trainer
    finally:
        for ns in (ns_engine, ns_trainer):  # deleting a namespace deletes its end of the veth pair
            _ip("netns", "del", ns)


def test_weight_sync_between_two_network_namespaces(two_hosts, tmp_path):
    ns_engine, ns_trainer, engine_addr, trainer_addr, if_engine, if_trainer = two_hosts
    model = make_tiny_checkpoint(tmp_path / "model", seed=0)
    register = tmp_path / "engines"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    log = open(tmp_path / "engine.log", "wb")
    # gloo picks its interface from GLOO_SOCKET_IFNAME (the host name resolves to an address no
    # namespace here has), as NCCL does from NCCL_SOCKET_IFNAME on a cluster
    engine = subprocess.Popen(["ip", "netns", "exec", ns_engine, sys.executable, "-m", "dapo_megatron.cli",
                               "serve-rollout", "--model", str(model), "--host", engine_addr, "--port", "0",
                               "--threads", "1", "--register-dir", str(register)],
                              stdout=log, stderr=subprocess.STDOUT, env={**env, "GLOO_SOCKET_IFNAME": if_engine})
    try:
        deadline = time.monotonic() + 300
        while not list(register.glob("*.json")):
            assert engine.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-3000:]
            time.sleep(0.2)
        url = json.loads(next(register.glob("*.json")).read_text())["url"]
        out = tmp_path / "trainer.json"
        trainer = subprocess.run(["ip", "netns", "exec", ns_trainer, sys.executable, str(HERE / "two_host_trainer.py"),
                                  url, str(model), str(out)], capture_output=True, text=True, timeout=600,
                                 env={**env, "GLOO_SOCKET_IFNAME": if_trainer})
        assert trainer.returncode == 0, trainer.stderr[-4000:]
        result = json.loads(out.read_text())
    finally:
        engine.kill()
        engine.wait(60)
        log.close()
    # the trainer's address on the link, found both from the route and from the interface name
    assert result["routed_address"] == result["ifname_address"] == result["group_address"] == trainer_addr
    assert result["mismatched"] == [] and result["checked"] == 27  # every tensor bit for bit
    assert result["collectives"] == result["buckets"] > 1
    # loopback (trainer/driver.py before): the engine cannot reach the trainer's store; the error names it
    assert result["loopback_error"] and f"engine {url}: init_weights_update_group failed" in result["loopback_error"]
    assert "did not join" in result["loopback_error"]
    assert result["sessions_left_open"] is False

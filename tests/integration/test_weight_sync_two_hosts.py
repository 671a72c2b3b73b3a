"""Weight sync across two hosts: two hosts of tests/multihost_cluster.py (network namespaces with their
own address on a bridge, own hostname, Debian-style /etc/hosts mapping the host's own name to
127.0.1.1). The CPU engine serves on one, the trainer's sync runs on the other (two_host_trainer.py):
the weight group's master address must be the trainer's address on the link (chosen from the route to
the engine, or GLOO_SOCKET_IFNAME's interface), every tensor arrives bit for bit, and a loopback master
address (what trainer/driver.py passed before) fails naming the engine that could not join, instead of
hanging. The engine is given no GLOO_SOCKET_IFNAME: its gloo interface is the one that routes to the
trainer (transfer/weight_group.open_weight_group); its own name resolves to 127.0.1.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rollout_helpers import REPO, make_tiny_checkpoint

HERE = Path(__file__).resolve().parent


def test_weight_sync_between_two_network_namespaces(multihost_cluster, tmp_path):
    engine_host, trainer_host = multihost_cluster.hosts[:2]
    engine_addr, trainer_addr = engine_host.address, trainer_host.address
    model = make_tiny_checkpoint(tmp_path / "model", seed=0)
    register = tmp_path / "engines"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115 (closed in the finally below)
    engine = subprocess.Popen(
        multihost_cluster.on_host(
            engine_host,
            [
                sys.executable,
                "-m",
                "dapo_megatron.cli",
                "serve-rollout",
                "--model",
                str(model),
                "--host",
                engine_addr,
                "--port",
                "0",
                "--threads",
                "1",
                "--register-dir",
                str(register),
            ],
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not list(register.glob("*.json")):
            assert engine.poll() is None and time.monotonic() < deadline, (tmp_path / "engine.log").read_text()[-3000:]
            time.sleep(0.2)
        url = json.loads(next(register.glob("*.json")).read_text())["url"]
        out = tmp_path / "trainer.json"
        # the trainer names its interface (the user's choice wins): both ways of choosing are exercised
        trainer = subprocess.run(
            multihost_cluster.on_host(
                trainer_host, [sys.executable, str(HERE / "two_host_trainer.py"), url, str(model), str(out)]
            ),
            capture_output=True,
            text=True,
            timeout=600,
            env={**env, "GLOO_SOCKET_IFNAME": "eth0"},
        )
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

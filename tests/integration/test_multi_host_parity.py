"""`dapo-megatron check-parity --tp 2` with one rank on each of two hosts (tests/multihost_cluster.py:
own address, own hostname, Debian-style /etc/hosts mapping the host's own name to 127.0.1.1), launched
as a user launches it (torchrun --nnodes 2, rendezvous at the first host's name) and with no
GLOO_SOCKET_IFNAME set by hand. The product picks each rank's interface from the route to the peer
(actor/parallel.py -> distributed/addresses.py). On 3eb0efe the first gloo group failed:
"Gloo connectFullMesh failed ... remote=[127.0.1.1]" (the rank on the first host advertised the
address its own name resolves to).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from rollout_helpers import REPO, make_tiny_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def test_check_parity_tp2_one_rank_per_host(multihost_cluster, tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model", seed=0)
    first, second = multihost_cluster.hosts[:2]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    port = random.randint(21000, 29000)
    procs = []
    for node_rank, host in enumerate((first, second)):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{first.name}:{port}",
            "--rdzv-id",
            "parity",
            "-m",
            "dapo_megatron.cli",
            "check-parity",
            "--model",
            str(model),
            "--tp",
            "2",
            "--seqs",
            "2",
            "--seq-len",
            "16",
        ]
        log = open(tmp_path / f"rank{node_rank}.log", "wb")  # noqa: SIM115 (closed in the finally below)
        procs.append(
            (
                subprocess.Popen(
                    multihost_cluster.on_host(host, argv), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
                ),
                log,
            )
        )
    try:
        codes = _wait_all([proc for proc, _ in procs], timeout_s=400)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            log.close()
    out0 = (tmp_path / "rank0.log").read_text(errors="replace")
    out1 = (tmp_path / "rank1.log").read_text(errors="replace")
    assert codes == [0, 0], f"rank 0:\n{out0[-4000:]}\nrank 1:\n{out1[-4000:]}"
    # each rank said which interface it chose and why: its host's eth0, at its bridge address
    assert f"gloo/nccl interface eth0 ({first.address})" in out0, out0[-3000:]
    assert f"gloo/nccl interface eth0 ({second.address})" in out1, out1[-3000:]
    assert "check-parity: passed" in out0 + out1
    diff = float(
        [line for line in (out0 + out1).splitlines() if line.startswith("max_abs_logprob_diff=")][0].split("=", 1)[1]
    )
    assert diff <= 1e-5  # TP=2 across hosts agrees with transformers as TP=2 on one host does


def _wait_all(procs: list[subprocess.Popen], *, timeout_s: float) -> list[int | None]:
    """Exit codes; once one process fails the others get 30 s (they would wait for it for minutes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 30)
        time.sleep(0.5)
    return [p.poll() for p in procs]

"""The weight group's master address: loopback only when every engine is on this host; otherwise the
interface NCCL/GLOO_SOCKET_IFNAME names, or the route to the engines (tests/integration/
test_weight_sync_two_hosts.py checks the routed case across two network namespaces); a group opened
with open_weight_group on both sides exchanges a broadcast (the store keys SGLang's side derives)."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.transfer.weight_group import (
    open_weight_group,
    route_source_address,
    socket_ifname_address,
    trainer_address,
)


def test_loopback_only_when_every_engine_is_local():
    local = ["http://127.0.0.1:30000", "http://localhost:30001"]
    assert trainer_address(engine_urls=local, backend="nccl", environ={}) == "127.0.0.1"
    assert trainer_address(engine_urls=local, backend="nccl", configured="10.1.2.3", environ={}) == "10.1.2.3"


def test_socket_ifname_selects_the_interface():
    assert socket_ifname_address("lo") == "127.0.0.1"  # a prefix, as NCCL reads it
    assert socket_ifname_address("=lo") == "127.0.0.1"
    assert socket_ifname_address("no_such_if") is None
    other = socket_ifname_address("^lo")  # anything but loopback (None on a host without another interface)
    assert other is None or not other.startswith("127.")
    # the variable of the backend decides, for engines elsewhere
    remote = ["http://192.0.2.10:30000"]  # TEST-NET-1: never routed to this host's loopback
    assert trainer_address(engine_urls=remote, backend="gloo", environ={"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    with pytest.raises(ValueError, match="NCCL_SOCKET_IFNAME='nope'"):
        trainer_address(engine_urls=remote, backend="nccl", environ={"NCCL_SOCKET_IFNAME": "nope"})


def test_route_source_of_a_remote_engine_is_not_loopback():
    assert route_source_address("127.0.0.1") == "127.0.0.1"
    try:
        addr = route_source_address("192.0.2.10")
    except OSError:
        pytest.skip("this host has no route off-host (no default route)")
    assert not addr.startswith("127.")
    assert trainer_address(engine_urls=["http://192.0.2.10:1"], backend="gloo", environ={}) == addr


def test_group_members_exchange_a_broadcast():
    """Two members built by open_weight_group (the trainer's side here, the CPU engine's side in another
    process; SGLang's side is checked against it in tests/conformance) agree on the store keys. Both sides
    move data as the product does (broadcast_from_trainer; the engine's receive, coll.pg_broadcast), and
    each broadcast returns only once gloo's worker thread let go of the tensor (its use count is the
    caller's alone again): a worker still holding one when the engine process exits right after its
    last receive aborted it ("terminate called without an active exception", ~1 exit in 10 under load)."""
    import socket
    import subprocess
    import sys
    import uuid

    from dapo_megatron.transfer.weight_group import broadcast_from_trainer

    rounds = 20  # without the wait for the worker, ~1 broadcast in 3 returned with references still held
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"g_test_{uuid.uuid4().hex[:8]}"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import torch
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.transfer.weight_group import open_weight_group
pg = open_weight_group(backend="gloo", master_address="127.0.0.1", master_port={port}, rank=1, world_size=2,
                       group_name="{name}", timeout_s=120)
held = []
for i in range({rounds}):
    got = torch.zeros(5)
    coll.pg_broadcast(pg, got, src=0)  # as the engine receives (cpu_engine/server.py), then exits at once
    held.append(got._use_count())
print(held)
print(got.tolist())
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pg = open_weight_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name=name,
            timeout_s=120,
        )
        sent_held = []
        for i in range(rounds):
            sent = torch.arange(5.0) + i
            broadcast_from_trainer(pg, sent)
            sent_held.append(sent._use_count())
        out, _ = engine.communicate(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert engine.returncode == 0, f"the engine side exited with {engine.returncode}"
    held_line, last = out.strip().splitlines()[-2:]
    assert last == f"[{rounds - 1}.0, {rounds}.0, {rounds + 1}.0, {rounds + 2}.0, {rounds + 3}.0]"
    assert sent_held == [1] * rounds and held_line == str([1] * rounds)
    with pytest.raises(ValueError, match="gloo or nccl"):
        open_weight_group(
            backend="mpi", master_address="127.0.0.1", master_port=port, rank=0, world_size=1, group_name="x"
        )


# ------------------------------------------------------------------ the group's backend follows the engines
def test_engine_group_backend_follows_the_engines():
    from dapo_megatron.transfer.weight_sync import engine_group_backend

    cpu = {"model_path": "m", "tp_size": 1, "cpu_engine": {"weight_group_backend": "gloo"}}
    sglang = {"model_path": "m", "tp_size": 2}  # SGLang's /server_info: ServerArgs fields, no cpu_engine block
    assert engine_group_backend({"http://a:1": cpu, "http://b:2": cpu}) == "gloo"
    assert engine_group_backend({"http://c:3": sglang}) == "nccl"
    with pytest.raises(ValueError) as err:
        engine_group_backend({"http://a:1": cpu, "http://c:3": sglang, "http://d:4": sglang})
    msg = str(err.value)
    assert "gloo: http://a:1" in msg and "nccl: http://c:3, http://d:4" in msg and "rollout.engine" in msg


def test_nccl_engines_need_a_gpu_trainer():
    from dapo_megatron.transfer import weight_sync

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the trainer can join nccl")
    with pytest.raises(ValueError, match="needs a GPU on the trainer side"):
        weight_sync._check_trainer_can_join("nccl")
    weight_sync._check_trainer_can_join("gloo")

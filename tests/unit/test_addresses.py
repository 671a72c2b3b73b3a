"""distributed/addresses.py: the interface a group spanning hosts uses is the one that routes to the peer
(tests/integration/test_multi_host_parity.py runs it across two network-namespace hosts)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from dapo_megatron.actor.parallel import spans_hosts
from dapo_megatron.distributed import addresses
from dapo_megatron.distributed.addresses import choose_socket_interfaces, interface_of, route_source_address

REMOTE = "192.0.2.10"  # TEST-NET-1: routed like any outside address, never this host's


def _store():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=2))
    return store


def test_a_rank_away_from_the_master_takes_the_routing_interface_and_publishes_its_address():
    env, store = {}, _store()
    route = choose_socket_interfaces(REMOTE, spans_hosts=True, store=store, environ=env)
    source = route_source_address(REMOTE)
    assert route.address == source and route.interface == interface_of(source) and route.interface != "lo"
    assert env == {"GLOO_SOCKET_IFNAME": route.interface, "NCCL_SOCKET_IFNAME": "=" + route.interface}
    assert store.get("dapo_socket_peer/1").decode() == source  # for the ranks on the master's host


def test_a_rank_on_the_masters_host_routes_to_a_published_peer():
    store = _store()
    n = store.add("dapo_socket_peer/count", 1)
    store.set(f"dapo_socket_peer/{n}", REMOTE)
    env = {}
    # MASTER_ADDR resolving to 127.0.1.1 (Debian's /etc/hosts): this host, so the peer decides
    route = choose_socket_interfaces("127.0.1.1", spans_hosts=True, store=store, environ=env)
    assert route.peer == REMOTE and env["GLOO_SOCKET_IFNAME"] == route.interface != "lo"


def test_the_users_variables_win_and_one_host_needs_nothing():
    env = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib0"}
    store = _store()
    assert choose_socket_interfaces(REMOTE, spans_hosts=True, store=store, environ=env) is None
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib0"}
    assert store.get("dapo_socket_peer/1")  # still published: ranks on the master's host may need it
    only_nccl = {"NCCL_SOCKET_IFNAME": "=ib0"}
    choose_socket_interfaces(REMOTE, spans_hosts=True, store=_store(), environ=only_nccl)
    assert only_nccl["NCCL_SOCKET_IFNAME"] == "=ib0" and only_nccl["GLOO_SOCKET_IFNAME"] != "lo"
    env = {}
    assert choose_socket_interfaces("127.0.1.1", spans_hosts=False, store=None, environ=env) is None and env == {}


def test_a_peer_reached_through_loopback_is_refused_naming_address_and_interface():
    store = _store()
    store.add("dapo_socket_peer/count", 1)
    store.set("dapo_socket_peer/1", "127.0.1.1")  # a peer that published its loopback (broken /etc/hosts)
    with pytest.raises(
        ValueError, match=r"127\.0\.1\.1 .*through loopback from .* \(address 127\.0\.0\.1, interface lo\)"
    ):
        choose_socket_interfaces("127.0.0.1", spans_hosts=True, store=store, environ={})


def test_no_peer_ever_published_ends_with_the_stores_timeout():
    with pytest.raises(Exception, match="(?i)timeout|timed out|wait"):
        choose_socket_interfaces("127.0.0.1", spans_hosts=True, store=_store(), timeout_s=1, environ={})


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, True),  # torchrun --nnodes 2 --nproc-per-node 1
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, False),  # one node
        ({"SLURM_STEP_NUM_NODES": "2"}, True),
        ({"SLURM_JOB_NUM_NODES": "1"}, False),
        ({}, False),
    ],
)
def test_spans_hosts(env, expected):
    assert spans_hosts(env) is expected


def test_user_socket_ifname_ignores_what_was_chosen_here(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setattr(addresses, "CHOSEN_HERE", {"GLOO_SOCKET_IFNAME"})
    assert addresses.user_socket_ifname("GLOO_SOCKET_IFNAME") == ""
    monkeypatch.setattr(addresses, "CHOSEN_HERE", set())
    assert addresses.user_socket_ifname("GLOO_SOCKET_IFNAME") == "eth9"

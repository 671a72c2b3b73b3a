"""The process group between the trainer (rank 0) and the engines' TP ranks, and the trainer address
the engines rendezvous with.

    addr = trainer_address(engine_urls=[...], backend="nccl")        # what engines can reach
    pg = open_weight_group(backend="nccl", master_address=addr, master_port=p, rank=0,
                           world_size=1 + sum(engine tp sizes), group_name=name)

open_weight_group builds the group exactly as SGLang's side does (sglang/srt/utils/common.py,
init_custom_process_group: a TCP store at master_address:master_port wrapped in PrefixStore(group_name),
then torch's _new_process_group_helper, which prefixes "<group_name>/" and the device again): both
sides must derive the same store keys or the rendezvous waits forever. The CPU engine joins with the
same function.

trainer_address: engines rendezvous with master_address, so it must be an address of the trainer's
host that every engine can reach. Loopback only when every engine is on this host; otherwise, in
order: an explicit address (config key rollout.weight_sync_address), the address of the interface
NCCL_SOCKET_IFNAME (nccl) or GLOO_SOCKET_IFNAME (gloo) names (the fabric the collective itself will
use), else the source address the kernel's routing table picks for the engines' hosts. A variable
that distributed/addresses.py set for the trainer's own groups is not the user's and does not count.
open_weight_group creates a gloo group on the interface that routes to master_address (the host
name may resolve to 127.0.1.1 on Debian-style nodes), unless the user set GLOO_SOCKET_IFNAME.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
from urllib.parse import urlparse

import torch

from dapo_megatron.distributed import addresses
from dapo_megatron.distributed import collectives as coll


def open_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
):
    """One member of the trainer<->engines group; rank 0 (the trainer) hosts the TCP store."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, GroupName, PrefixStore, _new_process_group_helper, _world

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync: backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # An explicit TCPStore, not rendezvous("tcp://..."): under torchrun (TORCHELASTIC_USE_AGENT_STORE
    # set) rendezvous makes rank 0 a mere client of a store nobody hosts. The keys are the same.
    store = TCPStore(
        master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    # gloo advertises the interface that routes to master_address (the trainer's own address on
    # rank 0): the host name may resolve to 127.0.1.1 (distributed/addresses.py)
    with addresses.gloo_interface_for(master_address) if backend == "gloo" else contextlib.nullcontext():
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=GroupName(group_name),
            timeout=timeout,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # as SGLang: group rank = global rank
    return pg


def broadcast_from_trainer(pg, tensor: torch.Tensor) -> None:
    """One collective call: rank 0's tensor to every engine rank of the group (a CUDA bucket crosses a
    gloo group through host memory: collectives.pg_broadcast)."""
    coll.pg_broadcast(pg, tensor, src=0)


# ------------------------------------------------------------------------------------- addresses
def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None, socket.AF_INET)
            )
        except socket.gaierror:
            return False


def interface_address(name: str) -> str:
    """IPv4 address of the network interface `name` (ValueError naming it if it has none)."""
    import psutil

    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise ValueError(f"weight sync: no network interface {name!r} on this host (have {sorted(addrs)})")
    for addr in addrs[name]:
        if addr.family == socket.AF_INET:
            return addr.address
    raise ValueError(f"weight sync: network interface {name!r} has no IPv4 address")


def socket_ifname_address(spec: str) -> str | None:
    """The address NCCL/GLOO_SOCKET_IFNAME selects: 'eth0', 'ib,eth' (prefixes, first match in that
    order), '=eth0' (exact names), '^docker,lo' (any interface but these). None if nothing matches."""
    import psutil

    addrs = {
        name: [a.address for a in infos if a.family == socket.AF_INET] for name, infos in psutil.net_if_addrs().items()
    }
    candidates = {name: ips for name, ips in addrs.items() if ips}
    spec = spec.strip()
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    wanted = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]

    def matches(name: str, pattern: str) -> bool:
        return name == pattern if exact else name.startswith(pattern)

    if exclude:
        for name in sorted(candidates):
            if not any(matches(name, p) for p in wanted) and not _is_loopback(candidates[name][0]):
                return candidates[name][0]
        return None
    for pattern in wanted:
        for name in sorted(candidates):
            if matches(name, pattern):
                return candidates[name][0]
    return None


route_source_address = addresses.route_source_address  # the one routing-table query (distributed/addresses.py)


def engine_hosts(urls: list[str]) -> list[str]:
    return [urlparse(u).hostname or "" for u in urls]


def trainer_address(*, engine_urls: list[str], backend: str, configured: str = "", environ: dict | None = None) -> str:
    """The master_address of the weight group: reachable by every engine (module docstring)."""
    import os

    env = os.environ if environ is None else environ
    if configured:
        return configured
    hosts = engine_hosts(engine_urls)
    remote = [h for h in hosts if not _is_loopback(h)]
    if not remote:
        return "127.0.0.1"  # every engine shares this host's loopback
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if addresses.user_socket_ifname(var, environ):  # the user's choice; not one made here for the trainer's groups
        addr = socket_ifname_address(env[var])
        if addr is None:
            raise ValueError(
                f"weight sync: {var}={env[var]!r} matches no interface with an IPv4 address on "
                "this host; fix it or set rollout.weight_sync_address"
            )
        return addr
    sources = set()
    for host in remote:
        try:
            sources.add(route_source_address(host))
        except OSError as err:
            raise ValueError(
                f"weight sync: no route from this host to engine host {host!r} ({err}); set "
                "rollout.weight_sync_address to an address of this host the engines can reach"
            ) from None
    if len(sources) > 1:
        raise ValueError(
            f"weight sync: the engines are reached from different local addresses {sorted(sources)}; "
            "set rollout.weight_sync_address (or NCCL_SOCKET_IFNAME) to the one they all reach"
        )
    (addr,) = sources
    if _is_loopback(addr):
        raise ValueError(
            f"weight sync: engine hosts {remote} route through loopback from here; set rollout.weight_sync_address"
        )
    return addr

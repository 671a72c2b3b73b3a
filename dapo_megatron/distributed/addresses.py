"""Which network interface a process group uses: the one whose address routes to the peer.

    choice = interface_toward("node0")          # Route(peer='10.0.0.1', address='10.0.0.2', interface='eth0')
    choose_socket_interfaces(master_addr, spans_hosts=True, store=store)   # sets GLOO/NCCL_SOCKET_IFNAME

Why: gloo (and NCCL without NCCL_SOCKET_IFNAME) advertise the address the host's own name resolves
to. Stock Debian/Ubuntu images map that name to 127.0.1.1 in /etc/hosts, so on such nodes a group
that spans hosts tells its peers to connect to 127.0.1.1 and fails ("Gloo connectFullMesh failed ...
remote=[127.0.1.1]"). The kernel's routing table knows the right answer: the source address it would
use to reach the peer, and the interface holding it. A user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
always wins; a group that spans hosts never gets a loopback interface (a ValueError names the
address and the interface instead).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_PEER_KEY = "dapo_socket_peer/"  # store keys: ranks on other hosts than MASTER_ADDR publish their address
# the variables choose_socket_interfaces set in this process (so not the user's choice)
CHOSEN_HERE: set[str] = set()


@dataclass(frozen=True)
class Route:
    peer: str  # the peer's IPv4 address
    address: str  # this host's source address toward it
    interface: str  # the interface holding that address


def resolve_ipv4(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (socket.gaierror, IndexError) as err:
        raise ValueError(f"cannot resolve {host!r} to an IPv4 address on {socket.gethostname()}: {err}") from None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def local_ipv4() -> dict[str, list[str]]:
    """interface -> its IPv4 addresses, on this host (in this network namespace)."""
    import psutil

    return {
        name: [a.address for a in infos if a.family == socket.AF_INET] for name, infos in psutil.net_if_addrs().items()
    }


def interface_of(address: str) -> str | None:
    for name, addrs in local_ipv4().items():
        if address in addrs:
            return name
    return None


def route_source_address(host: str) -> str:
    """The local address the kernel would send from to reach `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # any port: connect() on UDP only consults the routing table
        return s.getsockname()[0]


def is_local(address: str) -> bool:
    """A loopback address or one of this host's own: a peer there is this host."""
    return is_loopback(address) or interface_of(address) is not None


def interface_toward(peer_host: str) -> Route:
    """The interface (and its address) this host reaches peer_host from; ValueError if that is loopback."""
    peer = resolve_ipv4(peer_host)
    try:
        source = route_source_address(peer)
    except OSError as err:
        raise ValueError(f"no route from {socket.gethostname()} to {peer_host} ({peer}): {err}") from None
    name = interface_of(source) or "?"
    if is_loopback(source):
        raise ValueError(
            f"{peer_host} ({peer}) is reached through loopback from {socket.gethostname()} "
            f"(address {source}, interface {name}): a group that spans hosts cannot use it; fix "
            f"/etc/hosts or set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the hosts share"
        )
    return Route(peer, source, name)


def choose_socket_interfaces(
    master_addr: str,
    *,
    spans_hosts: bool,
    store=None,
    timeout_s: float = 300.0,
    environ: MutableMapping[str, str] | None = None,
) -> Route | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (each only where the user has not) to the interface
    that routes to the other hosts of the group, before the groups are created. Returns the route used
    (None: one host only, or the user chose both).

    master_addr on another host: the route to it. master_addr is this host (its own name may resolve to
    127.0.1.1): the route to a rank on another host, which publishes its address in `store` (every rank
    that reaches master_addr through a non-loopback route does, so this works whatever the user set).
    """
    env = os.environ if environ is None else environ
    if not spans_hosts:
        return None
    master = resolve_ipv4(master_addr)
    route = None
    if not is_local(master):
        route = interface_toward(master)
        if store is not None:
            n = store.add(_PEER_KEY + "count", 1)
            store.set(f"{_PEER_KEY}{n}", route.address)
    if all(env.get(var) for var in IFNAME_VARS):
        return None
    if route is None:  # this rank shares the master's host: ask a rank on another host where it is
        if store is None:
            raise ValueError(
                f"MASTER_ADDR {master_addr} ({master}) is this host and the group spans hosts, but "
                "there is no store to learn a peer's address from; set GLOO_SOCKET_IFNAME"
            )
        store.wait([f"{_PEER_KEY}1"], _seconds(timeout_s))
        route = interface_toward(store.get(f"{_PEER_KEY}1").decode())
    if not env.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = route.interface  # gloo: exact names
        CHOSEN_HERE.add("GLOO_SOCKET_IFNAME")
    if not env.get("NCCL_SOCKET_IFNAME"):
        env["NCCL_SOCKET_IFNAME"] = f"={route.interface}"  # NCCL: '=' exact, else every name it prefixes
        CHOSEN_HERE.add("NCCL_SOCKET_IFNAME")
    return route


def user_socket_ifname(var: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The user's GLOO/NCCL_SOCKET_IFNAME ("" when unset or set by choose_socket_interfaces here)."""
    env = os.environ if environ is None else environ
    return "" if environ is None and var in CHOSEN_HERE else env.get(var, "")


@contextlib.contextmanager
def gloo_interface_for(address: str) -> Iterator[str | None]:
    """While a gloo group with a peer at (or, for its host, this host's own) `address` is created:
    GLOO_SOCKET_IFNAME = the interface that routes there, unless the user set it. gloo reads the
    variable when a group is created, so it is set only for that moment. Loopback: left alone."""
    if user_socket_ifname("GLOO_SOCKET_IFNAME"):
        yield None
        return
    ip = resolve_ipv4(address)
    name = interface_of(ip) if is_local(ip) else interface_toward(ip).interface
    if name is None or is_loopback(ip):
        yield None
        return
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield name
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old


def _seconds(value: float):
    import datetime

    return datetime.timedelta(seconds=value)

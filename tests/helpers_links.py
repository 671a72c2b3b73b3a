"""Shaped links for the several-hosts twin (tests/multihost_cluster.py): a token-bucket filter (tc tbf,
which this kernel has; netem does not load here) on both ends of each host's link, so every byte a
host sends or receives passes one filter of `rate_mbit`:

    with shaped_links(cluster, rate_mbit=300):        # removed on exit, also when the test fails
        ...                                           # host <-> host: rate_mbit (each direction)

  egress of the host:   tc qdisc on eth0 inside the host's network namespace (tc -n <netns>)
  ingress of the host:  tc qdisc on the bridge-side veth in this machine's namespace (its egress)
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` failed: {out.stderr.strip()}")
    return out


def _ends(cluster) -> list[tuple[list[str], str]]:
    """(tc namespace prefix, device) of both ends of every host's link."""
    ends = []
    for host in cluster.hosts:
        ends.append((["-n", host.netns], "eth0"))
        ends.append(([], host.veth))
    return ends


def root_qdiscs(cluster) -> list[str]:
    """The root qdisc line of every link end (`tc qdisc show`): what the test leaves behind."""
    return [
        _tc(*prefix, "qdisc", "show", "dev", dev, "root", check=False).stdout.strip() for prefix, dev in _ends(cluster)
    ]


@contextlib.contextmanager
def shaped_links(cluster, *, rate_mbit: int, burst: str = "64kb", latency: str = "50ms") -> Iterator[None]:
    added: list[tuple[list[str], str]] = []
    try:
        for prefix, dev in _ends(cluster):
            _tc(*prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", burst,
                "latency", latency)  # fmt: skip
            added.append((prefix, dev))
        yield
    finally:
        for prefix, dev in reversed(added):
            _tc(*prefix, "qdisc", "del", "dev", dev, "root", check=False)
        left = [line for line in root_qdiscs(cluster) if "tbf" in line]
        if left:
            raise RuntimeError(f"tbf qdiscs left after the test: {left}")

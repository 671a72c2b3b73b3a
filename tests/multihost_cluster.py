"""Several hosts on this one machine, joined by one real Slurm: each host is a network namespace with
its own address on a bridge, its own hostname (a UTS namespace) and its own /etc/hosts in Debian's
style (its own name -> 127.0.1.1, the others' names -> their addresses). This machine's filesystem is
the shared filesystem, as NFS/Lustre is on a cluster.

    with MultiHostSlurm(tmp_dir, hosts=3) as cluster:     # ~3 s to all nodes idle
        job = cluster.sbatch(["--nodes=2", "--wrap", "srun hostname"])
        cluster.wait_done([job])
        cluster.on_host(cluster.hosts[0], ["hostname"])    # argv prefix: run a command "on" a host
        cluster.cut_link(cluster.hosts[2]); cluster.restore_link(cluster.hosts[2])
        cluster.kill_host(cluster.hosts[1])                # SIGKILL every process of the host (slurmd too)
        cluster.start_slurmd(cluster.hosts[1])             # ... and back, as after a reboot
        cluster.heal()                                     # no job, every link up, every node idle again

    python tests/multihost_cluster.py --hosts 3 /tmp/dapo-mh   # by hand: prints how to reach it; Ctrl-C stops it

Layout (names carry a random tag, so two sessions never collide):
  bridge  dmb<tag> in this machine's namespace, address <net>.254/24: slurmctld listens there, and
          the test process (sbatch, squeue, ...) reaches the hosts through it
  host i  namespace dm<tag>n<i>, hostname dm<tag>n<i>, interface eth0 = <net>.<i+1>/24 (the peer of
          veth dmv<tag><i> on the bridge), lo up; no default route: nothing leaves the subnet
          /etc/netns/<ns>/hosts is bind-mounted over /etc/hosts (iproute2's place for it; on_host)
  Slurm   munged and slurmctld here (one munge socket on the shared filesystem), one slurmd per host
          started in the host's namespaces (slurmd -D -N <name>), NodeAddr=<host address>; every job
          process inherits the host's network, hostname and /etc/hosts from its slurmd

stop() (also on failure, Ctrl-C and SIGTERM when run by hand) cancels the jobs, kills every process
left in each namespace, stops the daemons, deletes the namespaces (their veth ends go with them), the
bridge and /etc/netns/<ns>/, and raises if any of it is still there. An owner SIGKILLed before it
could clean up leaves a record in /run/dapo-multihost/; the next cluster to start sweeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import LocalSlurm, _pid_alive  # noqa: E402

NETNS_ETC = Path("/etc/netns")
# one record per live cluster: {"pid": owner, "tag", "root", "bridge", "hosts": [...]}; a record whose
# owner is dead (SIGKILLed: no clean-up ran) is swept by the next cluster that starts
REGISTRY = Path("/run/dapo-multihost")


@dataclass(frozen=True)
class Host:
    name: str  # hostname, Slurm NodeName and network namespace name
    address: str  # eth0's address on the bridge (Slurm's NodeAddr)
    veth: str  # the bridge-side end of its link, in this machine's namespace

    @property
    def netns(self) -> str:
        return self.name


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out


def _free_subnet() -> str:
    """A 10.a.b.0/24 that no route of this machine's namespace touches."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(200):
        net = f"10.{random.randint(100, 250)}.{random.randint(0, 250)}"
        if f"{net}." not in routes:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


def missing_binaries() -> list[str]:
    """Names of what a multi-host cluster needs that is not installed (empty: all there): Slurm's and
    munge's binaries (slurm_cluster.missing_binaries) and iproute2's `ip`, util-linux's unshare and nsenter."""
    from slurm_cluster import missing_binaries as missing_slurm

    tools = [
        name
        for name in ("ip", "unshare", "nsenter")
        if shutil.which(name) is None and not Path("/usr/sbin", name).exists()
    ]
    return missing_slurm() + tools


def debian_hosts_file(own: Host, hosts: list[Host]) -> str:
    """/etc/hosts as Debian's installer writes it: the host's own name on 127.0.1.1."""
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{own.name}"]
    lines += [f"{h.address}\t{h.name}" for h in hosts if h != own]
    lines += ["::1\tlocalhost ip6-localhost ip6-loopback"]
    return "\n".join(lines) + "\n"


class MultiHostSlurm(LocalSlurm):
    def __init__(self, root: str | Path, *, hosts: int = 3, cpus: int = 4, partition: str = "debug") -> None:
        super().__init__(root, cpus=cpus, partition=partition)
        if not 1 <= hosts <= 9:
            raise ValueError(f"hosts={hosts}: 1 to 9")
        self.tag = uuid.uuid4().hex[:5]
        self.net = _free_subnet()
        self.gateway = f"{self.net}.254"
        self.bridge = f"dmb{self.tag}"
        self.hosts = [Host(f"dm{self.tag}n{i}", f"{self.net}.{i + 1}", f"dmv{self.tag}{i}") for i in range(hosts)]
        self.slurmd: dict[str, subprocess.Popen] = {}
        self._made: list[tuple[str, str]] = []  # ("bridge" | "netns" | "etc", name), in creation order

    # ---------------------------------------------------------------- network
    def _make_network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("bridge", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            self._made.append(("netns", host.netns))
            peer = f"dmp{self.tag}{host.veth[-1]}"
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("-n", host.netns, "link", "set", peer, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            self._made.append(("etc", str(etc)))
            (etc / "hosts").write_text(debian_hosts_file(host, self.hosts))
            (etc / "hostname").write_text(host.name + "\n")

    def _register(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.tag}.json").write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "tag": self.tag,
                    "root": str(self.root),
                    "bridge": self.bridge,
                    "hosts": [h.name for h in self.hosts],
                }
            )
        )

    def on_host(self, host: Host, argv: list[str]) -> list[str]:
        """argv run "on" host: in its network namespace, with its /etc/hosts and its own hostname."""
        # not `ip netns exec`: it remounts /sys for the namespace, which hides /sys/fs/cgroup, and
        # slurmd refuses to start without it; the same /etc/hosts binding, made here
        return [
            "nsenter",
            f"--net=/run/netns/{host.netns}",
            "--",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "slave",
            "--",
            "sh",
            "-c",
            'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            host.name,
            str(NETNS_ETC / host.netns / "hosts"),
            *argv,
        ]

    def cut_link(self, host: Host) -> None:
        """Unplug the host's cable: its bridge port goes down (addresses and sockets stay)."""
        _ip("link", "set", host.veth, "down")

    def restore_link(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def node_state(self, host: Host) -> str:
        """Slurm's state of the host's node (idle, alloc, down*, ...)."""
        return self.run(["sinfo", "-h", "-n", host.name, "-o", "%t"], check=False).stdout.strip()

    def host_pids(self, host: Host) -> list[int]:
        out = _ip("netns", "pids", host.netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit() and _pid_alive(int(p))]

    def kill_host(self, host: Host) -> list[int]:
        """The host is lost: every process in its namespace (slurmd, job steps, ranks) gets SIGKILL."""
        pids = self.host_pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def start_slurmd(self, host: Host) -> None:
        """(Re)start the host's slurmd inside its namespaces (a lost host that comes back)."""
        with open(self.root / "log" / f"slurmd-{host.name}.out", "ab") as log:  # slurmd keeps its own copy
            self.slurmd[host.name] = subprocess.Popen(
                self.on_host(host, ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)]),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 60.0) -> MultiHostSlurm:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"binaries missing: {', '.join(missing)} (run .ci/system_deps.sh)")
        for sub in ("munge", "run", "log", "state", "spool", *(f"spool/{h.name}" for h in self.hosts)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        sweep_abandoned()
        try:
            self._register()
            self._make_network()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-i", "-f", str(self.conf)])
            for host in self.hosts:
                self.start_slurmd(host)
            self._wait_nodes_idle(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_conf(self) -> None:
        super()._write_conf()
        text = self.conf.read_text()
        text = text.replace("SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldHost=localhost({self.gateway})")
        # one slurmd per host: each its own spool, pid and log (%n = the node's name)
        text = re.sub(r"SlurmdSpoolDir=.*", f"SlurmdSpoolDir={self.root / 'spool' / '%n'}", text)
        text = re.sub(r"SlurmdPidFile=.*", f"SlurmdPidFile={self.root / 'run' / 'slurmd-%n.pid'}", text)
        text = re.sub(r"SlurmdLogFile=.*", f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}", text)
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus} State=UNKNOWN" for h in self.hosts)
        names = ",".join(h.name for h in self.hosts)
        text = re.sub(r"NodeName=localhost .*", nodes, text)
        text = re.sub(r"PartitionName=(\S+) Nodes=localhost", rf"PartitionName=\1 Nodes={names}", text)
        # a host that stops answering is marked DOWN (its jobs killed, and requeued if they may be) after
        # this long: longer than the 20 s link cut of the tests (Slurm's default is 300 s)
        text += "SlurmdTimeout=30\nMessageTimeout=5\n"
        self.conf.write_text(text)

    def heal(self, timeout_s: float = 180.0) -> None:
        """Back to what start() left, after a test that cut links, lost hosts or failed half-way: our jobs
        cancelled, every link up, every host's slurmd running, every node idle (a node Slurm set DOWN or
        DRAIN is resumed). Quick when nothing is amiss (one scancel, one sinfo)."""
        self.run(["scancel", "--user", str(os.getuid())], check=False)
        for host in self.hosts:
            self.restore_link(host)
            proc = self.slurmd.get(host.name)
            if proc is None or proc.poll() is not None:
                self.start_slurmd(host)
        deadline = time.monotonic() + timeout_s
        while True:
            states = dict(
                line.split()[:2]
                for line in self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.splitlines()
            )
            if len(states) == len(self.hosts) and all(state.startswith("idle") for state in states.values()):
                return
            for name, state in states.items():
                # "down*": not answering yet (ReturnToService=2 brings it back when its slurmd registers);
                # "down"/"drain" without the star: answering but held, which only a resume clears
                if state.startswith(("down", "drain")) and not state.endswith("*"):
                    self.run(["scontrol", "update", f"nodename={name}", "state=resume"], check=False)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nodes not idle {timeout_s:.0f} s after heal(): {states}\n{self._log_tail('slurmctld')}"
                )
            time.sleep(0.5)

    def _wait_nodes_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self.slurmd.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"slurmd of {name} exited with {proc.returncode}\n{self._log_tail(f'slurmd-{name}')}"
                    )
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = out.stdout.strip()
            lines = states.splitlines()
            if len(lines) == len(self.hosts) and all(line.split()[1].startswith("idle") for line in lines):
                return
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout_s}s:\n{states}\n{self._log_tail('slurmctld')}")

    def stop(self) -> None:
        """Everything this cluster made goes, in reverse order; raises naming what could not be removed."""
        problems: list[str] = []
        try:
            if "slurmctld" in self.started and _pid_alive(self.started["slurmctld"]):
                subprocess.run(["scancel", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as err:
            problems.append(f"scancel: {err}")
        for proc in self.slurmd.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.slurmd.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for kind, name in self._made:  # whatever still runs on a host dies with it
            if kind == "netns":
                for pid in self.host_pids(Host(name, "", "")):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        try:
            super().stop()  # slurmctld, munged, and any job process that carries our SLURM_CONF
        except RuntimeError as err:
            problems.append(str(err))
        for host in self.hosts:  # the veth pair goes with either end; deleting it here does not wait for
            _ip("link", "del", host.veth, check=False)  # the namespace's last process to be reaped
        for kind, name in reversed(self._made):
            if kind == "netns":
                deadline = time.monotonic() + 10
                while self.host_pids(Host(name, "", "")) and time.monotonic() < deadline:
                    time.sleep(0.1)
                done = _ip("netns", "del", name, check=False)
            elif kind == "bridge":
                done = _ip("link", "del", name, check=False)
            else:
                for f in Path(name).glob("*"):
                    f.unlink()
                Path(name).rmdir()
                continue
            if done.returncode != 0:
                problems.append(f"{kind} {name}: {done.stderr.strip()}")
        if NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
            NETNS_ETC.rmdir()
        (REGISTRY / f"{self.tag}.json").unlink(missing_ok=True)
        self._made.clear()
        self.slurmd.clear()
        deadline = time.monotonic() + 15  # the kernel removes a namespace's devices once it is released
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if problems or left:
            raise RuntimeError(f"multi-host cluster not fully removed: {problems + left}")

    def leftovers(self) -> list[str]:
        """What of this cluster still exists (empty: nothing)."""
        left = [f"netns {ns}" for ns in _ip("netns", "list", check=False).stdout.split() if self.tag in ns]
        left += [
            f"link {line.split(':')[1].strip()}"
            for line in _ip("-o", "link", check=False).stdout.splitlines()
            if self.tag in line
        ]
        left += [f"/etc/netns/{h.netns}" for h in self.hosts if (NETNS_ETC / h.netns).exists()]
        left += [f"process {name}" for name in self.still_running()]
        return left

    def describe(self) -> str:
        lines = [f"export SLURM_CONF={self.conf}", f"# bridge {self.bridge} {self.gateway}/24 (slurmctld)"]
        for h in self.hosts:
            lines.append(f"# {h.name} {h.address}: {shlex.join(self.on_host(h, ['bash']))}")
        return "\n".join(lines)


def sweep_abandoned() -> list[str]:
    """Remove what clusters whose owner died without cleaning up left behind (their registry records
    name it): processes in their namespaces, their daemons (pid files), namespaces, bridge, /etc/netns
    entries. Clusters whose owner lives are not touched. Returns the tags swept."""
    swept = []
    for record_path in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(record["pid"])):
            continue
        for name in record["hosts"]:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for pid_file in Path(record["root"], "run").glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)
        for name in record["hosts"]:
            _ip("netns", "del", name, check=False)
            etc = NETNS_ETC / name
            if etc.is_dir():
                for f in etc.iterdir():
                    f.unlink()
                etc.rmdir()
        _ip("link", "del", record["bridge"], check=False)
        record_path.unlink(missing_ok=True)
        swept.append(record["tag"])
    return swept


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="a Slurm cluster of N network-namespace hosts on this machine")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=4, help="CPUs each node declares")
    parser.add_argument("dir", nargs="?", default="/tmp/dapo-multihost")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM: the same clean-up as Ctrl-C
    # Ctrl-C even when started with SIGINT ignored: a shell starts its background jobs so (`.ci/run &`), and
    # Python then leaves SIGINT ignored; the SIGINT of test_multihost_cluster's Ctrl-C test did nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = MultiHostSlurm(args.dir, hosts=args.hosts, cpus=args.cpus)
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        print("# Ctrl-C removes it all", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        print("removed: namespaces, links, daemons, /etc/netns entries", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

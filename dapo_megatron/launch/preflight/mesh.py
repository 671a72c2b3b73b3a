"""The preflight checks that need the other nodes: a TCP store on the first trainer node (torch's
TCPStore: what torchrun's rendezvous uses) orders them, every wait bounded.

  roster      every rank says it is alive; rank 0 publishes who came (within timeout_s / 2): a node
              whose python could not import torch never comes, and no one waits for it after that
  routes      each rank listens on the address it picks (distributed/addresses.py) and every other
              rank opens a TCP connection to it: the address routes, not only resolves
  shared_fs   rank 0 writes a token into <run_dir>/preflight/job-<id>/ and holds the run lock there
  run_lock    (launch/run_lock.py's flock); every other node reads the token, sees the lock held by
              rank 0's host (run_lock.holder) and writes its own file, which rank 0 then reads
  clock       rank 0 asks each node for its wall clock (ping/pong through the store: offset = theirs -
              the midpoint of rank 0's send and receive, error +- half the round trip), and each node
              compares its clock with the mtime the run directory's filesystem gives a file it writes now
  links       launch/preflight/links.py: all-reduce and broadcasts of the trainer group, the weight group

CLOCK_OFFSET_VAR (DAPO_PREFLIGHT_CLOCK_OFFSET_S) is a TEST STAND-IN: a time namespace shifts only the
monotonic clocks, so the tests cannot give one node of the twin another wall clock; this variable
shifts what wall_clock() reads on the hosts it names ("2.5": every node; "n1=2.5,n2=-1": per host).
It is read in wall_clock() only.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from dapo_megatron.launch import run_lock
from dapo_megatron.launch.preflight import links as preflight_links
from dapo_megatron.launch.preflight.report import Check

CLOCK_OFFSET_VAR = "DAPO_PREFLIGHT_CLOCK_OFFSET_S"  # test stand-in (module docstring)
MAX_CLOCK_SKEW_S = 1.0
CONNECT_TIMEOUT_S = 5.0
FS_FIX = (
    "put trainer.output_dir on the filesystem every node mounts at the same path (NFS, Lustre, GPFS): "
    "checkpoints, engine registrations and the run lock live there"
)
LOCK_FIX = (
    "mount the run directory's filesystem with flock across nodes (Lustre: -o flock; NFS: lockd running, "
    "no `nolock`): the run lock (launch/run_lock.py) keeps two runs out of one directory"
)
CLOCK_FIX = (
    "synchronise the clocks (chrony/ntpd; `chronyc tracking` shows the offset): checkpoints, logs and "
    "munge credentials compare times across nodes"
)


def wall_clock(host: str) -> float:
    """time.time(), shifted by the test stand-in DAPO_PREFLIGHT_CLOCK_OFFSET_S where it names this host."""
    spec = os.environ.get(CLOCK_OFFSET_VAR, "").strip()
    offset = 0.0
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.rpartition("=")
        if not sep or name == host:
            offset = float(value)
    return time.time() + offset


class Mesh:
    def __init__(self, args, *, rank: int, host: str, hosts: list[str], routes: dict[str, dict]) -> None:
        self.args, self.rank, self.host, self.hosts, self.routes = args, rank, host, hosts, routes
        self.store: Any = None  # torch.distributed.TCPStore, once connected
        self.roster: list[int] = []
        self.probe = Path(args.run_dir) / "preflight" / f"job-{args.job}"
        self.checks: list[Check] = []
        self.facts: dict = {}
        self._lock: run_lock.RunLock | None = None  # rank 0: held on the probe directory

    # ------------------------------------------------------------------ store
    def _wait(self, keys: list[str], timeout_s: float) -> bool:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(timeout_s, 0.1)))
            return True
        except Exception:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError on a timeout
            return False

    def get(self, key: str, timeout_s: float) -> str | None:
        return self.store.get(key).decode() if self._wait([key], timeout_s) else None

    def barrier(self, name: str) -> list[int]:
        """Every roster rank sets name/<rank>; returns the ranks that did not arrive within the timeout."""
        self.store.set(f"{name}/{self.rank}", "1")
        deadline = time.monotonic() + self.args.timeout_s
        return [r for r in self.roster if not self._wait([f"{name}/{r}"], deadline - time.monotonic())]

    def _connect(self) -> bool:
        from torch.distributed import TCPStore

        try:
            self.store = TCPStore(
                self.hosts[0],
                self.args.store_port,
                None,
                is_master=self.rank == 0,
                timeout=datetime.timedelta(seconds=self.args.timeout_s),
                wait_for_workers=False,
            )
        except Exception as err:  # noqa: BLE001 - the store's own message names the address
            self.checks.append(
                Check(
                    "mesh",
                    self.host,
                    False,
                    f"no preflight store at {self.hosts[0]}:{self.args.store_port}: {err}",
                    "see the routes and ports checks; the first node's worker may have failed (job log)",
                )
            )
            return False
        return True

    def _make_roster(self) -> None:
        self.store.set(f"alive/{self.rank}", self.host)
        if self.rank == 0:
            deadline = time.monotonic() + self.args.timeout_s / 2
            present = [r for r in range(len(self.hosts)) if self._wait([f"alive/{r}"], deadline - time.monotonic())]
            self.store.set("roster", json.dumps(present))
        text = self.get("roster", self.args.timeout_s)
        self.roster = json.loads(text) if text else [self.rank]

    # ------------------------------------------------------------------ run
    def run(self) -> tuple[list[Check], list[dict], dict]:
        if not self._connect():
            return self.checks, [], self.facts
        self._make_roster()
        links: list[dict] = []
        try:
            self._reachability()
            self._shared_fs()
            self._clock()
            link_checks, links, link_facts = preflight_links.measure(self)
            self.checks += link_checks
            self.facts.update(link_facts)
        finally:
            self.store.set(f"done/{self.rank}", "1")
            if self.rank == 0:  # the store lives in this process: it stays until every rank is done with it
                deadline = time.monotonic() + self.args.timeout_s
                for r in self.roster:
                    self._wait([f"done/{r}"], deadline - time.monotonic())
                if self._lock is not None:
                    self._lock.release()
                shutil.rmtree(self.probe, ignore_errors=True)
        return self.checks, links, self.facts

    # ------------------------------------------------------------------ routes
    def _reachability(self) -> None:
        if len(self.roster) < 2 or not self.routes:
            return
        address = next(iter(self.routes.values()))["address"]
        server = socket.create_server(("0.0.0.0", 0))
        server.settimeout(0.2)
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                    conn.close()
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        self.store.set(f"listen/{self.rank}", f"{address}:{server.getsockname()[1]}")
        failed, reached = [], []
        for r in self.roster:
            if r == self.rank:
                continue
            target = self.get(f"listen/{r}", self.args.timeout_s)
            if target is None:
                continue
            addr, port = target.rsplit(":", 1)
            try:
                socket.create_connection((addr, int(port)), timeout=CONNECT_TIMEOUT_S).close()
                reached.append(f"{self.hosts[r]} at {addr}")
            except OSError as err:
                failed.append(f"{self.hosts[r]} at {addr}:{port}: {err}")
        self.barrier("reach")
        stop.set()
        thread.join(2)
        server.close()
        if failed:
            self.checks.append(
                Check(
                    "routes",
                    self.host,
                    False,
                    f"cannot connect to the address a peer picks: {'; '.join(failed)}",
                    "a firewall between the nodes, or the wrong interface: set GLOO_SOCKET_IFNAME / "
                    "NCCL_SOCKET_IFNAME to the one the nodes share",
                )
            )
        else:
            self.checks.append(Check("routes", self.host, True, f"connects to {', '.join(reached)}"))

    # ------------------------------------------------------------------ shared filesystem and lock
    def _shared_fs(self) -> None:
        if self.rank == 0:
            self._write_probe()
            others = [r for r in self.roster if r != 0]
            self.barrier("fs-written")
            for r in others:
                seen = self.probe / f"seen-{r}"
                ok = seen.is_file() and seen.read_text() == self.hosts[r]
                self.store.set(f"fs/seen/{r}", "1" if ok else "0")
            return
        ready = self.get("fs/ready", self.args.timeout_s)
        info = json.loads(ready) if ready else {}
        token_path = self.probe / "token"
        read = token_path.read_text() if token_path.is_file() else None
        holder, _ = run_lock.holder(self.probe) if read is not None else (None, True)
        if read is not None:
            (self.probe / f"seen-{self.rank}").write_text(self.host)
        self.barrier("fs-written")
        written_seen = self.get(f"fs/seen/{self.rank}", self.args.timeout_s) == "1"
        first = self.hosts[0]
        if read != info.get("token"):
            found = "no such file" if read is None else "another content"
            self.checks.append(
                Check("shared_fs", self.host, False, f"{token_path} written on {first}: {found} here", FS_FIX)
            )
            return
        if not written_seen:
            self.checks.append(
                Check("shared_fs", self.host, False, f"{first} does not see the file this node wrote", FS_FIX)
            )
            return
        self.checks.append(Check("shared_fs", self.host, True, f"reads {first}'s file and {first} reads this node's"))
        if holder is None or holder.get("host") != info.get("lock_host"):
            looks = "free" if holder is None else f"held by {holder.get('host')}"
            self.checks.append(
                Check("run_lock", self.host, False, f"the run lock {first} holds looks {looks} from here", LOCK_FIX)
            )
        else:
            self.checks.append(
                Check("run_lock", self.host, True, f"sees {first}'s flock on {self.probe.name}/.run.lock")
            )

    def _write_probe(self) -> None:
        token = secrets.token_hex(8)
        try:
            self.probe.mkdir(parents=True, exist_ok=True)
            (self.probe / "token").write_text(token)
            self._lock = run_lock.RunLock(self.probe, command="dapo-megatron preflight").acquire()
        except OSError as err:
            self.checks.append(Check("shared_fs", self.host, False, f"cannot write {self.probe}: {err}", FS_FIX))
            token = ""
        else:
            self.checks.append(Check("shared_fs", self.host, True, f"writes {self.probe} and holds its run lock"))
        self.store.set("fs/ready", json.dumps({"token": token, "lock_host": socket.gethostname()}))

    # ------------------------------------------------------------------ clocks
    def _filesystem_offset(self) -> float | None:
        """This node's wall clock against the mtime its run directory's filesystem stamps on a new file."""
        path = Path(self.args.run_dir) / "preflight" / f"clock-{self.args.job}-{self.host}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            before = wall_clock(self.host)
            path.write_text("")
            after = wall_clock(self.host)
            mtime = path.stat().st_mtime
            path.unlink()
        except OSError:
            return None
        return mtime - (before + after) / 2

    def _clock(self) -> None:
        fs_offset = self._filesystem_offset()
        offset = rtt = 0.0
        if self.rank == 0:
            for r in self.roster[1:]:
                t0 = wall_clock(self.host)
                self.store.set(f"clock/ping/{r}", "1")
                theirs = self.get(f"clock/pong/{r}", self.args.timeout_s)
                t1 = wall_clock(self.host)
                if theirs is not None:
                    self.store.set(f"clock/offset/{r}", json.dumps([float(theirs) - (t0 + t1) / 2, t1 - t0]))
        else:
            if self._wait(["clock/ping/" + str(self.rank)], self.args.timeout_s):
                self.store.set(f"clock/pong/{self.rank}", repr(wall_clock(self.host)))
            answer = self.get(f"clock/offset/{self.rank}", self.args.timeout_s)
            offset, rtt = json.loads(answer) if answer else (0.0, 0.0)
        self.facts["clock"] = {"offset_s": offset, "round_trip_s": rtt, "filesystem_offset_s": fs_offset}
        parts = [] if self.rank == 0 else [f"{offset:+.3f} s vs {self.hosts[0]} (+-{rtt / 2:.3f})"]
        if fs_offset is not None:
            parts.append(f"file times {-fs_offset:+.3f} s")
        skews = [abs(offset)] + ([abs(fs_offset)] if fs_offset is not None else [])
        ok = max(skews) <= MAX_CLOCK_SKEW_S
        detail = ", ".join(parts) + f" (limit {MAX_CLOCK_SKEW_S:g} s)"
        self.checks.append(Check("clock", self.host, ok, detail, "" if ok else CLOCK_FIX))

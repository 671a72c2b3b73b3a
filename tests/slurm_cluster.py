"""A real single-node Slurm cluster on localhost for tests (Debian's slurmctld, slurmd, munge).

    with LocalSlurm(tmp_dir) as slurm:          # munged + slurmctld + slurmd, ~2 s to idle
        job = slurm.sbatch(["--wrap", "hostname"])
        slurm.wait_done([job])

    python tests/slurm_cluster.py /tmp/slurm     # start one by hand; Ctrl-C stops it

Everything lives under one directory: the munge key (mode 400) and socket, slurm.conf, state,
spool, logs and pid files. Ports are free ones picked at start (16817/16818 if free). Client
commands need SLURM_CONF: use `slurm.env` (or `slurm.run([...])`). The daemons run as root (the
Debian packages' `slurm` user is not needed) and are stopped by their pid files; `stop()` checks
that none of them is left running.

Settings that make this work on one container (measured; docs/architecture.md, "Running Megatron-Core on CPU"):
proctrack/linuxproc and task/none (no cgroups), no accounting (sacct does not work), select
cons_tres with CR_Core, sched_interval=1 so jobs start within a second, KillWait=3 so a cancelled
or requeued job is gone in seconds, and `SlurmdParameters=config_overrides` so the node may
declare more CPUs than the machine has (an engine array and a trainer then fit side by side; the
work itself is tiny).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")


def missing_binaries() -> list[str]:
    """Names of the Debian binaries this cluster needs that are not installed (empty: all there)."""
    need = ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun"]
    return [name for name in need if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free TCP port on 127.0.0.1")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LocalSlurm:
    def __init__(self, root: str | Path, *, cpus: int = 4, partition: str = "debug") -> None:
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.pid_files = {name: self.root / "run" / f"{name}.pid" for name in DAEMONS}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.started: dict[str, int] = {}
        # job ids from a random start: two clusters on one machine (two test sessions) then derive
        # different rendezvous ports from them (train.sbatch: 20000 + job id % 10000)
        self.first_job_id = random.randrange(1, 9000)

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 30.0) -> LocalSlurm:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm binaries missing: {', '.join(missing)} (run .ci/system_deps.sh)")
        for sub in ("munge", "run", "log", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-N", "localhost", "-f", str(self.conf)])
        self._wait_node_idle(timeout_s)
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        self._spawn(
            "munged",
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.pid_files['munged']}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        """The daemons fork into the background and write their pid files; wait for the file."""
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            raise RuntimeError(
                f"{name} failed to start (rc {result.returncode}): {result.stderr.strip()}\n{self._log_tail(name)}"
            )
        deadline = time.monotonic() + 15
        pid_file = self.pid_files[name]
        while time.monotonic() < deadline:
            if pid_file.exists() and pid_file.read_text().strip().isdigit():
                pid = int(pid_file.read_text())
                if _pid_alive(pid):
                    self.started[name] = pid
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{name} wrote no live pid to {pid_file}\n{self._log_tail(name)}")

    def _log_tail(self, name: str) -> str:
        log = self.root / "log" / f"{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = _free_port(16817), _free_port(16818)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=dapotest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={self.pid_files["slurmctld"]}
SlurmdPidFile={self.pid_files["slurmd"]}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
SchedulerParameters=sched_interval=1
ReturnToService=2
KillWait=3
MinJobAge=600
JobRequeue=1
FirstJobId={self.first_job_id}
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName={self.partition} Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_node_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
            state = out.stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.3)
        raise RuntimeError(
            f"node not idle after {timeout_s}s (state {state!r})\n{self._log_tail('slurmctld')}"
            f"\n{self._log_tail('slurmd')}"
        )

    def stop(self) -> None:
        """Cancel the jobs and wait for them to end, stop slurmd, slurmctld, munged (by pid file), kill
        any job process that outlived them (they carry our SLURM_CONF), and check that all are gone."""
        if "slurmctld" in self.started and _pid_alive(self.started["slurmctld"]):
            subprocess.run(["scancel", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
                if out.returncode != 0 or not out.stdout.strip():
                    break
                time.sleep(0.3)
        for name in DAEMONS:  # the order matters: slurmd and slurmctld still need munge to shut down
            pid = self.started.get(name)
            if pid is None:
                continue
            if _pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
        for pid in self.job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        left = self.still_running()
        self.started.clear()
        if left:
            raise RuntimeError(f"processes still running after stop: {left}")

    def job_processes(self) -> list[int]:
        """Live processes started through this cluster (jobs, slurmstepd): their environment holds our
        SLURM_CONF. The caller's own process never does (it passes the variable to clients only)."""
        needle = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and _pid_alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids

    def still_running(self) -> dict[str, int]:
        """Daemons we started and job processes of this cluster that are still alive (empty: none)."""
        left = {name: pid for name, pid in self.started.items() if _pid_alive(pid)}
        left.update({f"job process {pid}": pid for pid in self.job_processes()})
        return left

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- clients
    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed (rc {result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, args: list[str]) -> str:
        # --chdir: a job without --output writes slurm-<id>.out into its working directory; keep
        # those in the cluster's folder, not in the checkout the tests run from
        return self.run(["sbatch", "--parsable", f"--chdir={self.root}", *args]).stdout.strip().split(";")[0]

    def job_states(self, job_ids: list[str]) -> dict[str, str]:
        """job id (or array task `J_i`) -> state, from `scontrol show job` (keeps finished jobs for MinJobAge)."""
        states: dict[str, str] = {}
        for job in job_ids:
            out = self.run(["scontrol", "-o", "show", "job", job], check=False).stdout
            for line in out.splitlines():
                fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
                key = fields.get("JobId", job)
                if fields.get("ArrayTaskId"):
                    key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
                states[key] = fields.get("JobState", "UNKNOWN")
        return states

    def wait_done(self, job_ids: list[str], *, timeout_s: float = 120.0, poll_s: float = 0.5) -> dict[str, str]:
        """Poll until no listed job (or array task) is pending, running or being requeued."""
        active = {
            "PENDING",
            "RUNNING",
            "CONFIGURING",
            "COMPLETING",
            "REQUEUED",
            "REQUEUE_HOLD",
            "REQUEUE_FED",
            "RESIZING",
            "SUSPENDED",
            "SIGNALING",
            "STAGE_OUT",
        }
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.job_states(job_ids)
            if states and not any(state in active for state in states.values()):
                return states
            time.sleep(poll_s)
        raise TimeoutError(f"jobs {job_ids} not done after {timeout_s}s: {states}")

    def wait_state(self, job_id: str, state: str, *, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        seen = ""
        while time.monotonic() < deadline:
            seen = self.job_states([job_id]).get(job_id, "")
            if seen == state:
                return
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not {state} after {timeout_s}s (last state {seen!r})")


if __name__ == "__main__":
    cluster = LocalSlurm(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dapo-slurm").start()
    print(f"export SLURM_CONF={cluster.conf}")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()

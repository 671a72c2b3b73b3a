"""launch/local/lifeline.py with real processes: children started through LocalProcesses end when the
launcher is SIGKILLed (with_lifeline); a die_with_parent process ends with its parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

_LAUNCHER = """
import sys, time
from dapo_megatron.launch.local.launcher import LocalProcesses
procs = LocalProcesses(sys.argv[1]).__enter__()
a = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
b = procs.start("other", [sys.executable, "-c", "import time; time.sleep(600)"])
print(a.pid, b.pid, flush=True)
time.sleep(600)
"""

_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "from dapo_megatron.launch.local.lifeline import die_with_parent; die_with_parent(); print('ready', flush=True); "
    "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(600)
"""


def _wait_gone(pids: list[int], limit_s: float = 60.0) -> float:
    t0 = time.monotonic()
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, f"still alive: {alive}"
        time.sleep(0.05)


def test_launcher_sigkill_ends_its_children(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in launcher.stdout.readline().split()]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    waited = _wait_gone(pids)  # each got SIGTERM from the kernel when the launcher died
    print(f"\n[lifeline] the launcher's children ended {waited:.2f} s after the launcher's SIGKILL")


def test_die_with_parent_child_ends_with_it():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    waited = _wait_gone([child])
    print(f"\n[lifeline] rank-like child ended {waited:.2f} s after its parent's SIGKILL")

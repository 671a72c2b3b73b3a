"""rollout.cpu_engine_cores / actor.cpu_cores: the local launcher runs engines and actor ranks on cores
of their own (launch/local/launcher.py: check_cores, pinned). A real child process is started pinned and its
affinity read back from the kernel; bad cores fail before anything starts, naming the config key.

    pytest tests/unit/test_core_pinning.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.launch.local.launcher import check_cores, pinned


def test_a_pinned_child_and_its_children_run_on_those_cores_only():
    core = min(os.sched_getaffinity(0))
    # the child starts a grandchild (as torchrun starts ranks): both report their affinity
    code = (
        "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
        "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
        "capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run(pinned([sys.executable, "-c", code], [core]), capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == [f"[{core}]", f"[{core}]"]
    assert pinned(["x", "--y"], []) == ["x", "--y"]  # no pinning: the command untouched


def test_cores_not_available_are_refused_naming_the_key():
    absent = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"'actor.cpu_cores': CPU cores \[{absent}\] are not available"):
        check_cores([absent], "actor.cpu_cores")
    check_cores([], "actor.cpu_cores")  # nothing to check


def test_config_rejects_negative_or_repeated_cores():
    for bad in ("[-1]", "[0, 0]"):
        with pytest.raises(ValueError, match="config key 'rollout.cpu_engine_cores'"):
            load_config("configs/runs/tiny_cpu.yaml", [f"rollout.cpu_engine_cores={bad}"])
    cfg = load_config("configs/runs/tiny_cpu.yaml", ["rollout.cpu_engine_cores=[0]", "actor.cpu_cores=[1]"])
    assert (cfg.rollout.cpu_engine_cores, cfg.actor.cpu_cores) == ([0], [1])

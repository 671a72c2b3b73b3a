"""launch/local/supervise.py with real processes: LocalProcesses children (a Python process standing in for
serve-rollout's argv, which takes the same --port the supervisor appends) SIGKILLed and restarted on
the same port while it is free, on a new one when taken, until the budget is spent; after stop()
nothing is restarted."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from dapo_megatron.launch.local.launcher import LocalProcesses
from dapo_megatron.launch.local.supervise import EngineSupervisor, port_is_free, read_engine_events


def _engine(procs: LocalProcesses, name: str, port: int) -> None:
    procs.engines[name] = {
        "host": "127.0.0.1",
        "port": port,
        "url": f"http://127.0.0.1:{port}",
        "threads": 1,
        "register_dir": "",
        "argv": [sys.executable, "-c", "import time; time.sleep(120)"],
    }
    procs.restart_engine(name, port=port)


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restarts_on_the_same_port_until_the_budget_is_spent(tmp_path):
    lines = []
    events_path = tmp_path / "logs" / "engine_restarts.jsonl"
    port = _free_port()
    with LocalProcesses(tmp_path / "logs") as procs:
        _engine(procs, "engine_0", port)
        first = procs.children["engine_0"]
        sup = EngineSupervisor(
            procs, budget=1, events_path=events_path, poll_s=3600, out=lambda line, flush=True: lines.append(line)
        )
        with sup:
            _kill(first)
            sup.check("engine_0")
            second = procs.children["engine_0"]
            assert second.pid != first.pid and second.poll() is None
            assert second.args[-2:] == ["--port", str(port)]  # its port was free: the same url again
            _kill(second)
            sup.check("engine_0")  # budget 1 spent: stays down
            sup.check("engine_0")  # and is reported once
            assert procs.children["engine_0"] is second
    events = read_engine_events(events_path)
    assert [(e["action"], e["pid"], e["returncode"], e["restarts"]) for e in events] == [
        ("restarted", first.pid, -9, 1),
        ("budget_spent", second.pid, -9, 1),
    ]
    assert events[0]["new_pid"] == second.pid
    assert lines[0] == (
        f"[engines] engine_0 (http://127.0.0.1:{port}, pid {first.pid}) exited with code -9 "
        f"(SIGKILL); restarting it on its port {port} (restart 1 of rollout.engine_restarts=1); "
        "the trainer re-syncs its weights before using it"
    )
    assert lines[1] == (
        f"[engines] engine_0 (http://127.0.0.1:{port}, pid {second.pid}) exited with code -9 "
        "(SIGKILL); not restarted: the restart budget is spent (1 of rollout.engine_restarts=1)"
    )
    assert len(lines) == 2


def test_a_taken_port_means_a_new_one_and_stop_means_no_restart(tmp_path):
    with socket.socket() as taken, LocalProcesses(tmp_path / "logs") as procs:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_is_free("127.0.0.1", port)
        _engine(procs, "engine_0", port)
        sup = EngineSupervisor(
            procs, budget=3, events_path=tmp_path / "ev.jsonl", poll_s=0.05, out=lambda line, flush=True: None
        )
        with sup:
            first = procs.children["engine_0"]
            _kill(first)
            for _ in range(200):  # the thread's own poll
                if procs.children["engine_0"] is not first:
                    break
                sup._stop.wait(0.05)
            assert procs.children["engine_0"].args[-2:] == ["--port", "0"]
        second = procs.children["engine_0"]
        _kill(second)  # after stop(): the launcher's own clean-up, not a fault
        time.sleep(0.3)  # several of the (stopped) thread's poll periods
        assert procs.children["engine_0"] is second
        assert [e["action"] for e in read_engine_events(tmp_path / "ev.jsonl")] == ["restarted"]

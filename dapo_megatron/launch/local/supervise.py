"""Supervision of the CPU rollout engines the local launcher started (launch/local/launcher.py).

    with EngineSupervisor(procs, budget=cfg.rollout.engine_restarts, events_path=run_dir / "logs" / ...):
        rc = procs.run_foreground("actor", [...])      # engines that exit meanwhile are restarted

An engine process (`dapo-megatron serve-rollout`) that exits while the actor ranks run is started
again with its own arguments (same model directory, same seed) on the port it served before when
that port is free (then its URL is the same and the pool counts it as the same engine coming back),
else on a new port. Either way it writes a new registration in <run_dir>/engines/ with a newer
started_at, which the engine pool treats as a new incarnation: pending until the trainer has pushed
the current weights to it (rollout/pool.py, discover / admit). At most `budget` restarts per launch
(rollout.engine_restarts); past it an exited engine stays down and the trainer copes with the ones
left (or, with none left, checkpoints and stops: trainer/recovery.py).

Each exit is a console line and a JSON line in events_path: {"time", "engine", "url", "pid",
"returncode", "action": "restarted" | "budget_spent", "restarts", "budget"}. The driver reads that
file for the metric engines/restarted_total (rollout/pool.py, EngineEventReport), and, with no
engine left, to stop waiting once the budget is spent.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

from dapo_megatron.rollout.registry import engine_events_path, read_engine_events, read_registrations  # noqa: F401 (re-exported)


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (aiohttp binds with SO_REUSEADDR, as here)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _exit_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"code {returncode}"


class EngineSupervisor:
    """A thread that polls the launcher's engine processes and restarts those that exit."""

    def __init__(self, procs, *, budget: int, events_path: str | Path, poll_s: float = 0.5, out=print) -> None:
        if budget < 0:
            raise ValueError(f"config key 'rollout.engine_restarts': {budget!r} is not allowed; must be >= 0")
        self.procs = procs  # LocalProcesses: engines it started via start_cpu_engines
        self.budget = budget
        self.events_path = Path(events_path)
        self.poll_s = poll_s
        self.out = out
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._awaiting: dict[str, int] = {}  # engine name -> pid of a restarted process not yet registered

    def __enter__(self) -> EngineSupervisor:
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        self.events_path.write_text("")  # this launch's events only (the budget is per launch)
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Before the launcher stops the engines itself: what it stops is not restarted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name in list(self.procs.engines):
                if self._stop.is_set():
                    return
                self.check(name)

    def check(self, name: str) -> None:
        """Restart engine `name` if its process has exited (budget allowing); note its registration."""
        spec = self.procs.engines[name]
        proc = self.procs.children.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            if self._awaiting.get(name) == proc.pid:
                self._note_registered(name, proc.pid)
            return
        if spec.get("down"):
            return
        url = spec.get("url", "")
        event = {
            "time": time.time(),
            "engine": name,
            "url": url,
            "pid": proc.pid,
            "returncode": proc.returncode,
            "budget": self.budget,
        }
        what = f"[engines] {name} ({url or 'not registered'}, pid {proc.pid}) exited with {_exit_name(proc.returncode)}"
        if self.restarts >= self.budget:
            spec["down"] = True
            self._record({**event, "action": "budget_spent", "restarts": self.restarts})
            self.out(
                f"{what}; not restarted: the restart budget is spent "
                f"({self.restarts} of rollout.engine_restarts={self.budget})",
                flush=True,
            )
            return
        self.restarts += 1
        port = spec["port"] if spec.get("port") and port_is_free(spec["host"], spec["port"]) else 0
        new = self.procs.restart_engine(name, port=port)
        self._awaiting[name] = new.pid
        self._record({**event, "action": "restarted", "restarts": self.restarts, "new_pid": new.pid})
        where = f"on its port {port}" if port else "on a new port (its old one is taken)"
        self.out(
            f"{what}; restarting it {where} (restart {self.restarts} of rollout.engine_restarts="
            f"{self.budget}); the trainer re-syncs its weights before using it",
            flush=True,
        )

    def _note_registered(self, name: str, pid: int) -> None:
        try:
            records = read_registrations(str(self.procs.engines[name]["register_dir"]))
        except (FileNotFoundError, ValueError):
            return
        for rec in records:
            if rec.get("pid") == pid:
                del self._awaiting[name]
                self.procs.engines[name].update(url=rec["url"], port=int(rec["port"]))
                self.out(
                    f"[engines] {name} serves again at {rec['url']} (pid {pid}, registered {rec['started_at']})",
                    flush=True,
                )
                return

    def _record(self, event: dict) -> None:
        with open(self.events_path, "a") as f:
            f.write(json.dumps(event) + "\n")

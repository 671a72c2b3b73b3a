"""An engine's registration (<run_dir>/engines/<host>_<port>.json) lives exactly as the engine:
written once it serves, removed when it exits (SIGTERM from a launcher or scancel, Ctrl-C, or the
server process ending), and never removed by an old incarnation once a newer one owns the file.

    pytest tests/integration/test_engine_registration.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dapo_megatron.rollout.registry import read_registrations, remove_registration, write_registration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_helpers import REPO, ServerProcess, make_tiny_checkpoint  # noqa: E402


def _record(port: int, pid: int) -> dict:
    return {
        "host": "127.0.0.1",
        "port": port,
        "url": f"http://127.0.0.1:{port}",
        "tp_size": 1,
        "pid": pid,
        "started_at": "2026-11-23T00:00:00+00:00",
    }


def test_remove_registration_only_removes_its_own_record(tmp_path):
    path = write_registration(str(tmp_path), _record(30001, pid=111))
    # a newer incarnation on the same host:port rewrote the file: the old process must leave it
    write_registration(str(tmp_path), _record(30001, pid=222))
    assert remove_registration(path, pid=111) is False
    assert [r["pid"] for r in read_registrations(str(tmp_path))] == [222]
    assert remove_registration(path, pid=222) is True
    assert read_registrations(str(tmp_path)) == []
    assert remove_registration(path, pid=222) is False  # already gone: nothing to do, no error


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"))


def test_cpu_server_removes_its_registration_on_sigterm(tiny_model, tmp_path):
    """SIGTERM is what the local launcher, scancel and `kill` send (Ctrl-C's SIGINT takes the same path)."""
    register_dir = tmp_path / "engines"
    server = ServerProcess(tiny_model, register_dir)
    try:
        path = register_dir / f"127.0.0.1_{server.record['port']}.json"
        assert json.loads(path.read_text())["pid"] == server.proc.pid
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0  # a clean stop, not death by signal
        assert list(register_dir.iterdir()) == []  # no temp file left either
    finally:
        server.kill()


# STAND-IN for `python -m sglang.launch_server` (SGLang cannot run on a CPU machine): an HTTP server
# answering /health with 200; with "exit" it ends on its own 1 s after the first /health, as a server
# that finishes or crashes would.
STAND_IN = textwrap.dedent("""
    import sys, threading, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, mode = int(sys.argv[1]), sys.argv[2]
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
            if mode == "exit":
                threading.Timer(1.0, lambda: __import__("os")._exit(0)).start()
        def log_message(self, *args):
            pass
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    stand_in = tmp_path / "sglang_stand_in.py"
    stand_in.write_text(STAND_IN)
    port = _free_port()
    code = (
        "import sys; import dapo_megatron.rollout.sglang_launcher as launcher; "
        f"launcher.sglang_command = lambda s: [sys.executable, {str(stand_in)!r}, str(s.port), {mode!r}]; "
        "sys.exit(launcher.main(sys.argv[1:]))"
    )
    register_dir = tmp_path / "engines"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "--model",
            "unused",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--register-dir",
            str(register_dir),
            "--health-timeout",
            "60",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    path = register_dir / f"127.0.0.1_{port}.json"
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None or path.exists(), f"launcher exited ({proc.returncode}) before registering"
        assert time.monotonic() < deadline, "the launcher did not register within 60 s"
        time.sleep(0.05)
    return proc, path


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sglang_launcher_removes_the_registration_when_the_server_exits(tmp_path):
    proc, path = _launcher(tmp_path, "exit")
    try:
        assert proc.wait(timeout=60) == 0  # the server's own exit code
        assert not path.exists()
    finally:
        proc.kill()


def test_sglang_launcher_on_sigterm_stops_the_server_and_removes_the_registration(tmp_path):
    proc, path = _launcher(tmp_path, "serve")
    server_pid = json.loads(path.read_text())["pid"]
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not path.exists()
        assert _gone(server_pid)  # the launcher stopped (and reaped) its server too
    finally:
        proc.kill()
        if not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_a_dropped_engine_that_answers_again_is_pending_not_lost(tiny_model, tmp_path):
    """An engine dropped because it stopped answering (its host cut off) with its registration still
    there, the same incarnation (same started_at): once it answers /health again discover() makes it
    pending (re-synced before it serves). On 3eb0efe only a newer started_at was taken back, so a run
    whose only engine was cut off for a moment waited rollout.engine_wait_s and failed. SIGSTOP stands
    for the cut: /health times out while it lasts."""
    import asyncio

    from dapo_megatron.rollout.pool import EnginePool

    server = ServerProcess(tiny_model, tmp_path / "engines")
    seen: list[int] = []  # the engines up at each look of the wait (the driver's progress line)
    try:

        async def scenario() -> tuple[list[str], list[str], list[str]]:
            pool = await EnginePool.from_registry(
                str(tmp_path / "engines"), min_engines=1, wait_s=60, on_wait=seen.append
            )
            url = server.url
            pool.mark_dead(url, "cut off")
            server.proc.send_signal(signal.SIGSTOP)
            try:
                while_cut = await pool.discover()  # /health does not answer within its 5 s
            finally:
                server.proc.send_signal(signal.SIGCONT)
            back = await pool.discover()
            pool.admit(back)
            return while_cut, back, pool.live_urls()

        while_cut, back, live = asyncio.run(scenario())
        assert while_cut == [] and back == [server.url] and live == [server.url]
        assert seen[-1] == 1 and seen == sorted(seen), seen
    finally:
        server.kill()

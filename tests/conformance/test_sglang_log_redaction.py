"""The SGLang launcher keeps the run's engine keys out of the engine's log.

SGLang 0.5.21 logs its whole configuration at start (entrypoints/engine.py:
`logger.info(f"server_args={server_args.resolved_dict()}")`), keys included. The stand-in below is
that line run by SGLang's own code on CPU: SGLang's parser (`prepare_server_args`) reads our launcher's
real command line, with the run's key file as --config, and the child prints the resolved dict as
engine.py does. Only the server itself (GPU-only) is not started. The launcher's `start_server`
must pass that output on with both keys replaced, and every other byte unchanged.
"""

from __future__ import annotations

import io
import subprocess
import sys

from dapo_megatron.rollout.auth import ensure_secret_file
from dapo_megatron.rollout.sglang_launcher import REDACTED, SGLangSettings, copy_redacted, sglang_command, start_server

# what SGLang's engine.py logs at start, computed by SGLang's own parser from our argv
LOG_SERVER_ARGS = (
    "import sys\n"
    "from sglang.srt.server_args import prepare_server_args\n"
    "server_args = prepare_server_args(sys.argv[1:])\n"
    "print(f'server_args={server_args.resolved_dict()}', flush=True)\n"
    "print('stderr line', server_args.admin_api_key, file=sys.stderr, flush=True)\n"
)


def test_sglangs_start_up_log_reaches_ours_without_the_keys(tmp_path, capfd):
    secret = tmp_path / "secrets" / "engine_auth.yaml"
    keys = ensure_secret_file(secret)
    argv = sglang_command(SGLangSettings(model_path="/ckpt/qwen", auth_file=str(secret), python=sys.executable))
    cmd = [sys.executable, "-c", LOG_SERVER_ARGS, *argv[3:]]  # argv[3:]: what follows `-m sglang.launch_server`
    raw = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    # the leak is real: SGLang's own log line carries both keys
    assert f"'api_key': '{keys.api_key}'" in raw.stdout and f"'admin_api_key': '{keys.admin_api_key}'" in raw.stdout

    proc, pump = start_server(cmd, (keys.api_key, keys.admin_api_key))
    assert proc.wait(timeout=300) == 0
    pump.join(timeout=30)
    out = capfd.readouterr().out
    assert keys.api_key not in out and keys.admin_api_key not in out
    assert "'api_key': '<redacted>'" in out and "'admin_api_key': '<redacted>'" in out
    assert "'model_path': '/ckpt/qwen'" in out
    assert "stderr line <redacted>" in out  # stderr joins the same redacted stream
    # nothing else changed: the raw output with the keys replaced, byte for byte
    expected = (raw.stdout + raw.stderr).replace(keys.api_key, "<redacted>").replace(keys.admin_api_key, "<redacted>")
    assert sorted(out.splitlines()) == sorted(expected.splitlines())


def test_copy_redacted_replaces_every_occurrence_longest_key_first():
    src = io.BytesIO(b"a=KEY1 b=KEY1 c=KEY12\n\nno key here\nlast line without newline KEY1")
    dst = io.BytesIO()
    copy_redacted(src, dst, ["KEY1", "KEY12", None, ""])
    assert dst.getvalue() == (
        b"a=<redacted> b=<redacted> c=<redacted>\n\nno key here\nlast line without newline <redacted>"
    )
    assert REDACTED == b"<redacted>"


def test_without_keys_the_server_keeps_its_own_streams(capfd):
    proc, pump = start_server([sys.executable, "-c", "print('to stdout')"])
    assert pump is None and proc.stdout is None
    assert proc.wait(timeout=60) == 0
    assert capfd.readouterr().out == "to stdout\n"

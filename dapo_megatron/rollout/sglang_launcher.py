"""Start an SGLang server with our settings, wait for /health, register it for the trainer.

    python -m dapo_megatron.rollout.sglang_launcher --model /ckpt/Qwen2.5-7B --tp 2 --context-length 22528 \
        --port 30000 --register-dir $RUN_DIR/engines --auth-file $RUN_DIR/secrets/engine_auth.yaml \
        [--colocate --mem-fraction 0.5] [--seed 42]
    # rollout.quantization=fp8
    python -m dapo_megatron.rollout.sglang_launcher --model $RUN_DIR/rollout_fp8 --quantization fp8 ...

(one per Slurm array task in disaggregated runs). GPU clusters only: SGLang cannot run on the CPU
machines this project is developed on. The command line is built by `sglang_command` from the flags
of sglang 0.5.21's ServerArgs (--model-path, --tp-size, --context-length, --mem-fraction-static,
--enable-memory-saver, --random-seed, --host, --port, --dtype, --base-gpu-id, --config for the run's
keys: --auth-file) and parsed by SGLang's
own parser in tests/conformance. --context-length is rollout.max_prompt_length +
rollout.max_response_length: SGLang refuses (400) a request whose prompt plus max_new_tokens exceeds
its context length (tokenizer_manager.py _validate_one_request), and the model's own maximum may be
smaller or larger than what the run needs. --quantization fp8 (rollout.quantization=fp8) requires --model
to be the block-FP8 export (dapo_megatron/quant: config.json quantization_config {"quant_method": "fp8",
"weight_block_size": [128, 128]}, checked here) and passes `--quantization fp8`, which SGLang's
ModelConfig._verify_quantization checks against that quantization_config: started from the base model
instead, SGLang would quantize online per channel (Fp8LinearMethod's non-block path, which replaces its
parameters and so cannot reload a sync; docs/fp8.md).

The server's stdout and stderr pass through this process with the run's keys replaced by <redacted>
(SGLang logs its server arguments, keys included, at start): `start_server`, `copy_redacted`.

The installed sglang must be of the minor release the protocol was verified against (docs/sglang.md):
another one is refused unless --allow-sglang-version or DAPO_ALLOW_SGLANG_VERSION=1.
NOT yet run on a GPU (README, "Rollout engines").
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO

from dapo_megatron.quant.fp8_export import read_quant_config
from dapo_megatron.rollout.auth import ensure_secret_file
from dapo_megatron.rollout.registry import remove_registration, write_registration

VERIFIED_SGLANG = "0.5.21"  # docs/sglang.md and tests/conformance were checked against this release
ALLOW_ENV = "DAPO_ALLOW_SGLANG_VERSION"


def check_sglang_version(installed: str | None, *, allow_other: bool) -> None:
    """Refuse an sglang whose major.minor differs from the verified release (clear error), unless allowed."""
    if installed is None:
        raise RuntimeError(
            f"sglang is not installed in this environment: pip install -e '.[sglang]' (sglang=={VERIFIED_SGLANG})"
        )
    if installed.split(".")[:2] != VERIFIED_SGLANG.split(".")[:2] and not allow_other:
        raise RuntimeError(
            f"sglang {installed} is installed, but dapo-megatron speaks the protocol of sglang "
            f"{VERIFIED_SGLANG} (docs/sglang.md, verified by tests/conformance); another minor "
            f"release may differ (session rules, request fields). Install sglang=={VERIFIED_SGLANG}, "
            f"or run anyway with --allow-sglang-version or {ALLOW_ENV}=1"
        )


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class SGLangSettings:
    model_path: str
    tp_size: int = 1
    context_length: int = 0  # rollout.max_prompt_length + rollout.max_response_length; 0 = the model's
    mem_fraction_static: float = 0.7
    colocate: bool = False  # --enable-memory-saver: release/resume memory around training
    seed: int = 0
    host: str = "0.0.0.0"
    port: int = 30000
    dtype: str = "auto"
    base_gpu_id: int = 0
    quantization: str = ""  # "" or "fp8" (model_path must then be the block-FP8 export)
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    # the run's key file (rollout/auth.py, SGLang --config YAML with api-key / admin-api-key): "" = no keys
    auth_file: str = ""


def sglang_command(s: SGLangSettings) -> list[str]:
    """The argv of `python -m sglang.launch_server` for these settings (raises ValueError on bad ones)."""
    if not s.model_path:
        raise ValueError("sglang launcher: model_path is empty")
    if s.tp_size < 1:
        raise ValueError(f"sglang launcher: tp_size must be >= 1, got {s.tp_size}")
    if not 0.0 < s.mem_fraction_static < 1.0:
        raise ValueError(f"sglang launcher: mem_fraction_static must be in (0, 1), got {s.mem_fraction_static}")
    if not 0 < s.port < 65536:
        raise ValueError(f"sglang launcher: port must be in 1..65535, got {s.port}")
    if s.context_length < 0:
        raise ValueError(f"sglang launcher: context_length must be >= 0 (0 = the model's), got {s.context_length}")
    if s.quantization not in ("", "fp8"):
        raise ValueError(f"sglang launcher: quantization must be '' or 'fp8', got {s.quantization!r}")
    if s.quantization == "fp8":
        read_quant_config(s.model_path)  # ValueError naming config.json unless it is the block-FP8 export
    cmd = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model_path,
        "--tp-size",
        str(s.tp_size),
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--random-seed",
        str(s.seed),
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--dtype",
        s.dtype,
        "--base-gpu-id",
        str(s.base_gpu_id),
    ]
    if s.context_length:
        cmd += ["--context-length", str(s.context_length)]
    if s.colocate:
        cmd.append("--enable-memory-saver")
    if s.quantization:
        cmd += ["--quantization", s.quantization]
    if s.auth_file:
        if "--config" in s.extra_args:
            raise ValueError(
                "sglang launcher: --auth-file is passed to SGLang as --config (its only config file); "
                "put your other SGLang options on the command line instead of a second --config"
            )
        # the keys reach SGLang through its YAML config, never on argv (`ps` shows argv to every user)
        cmd += ["--config", s.auth_file]
    return cmd + list(s.extra_args)


REDACTED = b"<redacted>"


def copy_redacted(src: BinaryIO, dst: BinaryIO, secrets: Iterable[str | None]) -> None:
    """Copy src to dst line by line with every secret replaced by <redacted>, until src ends.
    Why: SGLang logs its whole configuration at start (entrypoints/engine.py:
    `logger.info(f"server_args={server_args.resolved_dict()}")`), api_key and admin_api_key included,
    into the engine's log under the run directory (Slurm's --output file: the user's umask decides who
    reads it)."""
    keys = sorted({k.encode() for k in secrets if k}, key=len, reverse=True)  # a key inside a longer one: longer first
    for line in iter(src.readline, b""):
        for key in keys:
            line = line.replace(key, REDACTED)
        dst.write(line)
        dst.flush()


def start_server(
    cmd: list[str], secrets: Iterable[str | None] = ()
) -> tuple[subprocess.Popen, threading.Thread | None]:
    """Popen(cmd); with secrets, its stdout and stderr reach this process's stdout through copy_redacted
    (one stream: Slurm writes both to the job's --output file anyway). Returns (process, pump thread)."""
    secrets = [k for k in secrets if k]
    if not secrets:
        return subprocess.Popen(cmd), None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pump = threading.Thread(
        target=copy_redacted, args=(proc.stdout, sys.stdout.buffer, secrets), name="engine-log", daemon=True
    )
    pump.start()
    return proc, pump


def advertised_host(bind_host: str, advertise: str = "") -> str:
    """The address other nodes use to reach a server bound to bind_host: --advertise-host (the
    rollout array passes Slurm's NodeAddr for the node, as CPU engines register), the bind address,
    or for a wildcard bind the host's name (which a Debian-style /etc/hosts may map to 127.0.1.1 on
    the node itself, but which the other nodes resolve)."""
    if advertise:
        return advertise
    if bind_host in ("0.0.0.0", "::", ""):
        return socket.getfqdn()
    return bind_host


def wait_healthy(
    url: str,
    *,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 1800.0,
    every_s: float = 60.0,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> None:
    """Poll url/health until it answers 200. A server loading a 32B or 235B model from a shared file
    system takes minutes: one line every `every_s` (0: every poll) says how long it has waited and for
    how much longer, so the engine's Slurm log shows a wait, not a hang."""
    start = time.monotonic()
    deadline = start + timeout_s
    said = start
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"sglang server exited with code {proc.returncode} before answering {url}/health")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        now = time.monotonic()
        if now - said >= every_s:
            said = now
            say(f"[sglang] waiting for {url}/health: {now - start:.0f} s, gives up in {deadline - now:.0f} s")
        time.sleep(min(2.0, every_s) if every_s > 0 else 0.05)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="launch an SGLang rollout engine and register it")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="rollout.max_prompt_length + rollout.max_response_length (0 = the model's own)",
    )
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--colocate", action="store_true", help="--enable-memory-saver (shares GPUs with the trainer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--advertise-host",
        default="",
        help="the address registered for the trainer (default: --host, or the host name for 0.0.0.0)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument(
        "--quantization",
        default="",
        choices=["", "fp8"],
        help="fp8: --model is the block-FP8 export of rollout.quantization=fp8 (docs/fp8.md)",
    )
    ap.add_argument("--register-dir", default="")
    ap.add_argument(
        "--auth-file",
        default="",
        help="the run's key file (<run_dir>/secrets/engine_auth.yaml; created here if absent): SGLang "
        "gets it as --config and then requires its api-key / admin-api-key on every request",
    )
    ap.add_argument("--health-timeout", type=float, default=1800.0)
    ap.add_argument(
        "--allow-sglang-version",
        action="store_true",
        help=f"run an sglang other than {VERIFIED_SGLANG.rsplit('.', 1)[0]}.x (also {ALLOW_ENV}=1)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    check_sglang_version(
        installed_sglang_version(), allow_other=args.allow_sglang_version or os.environ.get(ALLOW_ENV) == "1"
    )
    settings = SGLangSettings(
        model_path=args.model,
        tp_size=args.tp,
        context_length=args.context_length,
        mem_fraction_static=args.mem_fraction,
        colocate=args.colocate,
        seed=args.seed,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        base_gpu_id=args.base_gpu_id,
        quantization=args.quantization,
        extra_args=tuple(extra),
        auth_file=args.auth_file,
    )
    keys = (
        ensure_secret_file(args.auth_file) if args.auth_file else None
    )  # the trainer reads it too (a requeue reuses it)
    # SIGTERM (scancel, the colocated supervisor) unwinds like Ctrl-C, so the `finally` below stops
    # the server and removes its registration instead of leaving both behind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    proc, pump = start_server(sglang_command(settings), (keys.api_key, keys.admin_api_key) if keys else ())
    host = advertised_host(args.host, args.advertise_host)
    url = f"http://{host}:{args.port}"
    registration = ""
    try:
        wait_healthy(
            f"http://127.0.0.1:{args.port}" if args.host in ("0.0.0.0", "") else url,
            proc=proc,
            timeout_s=args.health_timeout,
        )
        if args.register_dir:
            registration = write_registration(args.register_dir, _registration(args, host=host, url=url, pid=proc.pid))
        print(f"sglang engine ready at {url}", flush=True)
        return proc.wait()
    finally:
        if registration:
            remove_registration(registration, pid=proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        if pump is not None:  # the server's last lines (its shutdown) reach the log; its children may hold the pipe
            pump.join(timeout=5)


def _registration(args: argparse.Namespace, *, host: str, url: str, pid: int) -> dict:
    """The engine's record in the registry the trainer reads (rollout/registry.py)."""
    return {
        "host": host,
        "port": args.port,
        "url": url,
        "tp_size": args.tp,
        "model": args.model,
        "pid": pid,
        "engine": "sglang",
        "node": socket.gethostname(),
        "base_gpu_id": args.base_gpu_id,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())

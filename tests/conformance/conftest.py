"""Fixtures of the SGLang conformance tests: SGLang's own server code on CPU (sglang_oracle.py) and the
CPU engine, both serving one tiny checkpoint.

sglang==0.5.21 must be installed (README's test command: pip install --no-deps -c constraints.txt
sglang==0.5.21, plus the `conformance` extra): without it these tests FAIL, they never skip, so CI
cannot pass without having run SGLang's code.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # rollout_helpers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_pins import CONTEXT_LENGTH, ORACLE_TP_SIZE, SGLANG_VERSION  # noqa: E402

ORACLE = Path(__file__).with_name("sglang_oracle.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sglang_installed() -> str:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            f"sglang is not installed, and the conformance tests run SGLang's own code: "
            f"pip install --no-deps -c constraints.txt sglang=={SGLANG_VERSION} (README's test command)",
            pytrace=False,
        )
    if version != SGLANG_VERSION:
        pytest.fail(
            f"sglang {version} is installed; the conformance tests verify {SGLANG_VERSION} "
            f"(pip install --no-deps -c constraints.txt sglang=={SGLANG_VERSION})",
            pytrace=False,
        )
    return version


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rollout_helpers import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("conformance") / "model", seed=0)


@pytest.fixture(scope="session")
def oracle(sglang_installed, tiny_model, tmp_path_factory):
    """URL of SGLang's HTTP server code (TP 2, context length 256) in its own process."""
    root = tmp_path_factory.mktemp("oracle")
    ready, log_path, port = root / "ready", root / "oracle.log", _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(ORACLE),
                "--model-dir",
                str(tiny_model),
                "--port",
                str(port),
                "--tp-size",
                str(ORACLE_TP_SIZE),
                "--context-length",
                str(CONTEXT_LENGTH),
                "--ready-file",
                str(ready),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 600  # importing sglang takes 20-60 s on a loaded 2-core machine
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-4000:]
                pytest.fail(f"the SGLang oracle did not start (exit code {proc.poll()}):\n{tail}", pytrace=False)
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="session")
def cpu_engine(tiny_model, tmp_path_factory):
    """URL of a CPU engine (serve-rollout) on the same checkpoint, deterministic inference off so its
    sampling settings match SGLang's defaults."""
    from rollout_helpers import ServerProcess

    root = tmp_path_factory.mktemp("cpu_engine")
    proc = ServerProcess(
        tiny_model,
        root / "engines",
        log_path=root / "server.log",
        extra_args=("--context-length", str(CONTEXT_LENGTH), "--no-enable-deterministic-inference"),
    )
    yield proc.url
    proc.kill()

"""Start N CPU rollout engines (`dapo-megatron serve-rollout`) as local subprocesses.

    with LocalEngines(model_dir, num_engines=2, register_dir=f"{run_dir}/engines") as engines:
        pool = EnginePool(urls=engines.urls)        # or EnginePool.from_registry(register_dir, ...)
        ...

Each engine binds a free port on 127.0.0.1, registers itself in register_dir once it serves, and
writes its output to register_dir/../logs/engine_<i>.log. Leaving the block (or close()) kills them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dapo_megatron.rollout.registry import read_registrations


class LocalEngines:
    def __init__(self, model_dir: str, *, num_engines: int, register_dir: str, seed: int = 0,
                 threads: int = 1, max_batch_size: int = 64, host: str = "127.0.0.1", start_timeout_s: float = 300.0):
        if num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {num_engines}")
        if not os.path.isdir(model_dir):
            raise ValueError(f"model.path: no such directory '{model_dir}'")
        self.register_dir = register_dir
        os.makedirs(register_dir, exist_ok=True)
        log_dir = os.path.join(os.path.dirname(os.path.abspath(register_dir)), "logs")
        os.makedirs(log_dir, exist_ok=True)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        for i in range(num_engines):
            log = open(os.path.join(log_dir, f"engine_{i}.log"), "ab")
            self._logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dapo_megatron.cli", "serve-rollout", "--model", model_dir, "--host", host,
                 "--port", "0", "--register-dir", register_dir, "--seed", str(seed + i), "--threads", str(threads),
                 "--max-batch-size", str(max_batch_size)],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        try:
            self.urls = self._wait(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout_s: float) -> list[str]:
        pids = {p.pid for p in self.procs}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"serve-rollout (pid {dead[0].pid}) exited with {dead[0].returncode}; "
                                   f"see {self._logs[self.procs.index(dead[0])].name}")
            mine = [r for r in read_registrations(self.register_dir) if r.get("pid") in pids]
            if len(mine) == len(self.procs):
                return [r["url"] for r in sorted(mine, key=lambda r: [p.pid for p in self.procs].index(r["pid"]))]
            time.sleep(0.2)
        raise TimeoutError(f"{len(self.procs)} serve-rollout engines did not all register in {timeout_s:.0f} s")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(30)
        for log in self._logs:
            log.close()

    def __enter__(self) -> "LocalEngines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

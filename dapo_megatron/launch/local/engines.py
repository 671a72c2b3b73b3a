"""Start N CPU rollout engines (`dapo-megatron serve-rollout`) as local subprocesses.

    with LocalEngines(model_dir, num_engines=2, register_dir=f"{run_dir}/engines") as engines:
        pool = EnginePool(urls=engines.urls)        # or EnginePool.from_registry(register_dir, ...)
        ...

Each engine binds a free port on 127.0.0.1, registers itself in register_dir once it serves, and
writes its output to register_dir/../logs/engine_<i>.log. With auth_file (rollout/auth.py
ensure_secret_file) every engine requires that file's keys (serve-rollout --config). Leaving the block (or close())
stops them.
The processes are run by launch.local.LocalProcesses, the supervisor `train` uses too.
"""

from __future__ import annotations

import os

from dapo_megatron.launch.local.launcher import LocalProcesses


class LocalEngines:
    def __init__(
        self,
        model_dir: str,
        *,
        num_engines: int,
        register_dir: str,
        seed: int = 0,
        threads: int = 1,
        max_batch_size: int = 64,
        host: str = "127.0.0.1",
        start_timeout_s: float = 300.0,
        auth_file: str | os.PathLike | None = None,
    ):
        log_dir = os.path.join(os.path.dirname(os.path.abspath(register_dir)), "logs")
        self.register_dir = register_dir
        self._procs = LocalProcesses(log_dir)
        try:
            self.urls = self._procs.start_cpu_engines(
                model_dir,
                num=num_engines,
                register_dir=register_dir,
                seed=seed,
                threads=threads,
                max_batch_size=max_batch_size,
                host=host,
                timeout_s=start_timeout_s,
                auth_file=auth_file,
            )
        except BaseException:
            self.close()
            raise

    @property
    def procs(self):
        return list(self._procs.children.values())

    def close(self) -> None:
        self._procs.stop_all()

    def __enter__(self) -> LocalEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

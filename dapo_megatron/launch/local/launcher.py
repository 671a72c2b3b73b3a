"""Processes that `dapo-megatron train` starts on one machine, and their clean-up.

    launch_training(cfg, "configs/runs/tiny_cpu.yaml", overrides, resume=False)   # what `train` runs

    with LocalProcesses(run_dir / "logs") as procs:
        urls = procs.start_cpu_engines(model_dir, num=2, register_dir=run_dir / "engines", seed=42)
        rc = procs.run_foreground("actor", ["torchrun", "--nproc-per-node", "2", ...])

Every child starts in its own process session, so stopping it reaches its children too (torchrun's
ranks, an engine's threads). Leaving the `with` block (normally, on an error, on Ctrl-C, or on
SIGTERM, which is turned into the same path) sends SIGTERM to every group still alive, waits, then
SIGKILLs what is left: no orphaned engine keeps a port or a core after a run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dapo_megatron.config import Config
from dapo_megatron.launch.data_check import check_prompt_data
from dapo_megatron.launch.engine_env import engine_environment
from dapo_megatron.launch.local.lifeline import (
    become_subreaper,
    descendants,
    kill_survivors,
    reap_descendants,
    with_lifeline,
)
from dapo_megatron.launch.local.ranks import RANKS_ERROR_FILE
from dapo_megatron.launch.local.stop import STOP_FILE, LocalStop, SignalHandler, StopNow
from dapo_megatron.launch.local.supervise import EngineSupervisor, engine_events_path
from dapo_megatron.launch.prepare import tiny_model_dir
from dapo_megatron.launch.run_lock import RunLock
from dapo_megatron.memplan.report import check_before_launch
from dapo_megatron.quant.engine_checkpoint import fp8_rollout_dir, prepare_fp8_rollout
from dapo_megatron.rollout.auth import ensure_secret_file, keys_from_config, run_secret_path
from dapo_megatron.rollout.registry import read_registrations
from dapo_megatron.trainer import console, console_log, metrics_log
from dapo_megatron.trainer.checkpoint.resume_check import check_resume_layout, check_resume_model
from dapo_megatron.trainer.progress_line import ProgressLine


def check_cores(cores: list[int], key: str) -> None:
    """A core pinning that cannot be applied fails before anything starts, naming the config key."""
    if not cores:
        return
    available = os.sched_getaffinity(0)
    missing = [c for c in cores if c not in available]
    if missing:
        raise ValueError(
            f"config key '{key}': CPU cores {missing} are not available to this process "
            f"(available: {sorted(available)})"
        )
    if shutil.which("taskset") is None:
        raise ValueError(f"config key '{key}': pinning to cores {cores} needs `taskset` (util-linux) on PATH")


def check_attention_kernel_device(actor_cfg) -> None:
    """actor.attention_kernel flex / varlen run CUDA kernels only (actor/attention.py): refused here, on the
    machine that starts the ranks, rather than by every rank after its model is built."""
    if actor_cfg.attention_backend != "torch" or actor_cfg.attention_kernel not in ("flex", "varlen"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"actor.attention_kernel={actor_cfg.attention_kernel} needs a CUDA GPU and this machine has none: "
            "use actor.attention_kernel=sdpa"
        )


def pinned(argv: list[str], cores: list[int]) -> list[str]:
    """argv run on `cores` only. taskset sets the affinity before exec, so the process and every thread
    and child it starts (torchrun's ranks, torch's intra-op threads) inherit it from the first instruction."""
    return ["taskset", "-c", ",".join(str(c) for c in cores), *argv] if cores else list(argv)


class LocalProcesses:
    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, subprocess.Popen] = {}
        # CPU engines by name: argv with the port left out, host, port and url once registered
        # (what launch/local/supervise.py needs to start one again)
        self.engines: dict[str, dict] = {}
        self._old_sigterm: SignalHandler = None  # signal.signal's previous handler

    def __enter__(self) -> LocalProcesses:
        def on_sigterm(signum, frame):  # same clean-up path as Ctrl-C (while the ranks run: LocalStop)
            raise StopNow(signum)

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(
        self, name: str, argv: list[str], *, env: dict[str, str] | None = None, engine: bool = False
    ) -> subprocess.Popen:
        """engine: a rollout engine, started without the trainer-only variables (launch/engine_env.py)."""
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - closed below, once the child holds its own copy
        base = engine_environment(dict(os.environ)) if engine else os.environ
        # with_lifeline: SIGTERM to the child if this process dies, even by SIGKILL (launch/local/lifeline.py)
        proc = subprocess.Popen(
            with_lifeline(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**base, **(env or {})},
        )
        log.close()  # the child holds its own descriptor
        self.children[name] = proc
        return proc

    def run_foreground(self, name: str, argv: list[str], *, env: dict[str, str] | None = None) -> int:
        """Run with output on this terminal (progress bars), in its own session for clean-up."""
        proc = subprocess.Popen(with_lifeline(argv), start_new_session=True, env={**os.environ, **(env or {})})
        self.children[name] = proc
        try:
            return proc.wait()
        except StopNow:  # a second Ctrl-C / SIGTERM (launch/local/stop.py): at once
            self._stop(proc, signal.SIGKILL, grace_s=5.0)
            raise
        except KeyboardInterrupt:
            self._stop(proc, signal.SIGINT)  # let the ranks see Ctrl-C first
            raise

    def start_cpu_engines(
        self,
        model_dir: str | Path,
        *,
        num: int,
        register_dir: str | Path,
        seed: int = 0,
        threads: int = 1,
        max_batch_size: int = 64,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        context_length: int = 0,
        cores: Sequence[int] = (),
        device: str = "cpu",
        auth_file: str | os.PathLike | None = None,
    ) -> list[str]:
        """Start `num` serve-rollout processes and wait until each has registered; returns their
        URLs in start order. Records of other processes in register_dir (an earlier run, SGLang
        engines of the same run) are left alone: only these processes' pids count.
        context_length: --context-length (max_prompt_length + max_response_length), as for SGLang.
        cores: CPU cores every engine runs on (rollout.cpu_engine_cores; empty = no pinning).
        device: rollout.cpu_engine_device: "cuda" puts engine i on GPU i (its slot, --base-gpu-id i).
        auth_file: the run's secret (rollout/auth.py), passed as --config: the engines then refuse any
        request without its key, as SGLang does with --api-key / --admin-api-key."""
        if num < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {num}")
        if not Path(model_dir).is_dir():
            raise ValueError(f"model.path: no such directory '{model_dir}'")
        if device == "cuda":
            _check_engine_gpus(num)
        register_dir = Path(register_dir)
        register_dir.mkdir(parents=True, exist_ok=True)
        procs = []
        for index in range(num):
            name = f"engine_{index}"
            self.engines[name] = {
                "host": host,
                "port": 0,
                "url": "",
                "register_dir": str(register_dir),
                "threads": threads,
                "cores": list(cores),
                "argv": _cpu_engine_argv(
                    model_dir,
                    index=index,
                    host=host,
                    seed=seed,
                    threads=threads,
                    max_batch_size=max_batch_size,
                    register_dir=register_dir,
                    device=device,
                    context_length=context_length,
                    auth_file=auth_file,
                ),
            }
            procs.append((name, self.restart_engine(name, port=0)))
        return self._wait_for_registrations(procs, register_dir=register_dir, timeout_s=timeout_s)

    def _wait_for_registrations(
        self, procs: list[tuple[str, subprocess.Popen]], *, register_dir: Path, timeout_s: float
    ) -> list[str]:
        """The engines' URLs in start order once every one of `procs` has registered in register_dir
        (their records found by pid), with a progress line of the engines up while it waits; an engine
        that exits first, or the deadline, raises naming the engines up, the time waited and the logs."""
        num = len(procs)
        order = [proc.pid for _, proc in procs]
        start = time.monotonic()
        line = ProgressLine("[train] rollout:", total=num, unit="engines up")
        mine: list[dict] = []
        try:
            while time.monotonic() < start + timeout_s:
                for name, proc in procs:
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"rollout engine {name} exited with code {proc.returncode} before registering "
                            f"({len(mine)} of {num} engines up after {time.monotonic() - start:.0f} s); its log "
                            f"({self.log_path(name)}) ends with:\n{self.tail(name)}"
                        )
                mine = [r for r in read_registrations(str(register_dir)) if r.get("pid") in order]
                line.update(len(mine))
                if len(mine) == num:
                    mine.sort(key=lambda r: order.index(r["pid"]))
                    for (name, _), rec in zip(procs, mine):
                        self.engines[name].update(url=rec["url"], port=int(rec["port"]))
                    return [r["url"] for r in mine]
                time.sleep(0.2)
        finally:
            line.close()
        up = {r.get("pid") for r in mine}
        late = [
            f"{name} (log {self.log_path(name)}, ending with:\n{self.tail(name, 10)})"
            for name, proc in procs
            if proc.pid not in up
        ]
        raise TimeoutError(
            f"{len(mine)} of {num} rollout engines registered in {register_dir} within {timeout_s:.0f} s; "
            f"not up: {'; '.join(late)}"
        )

    def restart_engine(self, name: str, *, port: int) -> subprocess.Popen:
        """Start CPU engine `name` (again) with its own arguments on `port` (0 = a free one); its log
        goes on in the same file."""
        spec = self.engines[name]
        return self.start(
            name,
            pinned([*spec["argv"], "--port", str(port)], spec.get("cores", [])),
            env={"OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"},
            engine=True,
        )

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.log_path(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    @staticmethod
    def _stop(proc: subprocess.Popen, sig: int, grace_s: float = 15.0) -> None:
        """Signal the child's process group, then SIGKILL every descendant still alive after the
        grace period. Descendants are listed up front: torchrun starts its ranks in sessions of
        their own, so a process-group signal alone can leave them running."""
        import psutil

        if proc.poll() is not None:
            return
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        kill_survivors(family, grace_s=grace_s)
        proc.poll()

    def stop_all(self) -> None:
        for proc in self.children.values():
            self._stop(proc, signal.SIGTERM)
        self.children.clear()


def _check_engine_gpus(num: int) -> None:
    """rollout.cpu_engine_device=cuda: engine i on GPU i, so `num` engines need `num` visible GPUs."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < num:
        raise ValueError(
            f"rollout.cpu_engine_device=cuda puts engine i on GPU i: {num} engines need {num} "
            f"GPUs, {visible} visible (set rollout.num_engines or rollout.cpu_engine_device=cpu)"
        )


def _cpu_engine_argv(
    model_dir: str | Path,
    *,
    index: int,
    host: str,
    seed: int,
    threads: int,
    max_batch_size: int,
    register_dir: Path,
    device: str,
    context_length: int,
    auth_file: str | os.PathLike | None,
) -> list[str]:
    """serve-rollout's command line for CPU engine `index`, the port left out (restart_engine adds it)."""
    return [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "serve-rollout",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--seed",
        str(seed + index),
        "--threads",
        str(threads),
        "--max-batch-size",
        str(max_batch_size),
        "--register-dir",
        str(register_dir),
        "--base-gpu-id",
        str(index),  # engine i on slot i: the colocated placement's map
        *(["--device", f"cuda:{index}"] if device == "cuda" else []),
        *(["--context-length", str(context_length)] if context_length else []),
        *(["--config", str(auth_file)] if auth_file else []),
    ]


def launch_training(
    cfg, config_path: str, overrides: list[str], *, resume: bool, overwrite: bool = False, skip_plan: bool = False
) -> int:
    """This machine: take the run directory's lock (one run per directory, launch/run_lock.py), decide
    about the run directory, check the memory plan, prepare the model, start CPU engines, run the actor
    ranks under torchrun, then print where everything is (metrics_log.run_summary)."""
    # before anything is written: a second `train` into this directory is refused, naming this one
    with RunLock(cfg.trainer.output_dir, command=f"dapo-megatron train {config_path}") as lock:
        if lock.stale_note:
            print(lock.stale_note, flush=True)
        before = descendants()  # processes of the caller's own, older than the run: not the run's to end
        become_subreaper()  # what a dead rank leaves (its multiprocessing helpers) is re-parented here
        try:
            return _launch_locked(cfg, config_path, overrides, resume=resume, overwrite=overwrite, skip_plan=skip_plan)
        finally:  # no process of this run outlives it (launch/local/lifeline.py); the lock is released after
            ended = reap_descendants(spare=before)
            if ended:
                print(
                    f"[train] ended {len(ended)} process(es) the run left behind: {'; '.join(ended)}",
                    file=sys.stderr,
                    flush=True,
                )


def _launch_locked(
    cfg: Config, config_path: str, overrides: list[str], *, resume: bool, overwrite: bool, skip_plan: bool
) -> int:
    """The launch sequence, the run directory's lock held: decide about the run directory, check what
    can be checked before anything starts, prepare the model and data, start the engines, run the ranks,
    then say how the run ended."""
    from dapo_megatron.launch.run_dir import check_run_dir

    t_start = time.perf_counter()
    run_dir = Path(cfg.trainer.output_dir)
    # before anything starts: a finished run says so at once, and two runs never mix in one directory
    decision = check_run_dir(
        run_dir,
        resume=resume,
        overwrite=overwrite,
        total_steps=cfg.trainer.total_steps,
        command=f"dapo-megatron train {config_path}",
    )
    # the console from here on also goes to logs/train.log (appended; after --overwrite cleared the old run's)
    flags = (" --resume" if resume else "") + (" --overwrite" if overwrite else "")
    console_log.start(run_dir, header=f"dapo-megatron train {config_path}{flags} {' '.join(overrides)}".rstrip())
    if decision.message:
        print(decision.message, flush=True)
    if decision.nothing_to_do:
        return 0
    resume_from = _say_layout_change(cfg, decision.checkpoint)
    _check_before_start(cfg, skip_plan=skip_plan)
    console.quiet_backend_warnings()
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = _engine_secret(cfg, run_dir)
    phases = console.Phases()
    model_dir, engine_model_dir = _prepare_model_and_data(cfg, phases, secret=secret)
    if resume_from is not None:
        check_resume_model(resume_from, model_dir=model_dir)  # before the engines and the ranks start
    overrides = [*overrides, f"model.path={model_dir}"]
    with LocalProcesses(run_dir / "logs") as procs:
        _start_engines(cfg, procs, phases, engine_model_dir=engine_model_dir, secret=secret)
        cause_file = run_dir / "logs" / RANKS_ERROR_FILE
        cause_file.unlink(missing_ok=True)  # an earlier launch's
        cmd = _ranks_command(cfg, config_path, overrides, cause_file=cause_file, resume=resume)
        t_ranks = time.perf_counter()
        # engines that exit while the ranks run are restarted (rollout.engine_restarts); the supervisor
        # stops before the clean-up below stops the engines
        # Ctrl-C / SIGTERM from here on: the ranks finish the step, checkpoint it and stop (launch/local/stop.py)
        with (
            EngineSupervisor(procs, budget=cfg.rollout.engine_restarts, events_path=engine_events_path(run_dir)),
            LocalStop(run_dir / STOP_FILE) as stop,
        ):
            rc = procs.run_foreground("actor", pinned(cmd, cfg.actor.cpu_cores), env=rank_env(stop))
        ranks_wall_s = time.perf_counter() - t_ranks
    return _report_end(
        cfg,
        rc,
        stop=stop,
        cause_file=cause_file,
        phase_seconds=phases.seconds,
        ranks_wall_s=ranks_wall_s,
        t_start=t_start,
    )


def _engine_secret(cfg: Config, run_dir: Path) -> Path:
    """The run's engine key file (created once, reused by --resume); the user's keys of
    rollout.engine_urls are read now, so a missing variable or file fails before anything starts."""
    if cfg.rollout.engine_urls:
        keys_from_config(cfg.rollout)
    return run_secret_path(run_dir)


def _say_layout_change(cfg: Config, checkpoint: Path | None) -> Path | None:
    """--resume from `checkpoint`: a change of layout said in one line, or refused for what cannot change
    (trainer/checkpoint/resume_check.py); returns the checkpoint."""
    if checkpoint is not None and (line := check_resume_layout(cfg, checkpoint)):
        print(line, flush=True)
    return checkpoint


def _check_before_start(cfg: Config, *, skip_plan: bool) -> None:
    """What refuses the run before any process starts: core lists, the attention kernel's device, the
    memory plan (a ValueError naming the phase and component that do not fit)."""
    check_cores(cfg.rollout.cpu_engine_cores, "rollout.cpu_engine_cores")
    check_cores(cfg.actor.cpu_cores, "actor.cpu_cores")
    check_attention_kernel_device(cfg.actor)  # before any rank starts (the ranks refuse it again at model build)
    if not skip_plan:
        check_before_launch(cfg)  # ValueError naming the phase and component that do not fit


def _prepare_model_and_data(cfg: Config, phases: console.Phases, *, secret: Path) -> tuple[str, str]:
    """(the actor's model directory, the engines'): the model prepared, every prompt row checked, the
    run's engine key written, and with rollout.quantization=fp8 the engines' block-FP8 export."""
    with phases.phase("model", slow_note="building and warm-starting the tiny model (once: it is cached)") as note:
        model_dir = _prepare_model(cfg)
        note["detail"] = _model_line(cfg, model_dir)
    with phases.phase("data", slow_note="checking every prompt row") as note:
        note["detail"] = check_prompt_data(cfg, model_dir)  # ValueError listing bad rows, before any process starts
    if not cfg.rollout.engine_urls:
        ensure_secret_file(secret)  # after the data check: refused data leaves only the run lock behind
    engine_model_dir = model_dir
    if cfg.rollout.quantization == "fp8":  # the engines serve modelopt's block-FP8 export of the base model
        with phases.phase("fp8", slow_note="exporting the base model with modelopt block FP8 for the engines") as note:
            engine_model_dir = str(
                prepare_fp8_rollout(
                    model_dir,
                    fp8_rollout_dir(cfg.trainer.output_dir),
                    engine=cfg.rollout.engine,
                    engine_tp=cfg.rollout.engine_tp,
                )
            )
            note["detail"] = f"block-FP8 checkpoint (modelopt) for the engines in {engine_model_dir}"
    return model_dir, engine_model_dir


def _start_engines(
    cfg: Config, procs: LocalProcesses, phases: console.Phases, *, engine_model_dir: str, secret: Path
) -> None:
    """The run's own CPU engines, started and registered; for SGLang engines of its own, a line saying
    where the run waits for them (rollout.engine_urls: the user's engines, nothing to start)."""
    run_dir = Path(cfg.trainer.output_dir)
    if cfg.rollout.engine == "cpu" and not cfg.rollout.engine_urls:
        with phases.phase("rollout", slow_note=f"starting {cfg.rollout.num_engines} CPU engine(s)") as note:
            urls = procs.start_cpu_engines(
                engine_model_dir,
                num=cfg.rollout.num_engines,
                register_dir=run_dir / "engines",
                seed=cfg.trainer.seed,
                cores=cfg.rollout.cpu_engine_cores,
                device=cfg.rollout.cpu_engine_device,
                auth_file=secret,
                context_length=cfg.rollout.max_prompt_length + cfg.rollout.max_response_length,
            )
            note["detail"] = (
                f"{len(urls)} CPU engine{'s' if len(urls) > 1 else ''} serving at {', '.join(urls)} "
                f"(logs in {procs.log_dir})"
            )
    elif cfg.rollout.engine == "sglang" and not cfg.rollout.engine_urls:
        fp8_args = f" --model {engine_model_dir} --quantization fp8" if cfg.rollout.quantization == "fp8" else ""
        print(
            f"[train] waiting for SGLang engines to register in {run_dir / 'engines'} "
            f"(slurm/rollout_array.sbatch or `python -m dapo_megatron.rollout.sglang_launcher{fp8_args} "
            f"--auth-file {secret} --register-dir {run_dir / 'engines'} ...`)",
            flush=True,
        )


def _ranks_command(cfg: Config, config_path: str, overrides: list[str], *, cause_file: Path, resume: bool) -> list[str]:
    """torchrun over the actor ranks, through launch/local/ranks.py (a rank's failure said in one line)."""
    return [
        sys.executable,
        "-m",
        "dapo_megatron.launch.local.ranks",  # torchrun, saying a rank's failure in one line (launch/local/ranks.py)
        "--cause-file",
        str(cause_file),
        "--",
        "--standalone",
        f"--nproc-per-node={cfg.actor.world_size}",
        "-m",
        "dapo_megatron.cli",
        "train",
        config_path,
        *overrides,
        *(["--resume"] if resume else []),
    ]


def _report_end(
    cfg: Config,
    rc: int,
    *,
    stop: LocalStop,
    cause_file: Path,
    phase_seconds: dict[str, float],
    ranks_wall_s: float,
    t_start: float,
) -> int:
    """The launcher's exit code and last words: torchrun's own failure in one line (a rank's is written
    already), nothing more after a stop request ended the run early, else the run's summary."""
    run_dir = Path(cfg.trainer.output_dir)
    if rc != 0 and not cause_file.is_file():
        # a failing rank's cause is one line already (launch/local/ranks.py: "the run failed on rank R: ..."), the
        # clean-up below this function included; this is for torchrun failing on its own
        print(f"[train] the actor ranks failed (torchrun exit code {rc}); logs in {run_dir / 'logs'}", file=sys.stderr)
    if rc == 0 and stop.received is not None and _stopped_early(cfg):
        return stop.exit_code  # the driver's "stopped at step N (...)" line is the last word
    if rc == 0:
        print(
            metrics_log.run_summary(
                run_dir, phase_seconds=phase_seconds, ranks_wall_s=ranks_wall_s, wall_s=time.perf_counter() - t_start
            ),
            flush=True,
        )
    return rc


def rank_env(stop: LocalStop) -> dict[str, str]:
    """What the actor ranks get on top of this environment: one intra-op thread each (the ranks share
    the cores), the stop request's file, and CUDA_DEVICE_MAX_CONNECTIONS=1 as slurm/_trainer_launch.sh
    sets it (one hardware queue, so Megatron's TP communication overlaps; also what stops its warning)."""
    return {
        "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
        **stop.rank_env(),
    }


def _stopped_early(cfg) -> bool:
    """A stop request ended the run before trainer.total_steps (one in the last step does not)."""
    from dapo_megatron.trainer.checkpoint.files import list_checkpoints

    done = list_checkpoints(cfg.trainer.output_dir)
    return not done or done[-1][0] < cfg.trainer.total_steps


def _prepare_model(cfg) -> str:
    if cfg.tiny.enabled:
        return tiny_model_dir(cfg)
    if not cfg.model.path:
        raise ValueError("config key 'model.path' is empty: name a HF checkpoint directory (or set tiny.enabled=true)")
    return cfg.model.path


def _model_line(cfg, model_dir: str) -> str:
    if not cfg.tiny.enabled:
        return f"{model_dir} (model.path)"
    tn = cfg.tiny
    kind = f"Qwen3-MoE, {tn.num_experts} experts top-{tn.num_experts_per_tok}" if tn.arch == "qwen3_moe" else "Qwen2"
    return (
        f"tiny {kind} ({tn.hidden_size} hidden, {tn.num_layers} layers), warm-started on the answer format "
        f"({tn.warm_start_steps} steps), in {model_dir}"
    )

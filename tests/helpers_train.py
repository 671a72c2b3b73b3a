"""Running `dapo-megatron train` on the tiny config in the integration tests: the run itself, the
metric keys a resumed or recovered run must reproduce, SIGKILLing its engine at chosen points, and
the processes a run leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


# deterministic per step: same prompts, same seeds, same sampled tokens -> same rewards and updates
EXACT_KEYS = (
    "reward/mean",
    "acc/mean",
    "sampler/acc_all",
    "sampler/groups_seen",
    "sampler/groups_kept",
    "sampler/rounds",
    "response_length/mean",
    "actor/num_tokens",
)


# fp32 values computed by the actor from those tokens (bit-identical on one machine, see test)
FLOAT_KEYS = (
    "actor/loss",
    "actor/grad_norm",
    "actor/clipfrac_low",
    "actor/clipfrac_high",
    "actor/entropy",
    "actor/approx_kl",
)


def train_tiny(out: Path, cache: Path, *extra: str, log: Path | None = None) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={cache}",
        "tiny.warm_start_steps=300",
        "trainer.eval_every=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.wandb_mode=disabled",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (out / "console.txt").write_text(proc.stdout + proc.stderr)  # what the user saw (test_console_output)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_cmd(out: Path, cache: Path, *extra: str, config: str = "tiny_cpu.yaml") -> list[str]:
    return [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs" / config),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={cache}",
        "tiny.warm_start_steps=300",
        "trainer.total_steps=4",
        "trainer.eval_every=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.wandb_mode=disabled",
        "rollout.engine_wait_s=120",
        *extra,
    ]  # tiny_run_a's settings


def step_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r["step"] > 0]  # step 0: the starting eval


def engine_pid(out: Path) -> int:
    records = [json.loads(p.read_text()) for p in (out / "engines").glob("*.json")]
    assert len(records) == 1, records
    return int(records[0]["pid"])


def live_engine(out: Path) -> dict | None:
    """The registration of the engine process alive now (the newest incarnation), if any."""
    import psutil

    for path in (out / "engines").glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if psutil.pid_exists(int(record["pid"])):
            return record
    return None


def _weight_version(url: str, run_dir: Path) -> str | None:
    """The engine's weight version, asked with the run's key (the engines the launcher starts refuse a
    request without it: rollout/auth.py)."""
    from dapo_megatron.rollout.auth import read_secret_file, run_secret_path

    try:
        headers = read_secret_file(run_secret_path(run_dir)).header_for("GET", "/get_model_info")
        request = urllib.request.Request(f"{url}/get_model_info", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.loads(reply.read())["weight_version"]
    except (OSError, ValueError, KeyError):
        return None


def step_logged(step: int):
    return lambda out: live_engine(out) if any(r["step"] == step for r in step_rows(out)) else None


def _sync_stamped(out: Path, step: int) -> bool:
    """The driver has finished the weight push that follows step `step`'s updates: its "sync" stamp is in
    timeline.jsonl (streamed as it comes, trainer/timeline.py)."""
    from dapo_megatron.trainer.timeline import read_timeline

    try:
        return any(phase == "sync" and s == step for phase, s, _, _ in read_timeline(out / "timeline.jsonl"))
    except (OSError, ValueError):  # not written yet, or a stamp half-written: the caller polls again
        return False


def holds_weights(version: str):
    """Once the live engine reports `version` ("step_N") and the driver's push of it is over: during step
    N's eval. The engine reports the version before the push's last reply reaches the driver, so the
    version alone would let the kill land in the push (the engine dropped there, not in the eval:
    seen under pytest -n 2)."""
    pushed_after = int(version.removeprefix("step_")) - 1  # the stamp is labelled with the step trained

    def ready(out: Path) -> dict | None:
        if not _sync_stamped(out, pushed_after):
            return None
        record = live_engine(out)
        return record if record and _weight_version(record["url"], out) == version else None

    return ready


def train_killing_engine(
    out: Path, cache: Path, *extra: str, kills=None, config: str = "tiny_cpu.yaml"
) -> tuple[int, str, list]:
    """Run train; SIGKILL its live engine at each of `kills` in turn (each returns the engine's
    registration once it is time; default: once step 1 is logged). Returns (exit code, console text, the
    killed engines' registrations)."""
    kills = (step_logged(1),) if kills is None else kills
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = out.parent / f"{out.name}.console.txt"
    killed = []
    with open(log, "w") as f:
        proc = subprocess.Popen(
            train_cmd(out, cache, *extra, config=config), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 600
            for ready in kills:
                while (record := ready(out)) is None:
                    assert proc.poll() is None, log.read_text()[-4000:]
                    assert time.monotonic() < deadline, "no kill point reached within 600 s"
                    time.sleep(0.05)
                os.kill(int(record["pid"]), signal.SIGKILL)
                killed.append(record)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    return rc, log.read_text(), killed


def process_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_processes(out: Path) -> list[psutil.Process]:
    """Every process on the machine whose command line or environment names this run's directory."""
    found = []
    for proc in psutil.process_iter():
        try:
            if str(out) in " ".join(proc.cmdline()) or any(str(out) in v for v in proc.environ().values()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def train_failing(out: Path, cache: Path, *extra: str, kills=()) -> tuple[int, str]:
    """A tiny run expected to stop on an error (wandb offline, so that its finish can be read): (exit
    code, console text). `kills`: as train_killing_engine's."""
    rc, console, _ = train_killing_engine(out, cache, "trainer.wandb_mode=offline", *extra, kills=kills)
    return rc, console


def wandb_exit_code(out: Path) -> int | None:
    """The exit code wandb.finish recorded for the run's offline wandb run, from wandb's own log
    (wandb/offline-run-*/logs/debug.log: "finishing run ..." then "got exitcode: N"); None when it was
    never finished (a process torn down with its run open leaves `HandleAbandonedError` there instead)."""
    import re

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    text = (runs[0] / "logs" / "debug.log").read_text()
    found = re.search(r"got exitcode: (-?\d+)", text[text.find("finishing run") :]) if "finishing run" in text else None
    return int(found.group(1)) if found else None

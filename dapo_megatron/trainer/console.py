"""What a run prints on the terminal: one line per start-up phase, a step table of fixed columns
that fits 120 characters, and a closing summary. Everything else goes to metrics.jsonl / wandb.

    quiet_backend_warnings()                      # once per process, before megatron-core is imported
    phases = Phases()                             # the launcher (launch/local/launcher.py)
    with phases.phase("model", slow_note="building ...") as note:   # [train] model: ... (12.3 s)
        note["detail"] = "tiny Qwen2 warm-started"
    table = StepTable(total_steps=40)             # MetricsLogger prints one row per logged step
    print(metrics_log.run_summary(run_dir, phase_seconds=phases.seconds, wall_s=...))   # trainer/metrics_log.py

    [train] model: tiny Qwen2 (0.4M parameters), warm start cached (0.3 s)
    [train] rollout: 1 CPU engine serving at http://127.0.0.1:41871 (6.1 s)
    [train] actor: 2 Megatron ranks (TP 1 x PP 1 x DP 2, fp32, gloo), ready 11.8 s after launch
      step  reward    acc   eval     len ...      kl  gnorm   groups    mism mis_kl gen_s train_s sync_s step_s
      0/40       -      -  24.5%       - ...       -      -        -       -      -     -       -      -      -
      1/40  -0.607  25.0%      -    11.2 ... 1.2e-03   0.81    16/22   5e-05  1e-10   0.3     0.2    0.0    0.6
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TextIO

from dapo_megatron.config import Config

PREFIX = "[train]"
TABLE_WIDTH = 120

# --------------------------------------------------------------------------------------------------
# Warnings that cannot matter on this backend, filtered once, here, each with its reason.

_QUIET_WARNINGS: tuple[tuple[str, str, str], ...] = (
    # (message regex, module regex, why it cannot matter)
    (
        r"(Transformer Engine and Apex are|Apex is) not installed\. Falling back",
        r"megatron\.core",
        "megatron-core announces, at import, each fused Apex/TE implementation it replaces with its torch one; "
        "dapo-megatron chooses its backends explicitly (actor.attention_backend=torch runs without TE, Apex is "
        "optional), so on CPU they print 14 times and say nothing the config does not",
    ),
    (
        r"full scope is deprecated\. Use empty cuda_graph_scope",
        r"megatron\.core",
        "megatron-core 0.16.1's own TransformerConfig default (cuda_graph_scope='full') trips its deprecation "
        "warning in __post_init__ (transformer_config.py:1705) once per rank; CUDA graphs are not used",
    ),
    (
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core",
        "a speed hint of megatron-core's tensor-parallel linear layers (tensor_parallel/layers.py:728), printed by "
        "every rank with TP > 1 in its first backward: the training launchers set the variable (slurm/"
        "_trainer_launch.sh, launch/local/launcher.py rank_env); check-parity and convert run one pass whose speed "
        "does not matter, and on CPU (gloo) there is no CUDA queue to configure",
    ),
)


def quiet_backend_warnings() -> None:
    """Install the filters above and turn off transformers' per-load progress bars ("Loading
    weights", "Writing model shards": one bar per tiny checkpoint load, dozens per run, with no
    information a run's own phase lines lack). Idempotent; call before importing megatron-core."""
    for message, module, _why in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


# --------------------------------------------------------------------------------------------------
# Start-up phases


class Phases:
    """`[train] <phase>: <detail> (<seconds> s)` lines, one per phase, and their durations."""

    def __init__(self, *, out: TextIO | None = None, prefix: str = PREFIX) -> None:
        self.out = out
        self.prefix = prefix
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, *, slow_note: str = "", slow_after_s: float = 3.0) -> Iterator[dict[str, str]]:
        """Time the block and print its line with note["detail"] when it ends. A phase still running
        after `slow_after_s` first prints `slow_note`, so a long warm start is never silent while a
        cached one stays one line. A phase that raises prints nothing more: the error says why."""
        import threading

        out = self.out or sys.stdout
        note: dict[str, str] = {"detail": ""}
        timer = None
        if slow_note:
            timer = threading.Timer(
                slow_after_s, lambda: print(f"{self.prefix} {name}: {slow_note} ...", file=out, flush=True)
            )
            timer.daemon = True
            timer.start()
        t0 = time.perf_counter()
        try:
            yield note
        finally:
            if timer is not None:
                timer.cancel()
        self.seconds[name] = time.perf_counter() - t0
        print(f"{self.prefix} {name}: {note['detail']} ({self.seconds[name]:.1f} s)", file=out, flush=True)


def actor_ready(cfg: Config, *, out: TextIO | None = None) -> None:
    """Rank 0's start-up line: the actor's layout and the time since this process started."""
    import psutil
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    ac = cfg.actor
    dp = max(1, world // (ac.tp * ac.pp * ac.cp))
    pipeline = f"PP {ac.pp}" + (f" (VPP {ac.vpp})" if ac.vpp else "")
    layout = f"TP {ac.tp} x {pipeline}" + (f" x CP {ac.cp}" if ac.cp > 1 else "") + f" x DP {dp}"
    backend = dist.get_backend() if dist.is_initialized() else "none"
    since = time.time() - psutil.Process().create_time()
    print(
        f"{PREFIX} actor: {world} Megatron rank{'s' if world > 1 else ''} ({layout}, {ac.precision}, {backend}), "
        f"ready {since:.1f} s after launch",
        file=out or sys.stdout,
        flush=True,
    )


# --------------------------------------------------------------------------------------------------
# The step table: fixed columns (a missing value prints "-"), <= TABLE_WIDTH characters


# a column's formatter: the cell's text from a step's metrics and the column's key, None for "-"
CellFormat = Callable[[Mapping[str, object], str], "str | None"]


def _num(fmt: str) -> CellFormat:
    def cell(metrics: Mapping[str, object], key: str) -> str | None:
        value = _get(metrics, key)
        if value is None or isinstance(value, bool):
            return None
        if not isinstance(value, (int, float, str)):  # what float() would refuse with a TypeError
            return str(value)
        try:
            number = float(value)
        except ValueError:
            return str(value)
        if math.isnan(number) or math.isinf(number):
            return str(number)
        return fmt.format(number)

    return cell


def _per_second(metrics: Mapping[str, object], key: str) -> str | None:
    """A throughput in 5 characters: 812, 3.5K, 11.2K, 123K, 1.2M."""
    value = metrics.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None if value is None else str(value)
    for scale, suffix in ((1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}" if value < 100 * scale else f"{value / scale:.0f}{suffix}"
    return f"{value:.0f}"


def _groups(metrics: Mapping[str, object], key: str) -> str | None:
    kept, seen = metrics.get("sampler/groups_kept"), metrics.get("sampler/groups_seen")
    if kept is None or seen is None:
        return None
    if not isinstance(kept, (int, float, str)) or not isinstance(seen, (int, float, str)):
        raise TypeError(f"sampler/groups_kept={kept!r}, sampler/groups_seen={seen!r}: not numbers")
    return f"{float(kept):.0f}/{float(seen):.0f}"


# A column shows the first of these keys a step has (the old-policy entropy comes for free with the
# pi_old forward; the actor's updates may report their own).
ALIASES: dict[str, tuple[str, ...]] = {"actor/entropy": ("actor/entropy", "actor/entropy_old")}


def _get(metrics: Mapping[str, object], key: str) -> object:
    for name in ALIASES.get(key, (key,)):
        if name in metrics:
            return metrics[name]
    return None


# (metric key, header, width, formatter). The set never changes from row to row; every other metric
# is in metrics.jsonl (and wandb). "groups" = kept / generated groups of the dynamic sampler.
STEP_COLUMNS: tuple[tuple[str, str, int, CellFormat], ...] = (
    ("reward/mean", "reward", 6, _num("{:+.3f}")),
    ("acc/mean", "acc", 6, _num("{:.1%}")),
    ("eval/avg@k", "eval", 6, _num("{:.1%}")),
    ("response_length/mean", "len", 7, _num("{:.1f}")),
    ("actor/entropy", "entropy", 7, _num("{:.3f}")),
    ("actor/clipfrac_high", "clip_hi", 7, _num("{:.3f}")),
    ("actor/approx_kl", "kl", 7, _num("{:.1e}")),
    ("actor/grad_norm", "gnorm", 6, _num("{:.2f}")),
    ("sampler/groups_kept", "groups", 8, _groups),
    ("mismatch/max", "mism", 5, _num("{:.0e}")),
    ("mismatch/k3", "mis_kl", 6, _num("{:.0e}")),  # KL(engine || trainer), k3 (algo/mismatch.py)
    # rollout tokens generated per second; the weight sync's seconds (time/sync_s) are in metrics.jsonl,
    # the timeline and the closing summary
    ("throughput/rollout_tok_s", "tok/s", 5, _per_second),
    ("time/gen_s", "gen_s", 5, _num("{:.1f}")),
    ("time/train_s", "train_s", 7, _num("{:.1f}")),
    ("time/step_s", "step_s", 6, _num("{:.1f}")),
)


# printed once above the first header: the columns whose names do not say it
LEGEND = (
    "groups: kept/generated prompt groups; mism: max |logp trainer - logp engine|, mis_kl: their KL (k3); "
    "tok/s: rollout's"
)


class StepTable:
    """Prints a legend and a header, then one row per step; the header again every `header_every` rows."""

    def __init__(self, *, total_steps: int | None = None, header_every: int = 20, out: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.header_every = header_every
        self.out = out
        self.rows = 0
        self.step_width = max(6, 2 * len(str(total_steps)) + 1) if total_steps else 6

    def header(self) -> str:
        return f"{'step':>{self.step_width}}" + "".join(f" {h:>{w}}" for _, h, w, _ in STEP_COLUMNS)

    def format_row(self, step: int, metrics: Mapping[str, object]) -> str:
        label = f"{step}/{self.total_steps}" if self.total_steps else str(step)
        if "eval/avg@k" not in metrics:  # several eval sets (data.eval_sets): the column shows the first set's
            first = next((k for k in metrics if k.startswith("eval/") and k.endswith("/avg@k")), None)
            metrics = {**metrics, "eval/avg@k": metrics[first]} if first else metrics
        cells = []
        for key, _, width, fmt in STEP_COLUMNS:
            text = fmt(metrics, key)
            cells.append(f" {'-' if text is None else text:>{width}}")
        return f"{label:>{self.step_width}}" + "".join(cells)

    def print_row(self, step: int, metrics: Mapping[str, object]) -> None:
        out = self.out or sys.stdout
        if self.rows == 0:
            print(LEGEND, file=out)
        if self.rows % self.header_every == 0:
            print(self.header(), file=out)
        print(self.format_row(step, metrics), file=out, flush=True)
        self.rows += 1

"""What a resume on another layout costs: the actor checkpoint's save and load seconds, bytes on disk and
each rank's peak resident memory above its start, saved under one layout and loaded under another.

    torchrun --nproc-per-node 2 -m dapo_megatron.benchmarks.reshard --shape tiny --save tp1 --load tp2
    torchrun --nproc-per-node 2 -m dapo_megatron.benchmarks.reshard --shape 100m     # -> ./results/reshard.csv
    dapo-megatron bench reshard --help

Rows (appended the moment they are measured): `save` in megatron's fully_reshardable optimizer format
(what Actor.save writes: every DP rank gathers its TP x PP shard's whole optimizer state before the write),
`save` in the earlier dp_reshardable format beside it (each DP rank writes its own flat shard: no gather,
but it loads only under the same TP x PP), and `load` of the fully_reshardable checkpoint under --load
(each rank reads its TP x PP shard's whole state and keeps its DP slice). The model has random weights
(benchmarks/actor.py's write_random_checkpoint) and zero Adam moments: the times and bytes do not depend
on the values. Peak memory is sampled every 5 ms per rank (psutil RSS), minus the RSS before the phase.
`dapo-megatron plan` predicts the same costs for the presets (memplan/reshard.py); docs/benchmarks.md
has both side by side.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from safetensors import safe_open

from dapo_megatron.actor.actor import Actor
from dapo_megatron.actor.checkpoint import OPTIMIZER_FORMAT, save_checkpoint
from dapo_megatron.actor.optimizer import init_empty_optimizer_state
from dapo_megatron.actor.parallel import init_distributed, model_parallel
from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.actor import QWEN25_15B, TINY, write_random_checkpoint
from dapo_megatron.benchmarks.run import append_rows, check_header, results_csv
from dapo_megatron.config import ActorConfig, Config
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.checkpoint_record import LEGACY_OPTIMIZER_FORMAT
from dapo_megatron.trainer.settings import actor_settings

FIELDS = [
    "shape",
    "params",
    "world",
    "phase",
    "optimizer_format",
    "layout",
    "seconds",
    "disk_mib",
    "peak_rss_mib_max_rank",
    "device",
    "date",
]
# ~100M parameters: 12 layers of hidden 640 / FFN 1792 (61M) + a 32K vocabulary, untied (41M)
SHAPE_100M = dict(
    QWEN25_15B,
    hidden_size=640,
    intermediate_size=1792,
    num_hidden_layers=12,
    num_attention_heads=10,
    num_key_value_heads=2,
    vocab_size=32000,
    tie_word_embeddings=False,
)
SHAPES = dict(zip(parsers.RESHARD_SHAPES, (TINY, SHAPE_100M), strict=True))
LAYOUTS = {name: dict(tp=1, pp=1, cp=1) | parts for name, parts in parsers.RESHARD_LAYOUTS.items()}


class PeakRss:
    """The largest RSS of this process above its value at entry, sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = 0

    def __enter__(self) -> PeakRss:
        self._base = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss - self._base)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss - self._base)


def _settings(sizes: dict, world: int):
    cfg = Config()
    cfg.actor = ActorConfig(
        **sizes,
        world_size=world,
        attention_backend="torch",
        precision="bf16" if torch.cuda.is_available() else "fp32",
        use_distributed_optimizer=True,
        fused_logprob=False,  # no step is taken: the head's kernels are not what this measures
        fused_policy_loss=False,
    )
    return actor_settings(cfg)


def _timed(fn) -> tuple[float, int]:
    """(seconds, the largest peak RSS over the ranks) of a collective `fn`."""
    dist.barrier()
    with PeakRss() as rss:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    peak = torch.tensor([rss.peak], dtype=torch.int64)
    coll.all_reduce(peak, op=dist.ReduceOp.MAX)
    return seconds, int(peak.item())


def _disk_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def _measure(args, *, hf_dir: Path, work: Path) -> list[dict]:
    world = dist.get_world_size()
    save_sizes, load_sizes = LAYOUTS[args.save], LAYOUTS[args.load]
    rows: list[dict] = []
    with model_parallel(**save_sizes) as layout:
        actor = Actor(_settings(save_sizes, world), hf_dir, layout)
        init_empty_optimizer_state(actor.optimizer)  # Adam state as after a step (zeros: values cost nothing)
        for fmt in (OPTIMIZER_FORMAT, LEGACY_OPTIMIZER_FORMAT):
            where = work / fmt

            def save(where=where, fmt=fmt):
                if fmt == OPTIMIZER_FORMAT:
                    actor.save(where)  # what a run writes
                else:  # the earlier format, only to compare its cost (never loaded here)
                    sd = actor._sharded_state_dict(is_loading=False, optimizer_format=fmt)
                    save_checkpoint(where, sharded_state_dict=sd, meta={"optimizer_format": fmt})

            seconds, peak = _timed(save)
            rows.append(dict(phase="save", optimizer_format=fmt, layout=args.save, seconds=seconds, peak=peak))
            rows[-1]["disk_mib"] = _disk_mib(where)
        actor.close()
        del actor
    with model_parallel(**load_sizes) as layout:
        actor = Actor(_settings(load_sizes, world), hf_dir, layout)
        seconds, peak = _timed(lambda: actor.load(work / OPTIMIZER_FORMAT, seed=0))
        rows.append(dict(phase="load", optimizer_format=OPTIMIZER_FORMAT, layout=args.load, seconds=seconds, peak=peak))
        rows[-1]["disk_mib"] = _disk_mib(work / OPTIMIZER_FORMAT)
        actor.close()
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - a safe_open handle
    stamp = dict(shape=args.shape, params=params, world=world, date=datetime.date.today().isoformat())
    stamp["device"] = f"CPU ({os.cpu_count()} cores)" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    return [
        {**stamp, **{k: v for k, v in r.items() if k != "peak"}, "peak_rss_mib_max_rank": r["peak"] / 2**20}
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    args = parsers.reshard().parse_args(argv)
    init_distributed()
    rank0 = dist.get_rank() == 0
    csv_path = results_csv(args, name="reshard")
    if rank0:
        check_header(csv_path, FIELDS)
    shape = SHAPES[args.shape]
    hf_dir = Path(tempfile.gettempdir()) / f"dapo_bench_reshard_{args.shape}"
    shared = [args.work_dir or tempfile.mkdtemp(prefix="dapo_reshard_") if rank0 else ""]
    if rank0 and not (hf_dir / "model.safetensors").is_file():
        write_random_checkpoint(hf_dir, num_layers=int(shape["num_hidden_layers"]), shape=shape)
    coll.broadcast_object_list(shared, src=0)  # rank 0's directory, and its checkpoint written
    work = Path(shared[0])
    rows = _measure(args, hf_dir=hf_dir, work=work)
    if rank0:
        append_rows(csv_path, rows, fields=FIELDS)
        print(f"{'phase':<6} {'format':<18} {'layout':<8} {'seconds':>8} {'disk MiB':>9} {'peak RSS MiB':>13}")
        for r in rows:
            print(
                f"{r['phase']:<6} {r['optimizer_format']:<18} {r['layout']:<8} {r['seconds']:>8.2f} "
                f"{r['disk_mib']:>9.1f} {r['peak_rss_mib_max_rank']:>13.1f}"
            )
        print(f"{rows[0]['params'] / 1e6:.1f}M parameters, world {rows[0]['world']}; rows appended to {csv_path}")
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

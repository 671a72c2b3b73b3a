"""`dapo-megatron bench dataplane`: the data plane of one DAPO step at the 32B preset's shape, on
gloo ranks of this machine.

    dapo-megatron bench dataplane                                  # 2 and 4 ranks, 8 layouts
    dapo-megatron bench dataplane --layouts 4:tp2,pp2 --prompts 16 --results-dir /tmp/bench

The step (DAPO's, minus the model maths): global rank 0 holds the scored responses of a step
(Samples as the sampler returns them: 32 prompts x 16 responses by default, response lengths
log-normal with a median of 2,000 tokens, capped at 20,480 like the 32B preset's
max_response_length; prompts 50-500 tokens), then
  1. distribute: every rank gets what it trains on;
  2. bookkeeping: old log-probs are attached, the train-inference mismatch and the entropy are
     reduced to metrics (the log-probs themselves are random: no forward runs);
  3. export: the actor's weights leave as full HF tensors in buckets of --bucket-mb for the engines
     (the engine transfer itself is transfer/weight_sync.py's and not timed here).
The model is the 32B architecture scaled down (hidden 640, 8 layers, 10 heads / 2 KV heads, FFN
3,456, vocabulary 19,008, bf16: 85M parameters) so that 4 ranks fit on a 2-core laptop.

Per rank it measures: bytes received for the batch (and for log-prob reductions), seconds of each
phase, peak RSS of the step, Python objects allocated per token of the step (sys.getallocatedblocks
held at the end of bookkeeping, minus the start), the largest tensor the rank materialised in the
export and the export's peak memory (RSS high-water mark over its start; MALLOC_MMAP_THRESHOLD_ is
set so that freed tensors return to the OS and RSS follows live tensors). It prints a table,
appends one CSV row per rank and layout to --results-dir/dataplane.csv (default ./results/), and
ends with
    dataplane: batch_bytes_over_share=X python_objects_per_token=Y export_peak_over_bucket=Z
X: max over ranks that receive a share of bytes received / bytes of that rank's share as tensors;
Y: max over ranks of objects per token; Z: max over ranks of export peak / the largest bucket
(max(--bucket-mb, the largest single tensor): a tensor is never split). Targets X <= 1.1, Y = 0,
Z <= 2. The line before it: the largest tensor any rank that sends nothing materialised. Roles:
driver (rank 0), exporter (a later pipeline stage's exporting rank, which sends its buckets to the
driver), rank (everything else). docs/benchmarks.md has the measured tables and the extrapolation to 128 ranks.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import random
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from dapo_megatron.actor import parallel
from dapo_megatron.actor.model import build_model_chunks
from dapo_megatron.benchmarks import parsers
from dapo_megatron.config import ActorConfig, Config
from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.scatter import scatter_batch
from dapo_megatron.dataplane.share import PackSettings
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.roles import RankRoles
from dapo_megatron.trainer.step_metrics import old_logprob_metrics
from dapo_megatron.transfer.stage_export import StageExporter, gather_manifests, weights_for_driver

DEFAULT_LAYOUTS = parsers.DEFAULT_LAYOUTS
# The 32B architecture (hidden 5120, 64 layers, 40/8 heads, FFN 27648, vocab 152064) scaled down.
MODEL = dict(
    hidden_size=640,
    intermediate_size=3456,
    num_hidden_layers=8,
    num_attention_heads=10,
    num_key_value_heads=2,
    vocab_size=19008,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
CSV_FIELDS = (
    "date",
    "machine",
    "code",
    "layout",
    "world",
    "tp",
    "pp",
    "cp",
    "dp",
    "rank",
    "role",
    "responses",
    "tokens",
    "batch_recv_bytes",
    "share_bytes",
    "recv_over_share",
    "logprob_reduce_recv_bytes",
    "distribute_s",
    "bookkeep_s",
    "export_s",
    "peak_rss_mb",
    "py_objects_per_token",
    "export_peak_mb",
    "largest_tensor_mb",
    "largest_bucket_mb",
)


# ----------------------------------------------------------------------------------- the step's data


def synthetic_samples(
    *,
    prompts: int,
    n: int,
    seed: int,
    median_response: int = 2000,
    sigma: float = 0.9,
    max_response: int = 20480,
    vocab: int = int(MODEL["vocab_size"]),
) -> list:
    """Samples as the sampler returns them (Python lists per token), lengths long-tailed."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(prompts):
        prompt = torch.randint(5, vocab, (rng.randint(50, 500),), generator=gen).tolist()
        for _ in range(n):
            length = min(max_response, max(16, int(rng.lognormvariate(math.log(median_response), sigma))))
            response = torch.randint(5, vocab, (length,), generator=gen).tolist()
            logprobs = (-torch.rand(length, generator=gen) * 3).tolist()
            out.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=response,
                    group_index=g,
                    reward=float(rng.choice((-1.0, 1.0))),
                    truncated=length >= max_response,
                    advantage=rng.uniform(-1.5, 1.5),
                    rollout_logprobs=logprobs,
                )
            )
    return out


def share_tensor_bytes(num_tokens: int, num_response_tokens: int, num_samples: int) -> int:
    """Bytes of a share as the tensor batch holds it: int32 token ids, fp32 rollout log-probs per
    response token, 21 bytes of per-sample fields (lengths, prompt lengths, group index, reward,
    advantage, truncated)."""
    return 4 * num_tokens + 4 * num_response_tokens + 21 * num_samples


# ------------------------------------------------------------------------------------ measurements


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets this process's VmHWM to its current RSS."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ------------------------------------------------------------- the implementations being measured


def distribute(samples, *, cfg, layout, step_tokens: int) -> tuple[object, dict]:
    """The driver turns the Samples into one RolloutBatch and scatter_batch sends each DP replica
    its token-balanced share of every mini-batch (dataplane/scatter.py)."""
    import torch.distributed as dist

    batch = RolloutBatch.from_samples(samples) if dist.get_rank() == 0 else None
    share, stats = scatter_batch(
        batch,
        layout=layout,
        settings=PackSettings.from_actor_config(cfg.actor),
        sequences_per_mini_batch=cfg.trainer.mini_batch_size * cfg.rollout.n,
    )
    return share, {"batch_recv_bytes": stats.bytes_received, "share_bytes": stats.share_bytes}


def bookkeep(held, *, cfg, layout) -> tuple[object, dict]:
    """Old log-probs stay tensors on the ranks that compute them (the last stage: random values
    here, no forward runs); mismatch and entropy are tensor sums reduced over DP."""
    share, roles = held, RankRoles.current(layout)
    logprobs = entropies = None
    if roles.holds_results:
        count = share.batch.num_response_tokens
        logprobs, entropies = -torch.rand(count), torch.rand(count)
        share.batch.old_logprobs = logprobs
    old_logprob_metrics(share.batch, logprobs, entropies, reports=roles.reports)
    return (share, logprobs, entropies), {"logprob_reduce_recv_bytes": 5 * 8}


def export(chunks, hf_config, layout, *, bucket_bytes: int) -> dict:
    """Each stage's exporter gathers its own parameters over TP (transfer/stage_export.py); later
    stages hand their flat buckets to the driver, which holds one bucket at a time while it is sent
    (the disaggregated sync path; the engine transfer itself is not timed)."""
    exporter = StageExporter(chunks, hf_config, layout, bucket_bytes=bucket_bytes)
    largest = largest_bucket = 0
    for bucket in weights_for_driver(exporter, gather_manifests(exporter)):
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        largest, largest_bucket = max(largest, *sizes), max(largest_bucket, sum(sizes))
        del bucket
    return {
        "largest_tensor_bytes": max(largest, exporter.stats.largest_tensor),
        "largest_bucket_bytes": max(largest_bucket, exporter.stats.largest_bucket),
    }


CODE_VERSION = "after: tensor batch scattered per DP share + per-stage export"


# ----------------------------------------------------------------------------------------- one rank


def _parse_layout(text: str) -> dict:
    world, _, parts = text.partition(":")
    layout = {"world": int(world), "tp": 1, "pp": 1, "cp": 1}
    for part in parts.split(","):
        key, value = part[:2], int(part[2:])
        if key not in ("tp", "pp", "cp", "dp"):
            raise ValueError(f"--layouts: {text!r}: parts are tpN, ppN, cpN, dpN (e.g. 4:tp2,dp2)")
        layout[key] = value
    dp = layout["world"] // (layout["tp"] * layout["pp"] * layout["cp"])
    if dp < 1 or dp * layout["tp"] * layout["pp"] * layout["cp"] != layout["world"] or layout.get("dp", dp) != dp:
        raise ValueError(f"--layouts: {text!r}: tp*pp*cp*dp must equal the world size {layout['world']}")
    layout["dp"] = dp
    return layout


def _bench_config(layout: dict, args):
    cfg = Config()
    cfg.actor = ActorConfig(
        tp=layout["tp"],
        pp=layout["pp"],
        cp=layout["cp"],
        attention_backend="torch",
        precision="bf16",
        micro_batch_tokens=24576,
        use_distributed_optimizer=True,
        sequence_parallel=layout["tp"] > 1,
    )
    cfg.rollout.n = args.n
    cfg.trainer.train_batch_size = args.prompts
    cfg.trainer.mini_batch_size = max(1, args.prompts // 16)  # 16 updates per step, as the 32B preset
    cfg.rollout.weight_bucket_mb = args.bucket_mb
    return cfg


def _rank_main(rank: int, layout: dict, args, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(layout["world"]),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's "Apex is not installed" lines, once per rank
    try:
        queue.put((rank, _rank_step(layout, args)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, {"error": f"{exc!r}\n{traceback.format_exc()}"}))


class _DataStep(NamedTuple):
    recv: dict
    reduce: dict
    distribute_s: float
    bookkeep_s: float
    objects: int  # Python objects (allocated blocks) the step left alive
    peak_rss_bytes: int


def _step_samples(args) -> tuple[list[Sample] | None, int]:
    """The step's samples (on rank 0, None elsewhere) and their token count (on every rank)."""
    import torch.distributed as dist

    samples = synthetic_samples(prompts=args.prompts, n=args.n, seed=args.seed) if dist.get_rank() == 0 else None
    tokens = torch.tensor([sum(s.num_tokens for s in samples) if samples else 0])
    coll.broadcast(tokens, src=0)
    return samples, int(tokens)


def _measure_data_step(samples: list[Sample] | None, *, cfg: Config, groups, step_tokens: int) -> _DataStep:
    """One step's data plane timed (distribute, then bookkeep; barriers between), with the objects it left
    and the peak RSS it reached; the collector off while it runs, the step's data freed after."""
    import gc

    import torch.distributed as dist

    gc.collect()
    gc.disable()  # object counts without collector noise
    dist.barrier()
    reset_peak_rss()
    blocks0 = sys.getallocatedblocks()
    t0 = time.perf_counter()
    held, recv = distribute(samples, cfg=cfg, layout=groups, step_tokens=step_tokens)
    dist.barrier()
    t1 = time.perf_counter()
    held, reduce = bookkeep(held, cfg=cfg, layout=groups)
    dist.barrier()
    t2 = time.perf_counter()
    objects = sys.getallocatedblocks() - blocks0
    step_peak = peak_rss_bytes()
    gc.enable()
    del held
    gc.collect()
    return _DataStep(recv, reduce, t1 - t0, t2 - t1, objects, step_peak)


def _rank_step(layout: dict, args) -> dict:
    import torch.distributed as dist
    from transformers import Qwen2Config

    parallel.init_distributed()
    _import_everything_measured()
    cfg = _bench_config(layout, args)
    hf_config = Qwen2Config(**MODEL, torch_dtype="bfloat16")
    with parallel.model_parallel(tp=layout["tp"], pp=layout["pp"], cp=layout["cp"], seed=0) as groups:
        chunks = build_model_chunks(
            hf_config,
            attention_backend="torch",
            precision="bf16",
            sequence_parallel=cfg.actor.sequence_parallel,
            vocab_divisible_by=1,
        )
        samples, step_tokens = _step_samples(args)
        step = _measure_data_step(samples, cfg=cfg, groups=groups, step_tokens=step_tokens)
        dist.barrier()
        reset_peak_rss()
        rss0 = rss_bytes()
        t3 = time.perf_counter()
        exported = export(chunks, hf_config, groups, bucket_bytes=args.bucket_mb << 20)
        dist.barrier()
        t4 = time.perf_counter()
        export_peak = peak_rss_bytes() - rss0
        step_peak = max(step.peak_rss_bytes, peak_rss_bytes())
        largest_bucket = torch.tensor([exported["largest_bucket_bytes"]])
        coll.all_reduce(largest_bucket, op=dist.ReduceOp.MAX)
        role = _role(groups)
    return {
        **step.recv,
        **step.reduce,
        "tokens": step_tokens,
        "distribute_s": step.distribute_s,
        "bookkeep_s": step.bookkeep_s,
        "export_s": t4 - t3,
        "peak_rss_mb": step_peak / 2**20,
        "py_objects_per_token": step.objects / max(step_tokens, 1),
        "export_peak_mb": max(export_peak, 0) / 2**20,
        "largest_tensor_mb": exported["largest_tensor_bytes"] / 2**20,
        "largest_bucket_mb": max(int(largest_bucket), args.bucket_mb << 20) / 2**20,
        "role": role,
    }


def _role(layout) -> str:
    """driver (rank 0), exporter (a later stage's exporter: it sends its stage's buckets) or rank."""
    roles = RankRoles.current(layout)
    return "driver" if roles.driver else "exporter" if roles.exporter else "rank"


def _import_everything_measured() -> None:
    """Import the measured code before counting objects: module import is a one-time cost, not a
    per-token one."""
    import importlib
    import pickle  # noqa: F401

    for name in (
        "dapo_megatron.trainer.train",
        "dapo_megatron.weights",
        "dapo_megatron.actor.packing",
        "dapo_megatron.dataplane.scatter",
        "dapo_megatron.trainer.step_metrics",
        "dapo_megatron.distributed.roles",
        "dapo_megatron.transfer.stage_export",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # a module the measured revision does not have
            pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_layout(layout: dict, args) -> list[dict]:
    """Spawn the layout's ranks, run one step on each, return one row per rank."""
    import multiprocessing as mp

    # freed tensors go back to the OS at once (no heap caching), so RSS follows the live tensors
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, layout, args, port, queue)) for r in range(layout["world"])]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        while len(results) < len(procs):
            rank, row = queue.get(timeout=args.timeout)
            if "error" in row:
                raise RuntimeError(f"layout {layout['name']}: rank {rank} failed:\n{row['error']}")
            results[rank] = row
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [{**results[r], "rank": r} for r in range(len(procs))]


# ----------------------------------------------------------------------------------------- reporting


def summarize(rows: list[dict]) -> dict:
    """The three headline numbers over every layout and rank (module docstring)."""
    receivers = [r for r in rows if r["role"] != "driver" and r["share_bytes"] > 0]
    x = max((r["batch_recv_bytes"] / r["share_bytes"] for r in receivers), default=0.0)
    y = max(r["py_objects_per_token"] for r in rows)
    z = max(r["export_peak_mb"] / r["largest_bucket_mb"] for r in rows)
    quiet = max((r["largest_tensor_mb"] for r in rows if r["role"] == "rank"), default=0.0)
    return {
        "batch_bytes_over_share": x,
        "python_objects_per_token": y,
        "export_peak_over_bucket": z,
        "non_sender_largest_tensor_mb": quiet,
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'layout':<12}{'rank':>5} {'role':<7}{'recv MB':>9}{'share MB':>9}{'recv/share':>11}"
        f"{'lp-red MB':>10}{'dist s':>8}{'book s':>8}{'export s':>9}{'peak RSS MB':>12}{'obj/tok':>8}"
        f"{'exp peak MB':>12}{'largest MB':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r["batch_recv_bytes"] / r["share_bytes"] if r["share_bytes"] and r["role"] != "driver" else float("nan")
        print(
            f"{r['layout']:<12}{r['rank']:>5} {r['role']:<7}{r['batch_recv_bytes'] / 1e6:>9.2f}"
            f"{r['share_bytes'] / 1e6:>9.2f}{ratio:>11.2f}{r['logprob_reduce_recv_bytes'] / 1e6:>10.2f}"
            f"{r['distribute_s']:>8.2f}{r['bookkeep_s']:>8.2f}{r['export_s']:>9.2f}{r['peak_rss_mb']:>12.0f}"
            f"{r['py_objects_per_token']:>8.3f}{r['export_peak_mb']:>12.1f}{r['largest_tensor_mb']:>11.1f}"
        )


def append_csv(path: Path, rows: list[dict]) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"appended {len(rows)} row(s) to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = parsers.dataplane()  # torch-free: `bench dataplane --help` answers at once
    args = parser.parse_args(argv)
    layouts = []
    for text in filter(None, (t.strip() for t in args.layouts.split(";"))):
        layouts.append({**_parse_layout(text), "name": text})
    stamp = datetime.date.today().isoformat()
    machine = f"{platform.machine()} {os.cpu_count()} cores"
    rows = []
    for layout in layouts:
        print(f"[bench dataplane] layout {layout['name']} ...", flush=True)
        for row in run_layout(layout, args):
            rows.append(
                {
                    **row,
                    "layout": layout["name"],
                    "world": layout["world"],
                    "tp": layout["tp"],
                    "pp": layout["pp"],
                    "cp": layout["cp"],
                    "dp": layout["dp"],
                    "date": stamp,
                    "machine": machine,
                    "code": CODE_VERSION,
                    "responses": args.prompts * args.n,
                }
            )
    print_table(rows)
    append_csv(Path(args.csv) if args.csv else Path(args.results_dir) / "dataplane.csv", rows)
    s = summarize(rows)
    print(f"largest tensor a non-sending rank materialised in the export: {s['non_sender_largest_tensor_mb']:.1f} MB")
    print(
        f"dataplane: batch_bytes_over_share={s['batch_bytes_over_share']:.3f} "
        f"python_objects_per_token={s['python_objects_per_token']:.3f} "
        f"export_peak_over_bucket={s['export_peak_over_bucket']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

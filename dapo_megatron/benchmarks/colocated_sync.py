"""Colocated weight-sync speed: the trainer's weights into an engine on the SAME device, through the
colocated transport (update_weights_from_tensor payloads: CUDA IPC handles on a GPU, POSIX shared memory
on the CPU), reported as seconds and GB/s with the phases.

    python -m dapo_megatron.benchmarks.colocated_sync        # GPU: the Qwen2.5-1.5B shape, bf16, 3.1 GB
    python -m dapo_megatron.benchmarks.colocated_sync --shape tiny --repeats 1   # CPU: shared memory, seconds

The receiver is the project's CPU engine server (`serve-rollout --device cuda:0 --dtype bfloat16` on a GPU:
the e2e_colocated step's engine; SGLang does not travel to the GPU machine), holding a random checkpoint of
the shape (benchmarks/actor.write_random_checkpoint). The trainer side is this process: the shape's HF-named
tensors, random, on the same device. Each measured sync is timed twice over:

  sync_s        TensorWeightSync.sync as the trainer runs it (the product path: begin session, per bucket
                one update_weights_from_tensor, end session); gb_per_s = bytes / sync_s
  phases        the same requests, each phase on its own clock (CUDA synchronised at its edges):
    export_s      the trainer's HF-layout tensors made from its parameters: one device copy of every tensor
                  (iter_hf_weights splits Megatron's fused QKV / gate-up and casts: device copies of the
                  same bytes; the TP all-gather of a sharded trainer is not in this one-rank bench)
    ipc_s         serialize_for_engine_rank of every bucket (CUDA IPC handles / shared-memory segments)
    engine_s      the update_weights_from_tensor requests: the engine opens the handles and copies
    session_s     begin_weight_update + end_weight_update

One warm-up sync (the engine's first opening of each handle, allocator growth), then --repeats measured
syncs: the median and the best. The engine's tensors are compared with the trainer's after the last sync
(first rows of every tensor, /get_weights_by_name): a sync that moved nothing fast is not a result. Rows
to <--results-dir>/colocated_sync.csv or --csv FILE; the row's date and device. The row is written while
the engine still runs (its stop, up to 40 s for a hung one, cannot cost the row: issue 49); the engine's
output goes to --engine-log (default: beside the checkpoint), whose last lines a failed start reports.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dapo_megatron.benchmarks.actor import SHAPES, write_random_checkpoint
from dapo_megatron.benchmarks.engine_abuse import served_engine
from dapo_megatron.benchmarks.run import add_output_args, append_rows, check_header, results_csv
from dapo_megatron.data.tiny_model import build_tiny_tokenizer
from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from dapo_megatron.transfer.weight_sync import TensorWeightSync
from dapo_megatron.weights.export import bucketize

FIELDS = [
    "bench",
    "shape",
    "device",
    "dtype",
    "tensors",
    "bytes",
    "bucket_mb",
    "buckets",
    "repeats",
    "sync_s_p50",
    "sync_s_min",
    "gb_per_s",
    "export_s",
    "ipc_s",
    "engine_s",
    "session_s",
    "phases_total_s",
    "read_back",
    "date",
]


def trainer_tensors(
    model_dir: Path, *, device: str, dtype: torch.dtype, seed: int = 1
) -> list[tuple[str, torch.Tensor]]:
    """The shape's HF-named tensors, random (not the engine's: a sync must change them), on `device`."""
    from safetensors import safe_open

    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            shape = f.get_slice(name).get_shape()
            out.append((name, (0.02 * torch.randn(shape, generator=gen, device=device)).to(dtype)))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def phased_sync(client, weights, *, bucket_bytes: int, device: str, version: str) -> dict[str, float]:
    """One sync with each phase on its own clock (module docstring)."""

    times = dict.fromkeys(("export_s", "ipc_s", "engine_s", "session_s"), 0.0)
    _sync(device)
    t0 = time.perf_counter()
    exported = [(n, t.clone()) for n, t in weights]
    _sync(device)
    times["export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    await client.begin_weight_update()
    times["session_s"] += time.perf_counter() - t0
    buckets = 0
    for bucket in bucketize(exported, bucket_bytes):
        t0 = time.perf_counter()
        payload = [serialize_for_engine_rank(bucket)]
        t1 = time.perf_counter()
        await client.update_weights_from_tensor(payload, flush_cache=True, weight_version=version)
        _sync(device)
        times["ipc_s"] += t1 - t0
        times["engine_s"] += time.perf_counter() - t1
        buckets += 1
    t0 = time.perf_counter()
    await client.end_weight_update()
    times["session_s"] += time.perf_counter() - t0
    times["phases_total_s"] = sum(times.values())
    return {**times, "buckets": buckets}


async def read_back_differences(client, weights) -> list[str]:
    """Names whose first two rows on the engine differ from the trainer's."""
    wrong = []
    for name, tensor in weights:
        got = torch.tensor(await client.get_weights_by_name(name, truncate_size=2), dtype=torch.float64)
        want = (tensor[:2] if tensor.dim() else tensor).double().cpu().reshape(got.shape)
        if not torch.equal(got, want):
            wrong.append(name)
    return wrong


async def measure(url: str, weights, *, bucket_bytes: int, repeats: int, device: str) -> dict[str, float | str]:
    """Warm-up, `repeats` product-path syncs, one phased sync, the read-back; the row's measured fields."""

    async with EngineClient(url) as client:
        sync = TensorWeightSync(bucket_bytes=bucket_bytes)
        await sync.sync([client], iter(weights), weight_version="warmup")
        seconds = []
        for i in range(repeats):
            _sync(device)
            stats = await sync.sync([client], iter(weights), weight_version=f"bench_{i}")
            _sync(device)
            seconds.append(stats.seconds)
        phases = await phased_sync(client, weights, bucket_bytes=bucket_bytes, device=device, version="phased")
        wrong = await read_back_differences(client, weights)
    missing = [n for n in stats.missing if n != "lm_head.weight"]  # tied to the embedding: never sent
    if missing:
        raise RuntimeError(f"colocated-sync bench: the engine holds tensors the trainer did not send: {missing[:5]}")
    p50 = statistics.median(seconds)
    return {
        "tensors": stats.num_tensors,
        "bytes": stats.bytes,
        "repeats": repeats,
        "sync_s_p50": round(p50, 4),
        "sync_s_min": round(min(seconds), 4),
        "gb_per_s": round(stats.bytes / 1e9 / p50, 4),
        **{k: round(v, 4) for k, v in phases.items() if k != "buckets"},
        "buckets": phases["buckets"],
        "read_back": "equal" if not wrong else f"{len(wrong)} differ: {wrong[:3]}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_megatron.benchmarks.colocated_sync", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--bucket-mb", type=int, default=512, help="rollout.weight_bucket_mb (the presets' 512)")
    parser.add_argument("--repeats", type=int, default=3, help="measured syncs after one warm-up")
    parser.add_argument("--checkpoint-dir", default="", help="reuse / write the engine's random checkpoint here")
    parser.add_argument("--engine-log", default="", help="the engine's stdout + stderr (default: <ckpt>.engine.log)")
    add_output_args(parser, name="colocated_sync")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be >= 1")
    on_gpu = torch.cuda.is_available()
    device = "cuda:0" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the CPU engine's default dtype is float32
    csv_path = results_csv(args, name="colocated_sync")
    check_header(csv_path, FIELDS)
    shape = SHAPES[args.shape]
    ckpt = Path(args.checkpoint_dir or Path(tempfile.gettempdir()) / f"dapo_sync_bench_{args.shape}")
    if not (ckpt / "model.safetensors").is_file():
        write_random_checkpoint(ckpt, num_layers=int(shape["num_hidden_layers"]), shape=shape)
    _add_tokenizer(ckpt)
    weights = trainer_tensors(ckpt, device=device, dtype=dtype)
    engine_args = ["--device", device, "--dtype", "bfloat16" if on_gpu else "float32"]
    log_path = Path(args.engine_log or f"{ckpt}.engine.log")
    print(f"engine log: {log_path}")
    tmp = tempfile.TemporaryDirectory()
    with tmp, served_engine(str(ckpt), Path(tmp.name), engine_args, log_path=log_path) as (url, _):
        row = asyncio.run(measure(url, weights, bucket_bytes=args.bucket_mb << 20, repeats=args.repeats, device=device))
        row.update(
            bench="colocated_sync",
            shape=args.shape,
            device=torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)",
            dtype=str(dtype).removeprefix("torch."),
            bucket_mb=args.bucket_mb,
            date=datetime.date.today().isoformat(),
        )
        append_rows(csv_path, [row], fields=FIELDS)  # before the engine is stopped
        print(" | ".join(f"{k}={row[k]}" for k in FIELDS if k not in ("bench", "date")), flush=True)
    return 0 if row["read_back"] == "equal" else 1


def _add_tokenizer(model_dir: Path) -> None:
    """The engine loads a tokenizer with its model: the tiny one (the bench sends no text)."""
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        return

    build_tiny_tokenizer().save_pretrained(model_dir)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())

"""Rollout benchmark on this machine: a random Qwen2 behind a real serve-rollout process; prints
generation throughput (tokens/s at several numbers of concurrent requests) and weight-sync
bandwidth (gloo broadcast vs tensors-by-value over HTTP).

    dapo-megatron bench rollout [--hidden 512 --layers 8 --vocab 32000] [--new-tokens 64] [--results-dir DIR]
    python -m dapo_megatron.benchmarks.rollout ...          # the same

Rows go to <--results-dir>/rollout.csv (default ./results/rollout.csv; dapo_megatron/benchmarks/run.py), in
the kernel benchmarks' columns: kernel (rollout_generate | weight_sync), provider, mode, metric,
unit, x (concurrent requests | MB), p50 (= p20 = p80: one measurement), device, date.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.reward import _device
from dapo_megatron.benchmarks.run import append_rows, results_csv
from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.rollout.registry import read_registrations
from dapo_megatron.transfer.weight_sync import DistributedWeightSync, TensorWeightSync


def _random_qwen2(out_dir: str, *, hidden: int, layers: int, vocab: int) -> int:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


CSV_FIELDS = ("kernel", "provider", "mode", "metric", "unit", "x", "p50", "p20", "p80", "device", "date")


def _row(kernel: str, provider: str, mode: str, metric: str, unit: str, x: object, value: float) -> dict:
    import datetime

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return dict(
        zip(
            CSV_FIELDS,
            (kernel, provider, mode, metric, unit, x, f"{value:.6g}", f"{value:.6g}", f"{value:.6g}", _device(), date),
        )
    )


async def _run(url: str, model_dir: str, *, new_tokens: int, concurrency: list[int]) -> list[dict]:
    async with EngineClient(url) as c:
        return [
            *await _generate_rows(c, new_tokens=new_tokens, concurrency=concurrency),
            *await _weight_sync_rows(c, model_dir),
        ]


async def _generate_rows(c: EngineClient, *, new_tokens: int, concurrency: list[int]) -> list[dict]:
    """/generate throughput: `conc` concurrent requests of new_tokens tokens each, for each conc."""
    rows: list[dict] = []
    print(f"{'concurrent requests':>20} {'tokens':>8} {'seconds':>8} {'tokens/s':>9}")
    for conc in concurrency:
        tic = time.perf_counter()
        outs = await asyncio.gather(
            *(
                c.generate(
                    input_ids=[1, 5 + i, 9],
                    sampling_params={"max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": i},
                )
                for i in range(conc)
            )
        )
        dt = time.perf_counter() - tic
        tokens = sum(len(o["output_ids"]) for o in outs)
        print(f"{conc:>20} {tokens:>8} {dt:>8.2f} {tokens / dt:>9.1f}")
        rows.append(
            _row(
                "rollout_generate",
                "cpu_server",
                f"new_tokens={new_tokens}",
                "tokens_per_s",
                "tok/s",
                conc,
                tokens / dt,
            )
        )
    return rows


async def _weight_sync_rows(c: EngineClient, model_dir: str) -> list[dict]:
    """Weight-sync bandwidth of the model's weights: gloo broadcasts (the first forms the group), then shared memory."""
    from transformers import AutoModelForCausalLM

    rows: list[dict] = []
    weights = list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items())
    print(f"\n{'weight sync':>20} {'MB':>8} {'seconds':>8} {'GB/s':>9}")
    sync = DistributedWeightSync(backend="gloo", bucket_bytes=64 << 20)  # flattened buckets
    for step, label in enumerate(("gloo (1st, +group)", "gloo"), start=1):  # the first also forms the group
        tic = time.perf_counter()
        st = await sync.sync([c], iter(weights), weight_version=f"bench_{step}")
        st.seconds = time.perf_counter() - tic
        print(f"{label:>20} {st.bytes / 1e6:>8.1f} {st.seconds:>8.2f} {st.gb_per_s:>9.3f}")
        rows.append(
            _row(
                "weight_sync",
                "gloo_broadcast",
                "first" if "1st" in label else "repeat",
                "gb_per_s",
                "GB/s",
                round(st.bytes / 1e6, 1),
                st.gb_per_s,
            )
        )
    await sync.close([c])
    st = await TensorWeightSync(bucket_bytes=64 << 20).sync([c], iter(weights), weight_version="bench_tensor")
    print(f"{'shared memory':>20} {st.bytes / 1e6:>8.1f} {st.seconds:>8.2f} {st.gb_per_s:>9.3f}")
    rows.append(
        _row(
            "weight_sync",
            "tensor_shared_memory",
            "repeat",
            "gb_per_s",
            "GB/s",
            round(st.bytes / 1e6, 1),
            st.gb_per_s,
        )
    )
    return rows


@contextlib.contextmanager
def serve_rollout(model_dir: str, register_dir: str, *extra_args: str) -> Iterator[str]:
    """One `serve-rollout` process for a benchmark (its output discarded): yields its URL once it has
    registered in register_dir, and kills it on leaving. extra_args: more serve-rollout flags
    (--dtype, --threads). The trainer's engines start through launch/local/engines.py instead (logs, restarts,
    auth); a benchmark wants one bare process and nothing else on the cores."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "serve-rollout",
            "--model",
            model_dir,
            "--port",
            "0",
            "--register-dir",
            register_dir,
            *extra_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not (os.path.isdir(register_dir) and _registered(register_dir, proc.pid)):
            if proc.poll() is not None:
                raise RuntimeError(f"serve-rollout --model {model_dir} exited with {proc.returncode}")
            time.sleep(0.2)
        yield _registered(register_dir, proc.pid)[0]["url"]
    finally:
        proc.kill()
        proc.wait()


def _registered(register_dir: str, pid: int) -> list[dict]:
    return [r for r in read_registrations(register_dir) if r.get("pid") == pid]


def main(argv: list[str] | None = None) -> int:
    ap = parsers.rollout()  # torch-free: `bench rollout --help` answers at once
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        n = _random_qwen2(model_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        print(
            f"random Qwen2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {n / 1e6:.1f} M params, "
            f"fp32, torch threads {torch.get_num_threads()}\n"
        )
        with serve_rollout(model_dir, os.path.join(tmp, "engines")) as url:
            rows = asyncio.run(
                _run(
                    url,
                    model_dir,
                    new_tokens=args.new_tokens,
                    concurrency=[int(x) for x in args.concurrency.split(",")],
                )
            )
    append_rows(results_csv(args, name="rollout"), rows, fields=CSV_FIELDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Actor training throughput, MFU and peak memory: a Qwen2.5-1.5B-shaped model with random weights.

    dapo-megatron bench actor [--tokens 4096 16384 32768] [--results-dir DIR]   # -> ./results/actor.csv
    torchrun --nproc-per-node 8 -m dapo_megatron.benchmarks.actor --tp 2 --tokens 16384
    tests/gpu/run_all.sh --call 3 OUT   # steps actor_bench_sdpa / actor_bench_flex, where a GPU is lent
    python -m dapo_megatron.benchmarks.actor --shape tiny --tokens 1024 --steps 1   # CPU: a tiny shape, seconds

On a GPU: bf16, NCCL, the `torch` attention backend (per-document causal SDPA, actor/attention.py;
--attention-kernel flex for FlexAttention; --attention te where Transformer Engine is installed). Without
CUDA it runs on the CPU (fp32, gloo, plain-torch log-prob and loss): tokens/s and the process's peak
resident memory (ru_maxrss: it only grows, so the rows of one run are cumulative), MFU only with
--peak-tflops (no CPU peak is assumed). Each micro-batch packs `--seqs-per-mb`
sequences of equal length (a 256-token prompt, the rest response: every position trains), and each
measured step is one Actor.train call over `--micro-batches` micro-batches per DP rank: forward,
backward, grad reduction and the optimizer step.

Each row is appended to the CSV the moment it is measured. A row that runs out of memory is written with
status `oom` (and the peak it reached) and the next row runs; every row's model is freed before the next
(gc, then the allocator's cache; column model_freed checks it). --recompute none|selective|full is
actor.recompute: at 16K+ tokens on the 1.5B shape only `full` fits one 80 GB GPU (`dapo-megatron plan`:
selective keeps nearly everything with flash attention), the setting the presets use at that size.
--count-syncs counts the host syncs of the measured steps (CUDA's sync debug mode). One process can go on
after an OOM; with several ranks an OOM on one of them leaves the others waiting in a collective.

FLOPs per step (the usual model-FLOPs accounting, no recompute counted):
    6 * N * tokens                               dense matmuls, fwd + bwd (N = parameters, the tied
                                                 embedding counted once: its LM-head matmul is real)
  + 6 * layers * hidden * sum_seq L^2            causal attention: QK^T and AV are 2 * 2 * L^2 * hidden
                                                 per layer forward for a full mask, half of it causal,
                                                 times 3 for forward + backward
MFU = FLOPs / step time / (num_gpus * peak); peak = 989 TFLOP/s, the H100 SXM bf16 dense figure
(also used for H200: same tensor cores), or --peak-tflops. A table is printed and rows appended to
<--results-dir>/actor.csv (default ./results/actor.csv) or --csv FILE (dapo_megatron/benchmarks/run.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Literal

import torch

from dapo_megatron.actor.actor import Actor
from dapo_megatron.actor.attention import set_attention_kernel
from dapo_megatron.actor.parallel import init_distributed, model_parallel
from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.run import append_rows, check_header, results_csv
from dapo_megatron.config import ActorConfig, Config
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.trainer.settings import actor_settings
from dapo_megatron.weights.mapping import Dims, expected_hf_shapes

PEAK_FLOPS = {"bf16": 989e12}
QWEN25_15B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
# the CPU check's shape: the attention and the packing of long micro-batches, not the FLOPs
TINY = dict(
    QWEN25_15B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
SHAPES = dict(zip(parsers.ACTOR_SHAPES, (QWEN25_15B, TINY), strict=True))  # --shape NAME
# --packing dapo: a DAPO-like micro-batch of 24,576 tokens, 14 sequences (prompt + response) of mixed length
# from 256 to 8,192 (the long tail of a DAPO batch: a few long responses, many short ones); other --tokens
# scale it (rounded, the last sequence takes the remainder)
DAPO_PACKING_24K = (8192, 4096, 2304, 1792, 1536, 1280, 1024, 1024, 768, 768, 512, 512, 512, 256)


def dapo_packing(tokens: int) -> list[int]:
    """The sequence lengths of one --packing dapo micro-batch of `tokens` tokens (DAPO_PACKING_24K scaled)."""
    total = sum(DAPO_PACKING_24K)
    lengths = [max(2, round(n * tokens / total)) for n in DAPO_PACKING_24K[:-1]]
    last = tokens - sum(lengths)
    if last < 2:
        raise ValueError(f"--packing dapo: {tokens} tokens are too few for {len(DAPO_PACKING_24K)} sequences")
    return [*lengths, last]


def write_random_checkpoint(out_dir: Path, *, num_layers: int, seed: int = 0, shape: dict = QWEN25_15B) -> Path:
    """config.json + random bf16 safetensors of a Qwen2.5-1.5B-shaped model (or `shape`; std 0.02, norms 1),
    generated tensor by tensor (on the GPU when there is one): no transformers model is instantiated.
    model.safetensors appears whole or not at all (written beside, then renamed): the GPU plan's steps share
    one checkpoint directory and reuse it when that file exists, so a step killed mid-write must not leave
    a truncated one behind."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    config = Qwen2Config(**{**shape, "num_hidden_layers": num_layers}, torch_dtype="bfloat16")
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    device = coll.compute_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, hf_shape in expected_hf_shapes(Dims.from_hf(config)).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(hf_shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (0.02 * torch.randn(hf_shape, generator=gen, device=device)).to(torch.bfloat16).cpu()
    partial = out_dir / f"model.safetensors.partial.{os.getpid()}"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    os.replace(partial, out_dir / "model.safetensors")
    return out_dir


def make_mini_batch(
    *,
    tokens_per_mb: int,
    seqs_per_mb: int,
    num_mb: int,
    dp: int,
    vocab: int,
    seed: int,
    prompt_tokens: int | None = None,
    lengths: list[int] | None = None,
):
    """Samples that fill num_mb micro-batches of tokens_per_mb tokens on each of dp ranks exactly; each sequence
    is a prompt of prompt_tokens (default min(256, half the sequence)) and a response of the rest. lengths:
    the sequences of one micro-batch (sum tokens_per_mb; --packing dapo) instead of seqs_per_mb equal ones."""
    gen = torch.Generator().manual_seed(seed)
    per_mb = lengths if lengths is not None else [tokens_per_mb // seqs_per_mb] * seqs_per_mb
    samples = []
    for i in range(len(per_mb) * num_mb * dp):
        length = per_mb[i % len(per_mb)]
        prompt = min(256, length // 2) if prompt_tokens is None else prompt_tokens
        if not 1 <= prompt < length:
            raise ValueError(
                f"--prompt-tokens {prompt}: must be at least 1 and below the sequence length {length} "
                f"(--tokens {tokens_per_mb} / --seqs-per-mb {seqs_per_mb})"
            )
        ids = torch.randint(5, vocab, (length,), generator=gen).tolist()
        response = ids[prompt:]
        samples.append(
            Sample(
                prompt_ids=ids[:prompt],
                response_ids=response,
                group_index=i,
                advantage=1.0 if i % 2 else -1.0,
                old_logprobs=[-2.0] * len(response),
            )
        )
    return samples


def flops_per_step(samples, *, num_params: int, hidden: int, layers: int) -> float:
    tokens = sum(s.num_tokens for s in samples)
    attention = 6.0 * layers * hidden * sum(s.num_tokens**2 for s in samples)
    return 6.0 * num_params * tokens + attention


# the CSV's columns, fixed before the first row so that every row is appended the moment it is measured
FIELDS = [
    "bench",
    "model",
    "precision",
    "attention",
    "tp",
    "pp",
    "dp",
    "tokens_per_micro_batch",
    "prompt_tokens",
    "micro_batches",
    "seqs_per_micro_batch",
    "recompute",
    "status",
    "step_s_p50",
    "step_s_min",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "peak_mem_gib",
    "host_syncs",
    "model_freed",
    "attention_kernel",
    "packing",
    "loss",
    "num_params",
    "device",
    "num_gpus",
    "date",
]
# A test's way to make one row run out of memory for real: "TOKENS=GIB" allocates GIB GiB on the bench's device
# in the row of TOKENS tokens per micro-batch, once its actor is built (tests/integration/test_actor_bench_cpu.py).
EXTRA_ALLOC_ENV = "DAPO_BENCH_ACTOR_EXTRA_ALLOC_GIB"


def is_out_of_memory(err: BaseException) -> bool:
    """torch.OutOfMemoryError (the CUDA caching allocator), or the CPU allocator's failure, a RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(err)
    )


def _parser() -> argparse.ArgumentParser:
    return parsers.actor()  # torch-free: `bench actor --help` answers at once


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for tokens in args.tokens:  # before any model is built
        if args.packing == "dapo":
            try:
                dapo_packing(tokens)
            except ValueError as err:
                parser.error(str(err))
            continue
        length = tokens // args.seqs_per_mb
        if args.prompt_tokens is not None and not 1 <= args.prompt_tokens < length:
            parser.error(
                f"--prompt-tokens {args.prompt_tokens}: must be at least 1 and below the sequence length "
                f"{length} (--tokens {tokens} / --seqs-per-mb {args.seqs_per_mb})"
            )
    shape = SHAPES[args.shape]
    args.layers = args.layers or shape["num_hidden_layers"]
    on_gpu = torch.cuda.is_available()

    owns_group = not torch.distributed.is_initialized()
    init_distributed()
    rank0 = torch.distributed.get_rank() == 0
    csv_path = results_csv(args, name="actor")
    if rank0:
        check_header(csv_path, FIELDS)  # before minutes of measuring, not after
    ckpt = Path(args.checkpoint_dir or Path(tempfile.gettempdir()) / f"dapo_bench_{args.shape}_l{args.layers}")
    if rank0 and not (ckpt / "model.safetensors").is_file():
        write_random_checkpoint(ckpt, num_layers=args.layers, shape=shape)
    torch.distributed.barrier()
    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    rows = []
    for tokens_per_mb in args.tokens:
        for row in _rows(args, shape=shape, ckpt=ckpt, tokens_per_mb=tokens_per_mb, on_gpu=on_gpu, device=device):
            rows.append(row)
            if rank0:  # on disk before the next row starts: a later row that kills the process loses nothing
                append_rows(csv_path, [row], fields=FIELDS)
                _print_row(row, header=len(rows) == 1)
    if rank0:
        print(json.dumps({"device": device, "num_params": rows[0]["num_params"], "num_gpus": rows[0]["num_gpus"]}))
    if owns_group:
        torch.distributed.destroy_process_group()
    return 0


def _rows(args, *, shape: dict, ckpt: Path, tokens_per_mb: int, on_gpu: bool, device: str) -> list[dict]:
    """One row per attention kernel, all measured on one built model: the measurement, or status `oom` with
    the peak reached (for the kernel that ran out and those after it); either way the model is freed after
    (Actor.close, then garbage collection, then the allocator's cache: `del actor` alone left the model alive,
    reachable through the chunk config's callbacks) and model_freed says whether it was."""
    precision: Literal["bf16", "fp32"] = "bf16" if on_gpu else "fp32"
    lengths = dapo_packing(tokens_per_mb) if args.packing == "dapo" else None
    base: dict[str, object] = dict.fromkeys(FIELDS, "")  # one CSV row
    base.update(
        {
            "bench": "actor_train",
            "model": f"{args.shape}-shape-l{args.layers}",
            "precision": precision,
            "attention": args.attention,
            "tp": args.tp,
            "pp": args.pp,
            "tokens_per_micro_batch": tokens_per_mb,
            "prompt_tokens": args.prompt_tokens if args.prompt_tokens is not None else "",
            "micro_batches": args.micro_batches,
            "seqs_per_micro_batch": len(lengths) if lengths else args.seqs_per_mb,
            "recompute": args.recompute,
            "packing": args.packing,
            "device": device,
            "num_gpus": torch.distributed.get_world_size(),
            "date": datetime.date.today().isoformat(),
        }
    )
    actor_ref: list = []  # a weak reference to the row's actor, once built
    measured: list[dict] = []  # one per kernel, appended as each is measured
    try:
        _measure(args, shape=shape, ckpt=ckpt, tokens_per_mb=tokens_per_mb, lengths=lengths, on_gpu=on_gpu,
                 precision=precision, actor_ref=actor_ref, results=measured)  # fmt: skip
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        print(f"tokens_per_micro_batch={tokens_per_mb}: out of memory ({str(err).splitlines()[0][:200]}); next row")
    rows = [{**base, **m, "status": "ok"} for m in measured]
    peak = round(_peak_memory_gib(on_gpu), 2)  # how far an oom row got
    rows += [
        {**base, "attention_kernel": k, "status": "oom", "peak_mem_gib": peak}
        for k in args.attention_kernel[len(measured) :]
    ]
    gc.collect()  # the cycles first: empty_cache can only return blocks nothing references any more
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for row in rows:
        if actor_ref:
            row["model_freed"] = "yes" if all(ref() is None for ref in actor_ref) else "no"
    return rows


def _timed_steps(actor, samples, *, args, on_gpu: bool, first_step: int) -> tuple[list[float], int | None, dict]:
    """One warm-up step, then args.steps measured ones: (seconds, host syncs or None, last metrics)."""
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    times, syncs, metrics = [], None, {}
    for i in range(args.steps + 1):
        counting = args.count_syncs and on_gpu and i > 0
        sync()
        start = time.perf_counter()
        with _SyncCounter(counting) as counter:  # Actor.train's own syncs only, not the timer's
            metrics = actor.train(samples, step=first_step + i)
        sync()
        if i > 0:  # the first step warms up kernels (and, for the first kernel, allocates optimizer state)
            times.append(time.perf_counter() - start)
            if counting:
                syncs = (syncs or 0) + counter.count
    return times, syncs, metrics


def _bench_config(args, *, tokens_per_mb: int, on_gpu: bool, precision: Literal["bf16", "fp32"]) -> Config:
    """The run config of one measured row: the actor section from the command line, a tiny constant lr."""
    cfg = Config()
    cfg.actor = ActorConfig(
        tp=args.tp,
        pp=args.pp,
        attention_backend=args.attention,
        precision=precision,
        micro_batch_tokens=tokens_per_mb,
        recompute=args.recompute,
        use_distributed_optimizer=True,
        world_size=torch.distributed.get_world_size(),
        attention_kernel=args.attention_kernel[0],
        fused_logprob=on_gpu,
        fused_policy_loss=on_gpu,
    )
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-6, 0
    return cfg


def _model_params(actor: Actor, *, dp: int) -> int:
    """The model's parameter count (collective): TP/PP shards add up over all ranks, DP replicas repeat."""
    counts = torch.tensor([sum(p.numel() for chunk in actor.model_chunks for p in chunk.parameters())])
    coll.all_reduce(counts)
    return int(counts.item()) // dp


def _timing_row(
    times: list[float], samples: list, *, flops: float, num_gpus: int, peak_flops: float | None, on_gpu: bool
) -> dict[str, float | str]:
    """One row's speed fields from its step times: p50 and min step, tokens/s, TFLOP/s per GPU, MFU, peak memory."""
    step_s = statistics.median(times)
    return {
        "step_s_p50": round(step_s, 4),
        "step_s_min": round(min(times), 4),
        "tokens_per_s": round(sum(s.num_tokens for s in samples) / step_s, 1),
        "tflops_per_gpu": round(flops / step_s / num_gpus / 1e12, 1),
        "mfu": round(flops / step_s / num_gpus / peak_flops, 4) if peak_flops else "",
        "peak_mem_gib": round(_peak_memory_gib(on_gpu), 2),
    }


def _measure(
    args,
    *,
    shape: dict,
    ckpt: Path,
    tokens_per_mb: int,
    lengths: list[int] | None,
    on_gpu: bool,
    precision: Literal["bf16", "fp32"],
    actor_ref: list,
    results: list[dict],
) -> None:
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else (PEAK_FLOPS["bf16"] if on_gpu else None)
    cfg = _bench_config(args, tokens_per_mb=tokens_per_mb, on_gpu=on_gpu, precision=precision)
    num_gpus = torch.distributed.get_world_size()
    with model_parallel(tp=args.tp, pp=args.pp, seed=1) as layout:
        actor = Actor(actor_settings(cfg), ckpt, layout)
        # the actor and its model chunks (these hold the device memory): both must be gone after the row
        actor_ref.extend(weakref.ref(obj) for obj in (actor, *actor.model_chunks))
        try:
            ballast = _extra_allocation(tokens_per_mb, on_gpu)  # noqa: F841 - held for the row, freed with it
            dp = layout.dp_size  # read inside the block: the groups are gone after it
            num_params = _model_params(actor, dp=dp)
            samples = make_mini_batch(
                tokens_per_mb=tokens_per_mb,
                seqs_per_mb=args.seqs_per_mb,
                num_mb=args.micro_batches,
                dp=dp,
                vocab=actor.hf_config.vocab_size,
                seed=tokens_per_mb,
                prompt_tokens=args.prompt_tokens,
                lengths=lengths,
            )
            flops = flops_per_step(samples, num_params=num_params, hidden=shape["hidden_size"], layers=args.layers)
            for kernel in args.attention_kernel:
                if args.attention == "torch":
                    set_attention_kernel(actor.model_chunks, kernel)
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats()
                times, syncs, metrics = _timed_steps(
                    actor, samples, args=args, on_gpu=on_gpu, first_step=len(results) * (args.steps + 1)
                )
                row = _timing_row(times, samples, flops=flops, num_gpus=num_gpus, peak_flops=peak_flops, on_gpu=on_gpu)
                results.append(
                    {
                        "attention_kernel": kernel,
                        "dp": dp,
                        **row,
                        "host_syncs": syncs if syncs is not None else "",
                        "loss": round(metrics["loss"], 5),
                        "num_params": num_params,
                    }
                )
        finally:  # an OOM row too: its model must go before the next row
            actor.close()
            del actor


def _extra_allocation(tokens_per_mb: int, on_gpu: bool) -> torch.Tensor | None:
    """EXTRA_ALLOC_ENV="TOKENS=GIB": a real allocation of GIB GiB at the row of TOKENS tokens only."""
    tokens, _, gib = os.environ.get(EXTRA_ALLOC_ENV, "").partition("=")
    if not tokens or int(tokens) != tokens_per_mb:
        return None
    return torch.empty(int(float(gib) * 2**30), dtype=torch.uint8, device="cuda" if on_gpu else "cpu")


class _SyncCounter:
    """Counts the host syncs torch.cuda.set_sync_debug_mode("warn") reports inside the block (each is a
    UserWarning whose location is the Python line that synchronised); prints the five most frequent lines."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.count = enabled, 0

    def __enter__(self) -> _SyncCounter:
        if self.enabled:
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        torch.cuda.set_sync_debug_mode("default")
        records = [w for w in self._records if "synchroniz" in str(w.message)]
        self._caught.__exit__(*exc)
        self.count = len(records)
        sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in records)
        print(
            f"host syncs in the measured step: {self.count}"
            + "".join(f"\n  {n:6d}  {site}" for site, n in sites.most_common(5))
        )


def _print_row(row: dict, *, header: bool) -> None:
    keys = [
        "tokens_per_micro_batch",
        "recompute",
        "status",
        "step_s_p50",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "peak_mem_gib",
        "host_syncs",
        "model_freed",
    ]
    if header:
        print(" | ".join(f"{k:>22}" for k in keys))
    print(" | ".join(f"{row[k]!s:>22}" for k in keys))


def _peak_memory_gib(on_gpu: bool) -> float:
    """CUDA: the allocator's peak since the last reset. CPU: this process's peak resident set (ru_maxrss,
    KiB on Linux), which never resets."""
    if on_gpu:
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())

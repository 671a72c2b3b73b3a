"""Actor training throughput, MFU and peak memory: a Qwen2.5-1.5B-shaped model with random weights.

    dapo-megatron bench actor [--tokens 4096 16384 32768] [--results-dir DIR]   # -> ./results/actor.csv
    torchrun --nproc-per-node 8 -m dapo_megatron.benchmarks.actor --tp 2 --tokens 16384
    tests/gpu/run_all.sh OUT   # section "actor" runs it where a GPU is lent
    python -m dapo_megatron.benchmarks.actor --shape tiny --tokens 1024 --steps 1   # CPU: a tiny shape, seconds

On a GPU: bf16, NCCL, the `torch` attention backend (per-document causal SDPA, actor/attention.py;
--attention-kernel flex for FlexAttention; --attention te where Transformer Engine is installed). Without
CUDA it runs on the CPU (fp32, gloo, plain-torch log-prob and loss): tokens/s and the process's peak
resident memory (ru_maxrss: it only grows, so the rows of one run are cumulative), MFU only with
--peak-tflops (no CPU peak is assumed). Each micro-batch packs `--seqs-per-mb`
sequences of equal length (a 256-token prompt, the rest response: every position trains), and each
measured step is one Actor.train call over `--micro-batches` micro-batches per DP rank: forward,
backward, grad reduction and the optimizer step.

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
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dapo_megatron.dataplane import collectives as coll

PEAK_FLOPS = {"bf16": 989e12}
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True)
# the CPU check's shape: the attention and the packing of long micro-batches, not the FLOPs
TINY = dict(QWEN25_15B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
SHAPES = {"qwen2.5-1.5b": QWEN25_15B, "tiny": TINY}


def write_random_checkpoint(out_dir: Path, *, num_layers: int, seed: int = 0, shape: dict = QWEN25_15B) -> Path:
    """config.json + random bf16 safetensors of a Qwen2.5-1.5B-shaped model (or `shape`; std 0.02, norms 1),
    generated tensor by tensor (on the GPU when there is one): no transformers model is instantiated."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from dapo_megatron.weights.mapping import Dims, expected_hf_shapes

    config = Qwen2Config(**{**shape, "num_hidden_layers": num_layers}, torch_dtype="bfloat16")
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in expected_hf_shapes(Dims.from_hf(config)).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (0.02 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16).cpu()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def make_mini_batch(*, tokens_per_mb: int, seqs_per_mb: int, num_mb: int, dp: int, vocab: int, seed: int):
    """Samples that fill num_mb micro-batches of tokens_per_mb tokens on each of dp ranks exactly."""
    from dapo_megatron.dataplane.sample import Sample

    gen = torch.Generator().manual_seed(seed)
    length = tokens_per_mb // seqs_per_mb
    prompt = min(256, length // 2)
    samples = []
    for i in range(seqs_per_mb * num_mb * dp):
        ids = torch.randint(5, vocab, (length,), generator=gen).tolist()
        response = ids[prompt:]
        samples.append(Sample(prompt_ids=ids[:prompt], response_ids=response, group_index=i,
                              advantage=1.0 if i % 2 else -1.0,
                              old_logprobs=[-2.0] * len(response)))
    return samples


def flops_per_step(samples, *, num_params: int, hidden: int, layers: int) -> float:
    tokens = sum(s.num_tokens for s in samples)
    attention = 6.0 * layers * hidden * sum(s.num_tokens ** 2 for s in samples)
    return 6.0 * num_params * tokens + attention


def main(argv: list[str] | None = None) -> int:
    from dapo_megatron.benchmarks.run import add_output_args, append_rows, results_csv

    parser = argparse.ArgumentParser(prog="dapo-megatron bench actor", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="tokens per micro-batch")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--attention-kernel", choices=["sdpa", "flex"], default="sdpa",
                        help="actor.attention_kernel of the torch backend (flex: CUDA only)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak of one device for MFU (default: 989, H100 bf16, on CUDA; none on CPU)")
    parser.add_argument("--seqs-per-mb", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per DP rank per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (after one warm-up step)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--attention", choices=["torch", "te"], default="torch")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--checkpoint-dir", default="", help="reuse / write the random HF checkpoint here")
    add_output_args(parser, name="actor")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    args.layers = args.layers or shape["num_hidden_layers"]
    on_gpu = torch.cuda.is_available()
    precision = "bf16" if on_gpu else "fp32"
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else (PEAK_FLOPS["bf16"] if on_gpu else None)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.actor.parallel import dp_size, init_distributed, model_parallel
    from dapo_megatron.config import ActorConfig, Config

    owns_group = not torch.distributed.is_initialized()
    init_distributed()
    rank0 = torch.distributed.get_rank() == 0
    ckpt = Path(args.checkpoint_dir or Path(tempfile.gettempdir()) / f"dapo_bench_{args.shape}_l{args.layers}")
    if rank0 and not (ckpt / "model.safetensors").is_file():
        write_random_checkpoint(ckpt, num_layers=args.layers, shape=shape)
    torch.distributed.barrier()
    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    rows = []
    for tokens_per_mb in args.tokens:
        cfg = Config()
        cfg.actor = ActorConfig(tp=args.tp, pp=args.pp, attention_backend=args.attention, precision=precision,
                                micro_batch_tokens=tokens_per_mb, recompute=args.recompute,
                                use_distributed_optimizer=True, world_size=torch.distributed.get_world_size(),
                                attention_kernel=args.attention_kernel, fused_logprob=on_gpu,
                                fused_policy_loss=on_gpu)
        cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-6, 0
        with model_parallel(tp=args.tp, pp=args.pp, seed=1):
            actor = Actor(actor_settings(cfg), ckpt)
            num_params = sum(p.numel() for chunk in actor.model_chunks for p in chunk.parameters())
            counts = torch.tensor([num_params])
            coll.all_reduce(counts)  # over all ranks: TP/PP shards add up, DP replicas repeat
            dp = dp_size()  # read inside the block: the groups are gone after it
            num_params = int(counts.item()) // dp
            samples = make_mini_batch(tokens_per_mb=tokens_per_mb, seqs_per_mb=args.seqs_per_mb,
                                      num_mb=args.micro_batches, dp=dp, vocab=actor.hf_config.vocab_size,
                                      seed=tokens_per_mb)
            times = []
            for step in range(args.steps + 1):
                sync()
                start = time.perf_counter()
                metrics = actor.train(samples, step=step)
                sync()
                if step > 0:  # step 0 warms up kernels and allocates optimizer state
                    times.append(time.perf_counter() - start)
            peak_mem = _peak_memory_gib(on_gpu)
            del actor
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        step_s = statistics.median(times)
        flops = flops_per_step(samples, num_params=num_params, hidden=shape["hidden_size"], layers=args.layers)
        num_gpus = torch.distributed.get_world_size()
        rows.append({
            "bench": "actor_train", "model": f"{args.shape}-shape-l{args.layers}", "precision": precision,
            "attention": args.attention, "tp": args.tp, "pp": args.pp, "dp": dp,
            "tokens_per_micro_batch": tokens_per_mb, "micro_batches": args.micro_batches,
            "seqs_per_micro_batch": args.seqs_per_mb, "step_s_p50": round(step_s, 4),
            "step_s_min": round(min(times), 4), "tokens_per_s": round(sum(s.num_tokens for s in samples) / step_s, 1),
            "tflops_per_gpu": round(flops / step_s / num_gpus / 1e12, 1),
            "mfu": round(flops / step_s / num_gpus / peak_flops, 4) if peak_flops else "",
            "peak_mem_gib": round(peak_mem, 2), "attention_kernel": args.attention_kernel,
            "loss": round(metrics["loss"], 5),
            "num_params": num_params, "device": device, "num_gpus": num_gpus,
            "date": datetime.date.today().isoformat(),
        })
    if rank0:
        keys = ["tokens_per_micro_batch", "step_s_p50", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_mem_gib"]
        print(" | ".join(f"{k:>22}" for k in keys))
        for row in rows:
            print(" | ".join(f"{row[k]!s:>22}" for k in keys))
        print(json.dumps({"device": device, "num_params": rows[0]["num_params"], "num_gpus": rows[0]["num_gpus"]}))
        append_rows(results_csv(args, name="actor"), rows, fields=list(rows[0]))
    if owns_group:
        torch.distributed.destroy_process_group()
    return 0


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

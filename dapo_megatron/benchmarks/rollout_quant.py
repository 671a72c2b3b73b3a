"""`dapo-megatron bench rollout-quant`: bf16 vs modelopt FP8 rollout on this machine's CPU engine, in
one run: the engine's resident weight bytes, generation tokens/s, and the log-prob mismatch between
the engine and the trainer (fp32 HF model of the same weights) on the engine's own samples.

    dapo-megatron bench rollout-quant                        # random Qwen2 (hidden 512, 8 layers)
    dapo-megatron bench rollout-quant --model outputs/tiny_cpu/tiny_model/warm --new-tokens 16

Two real serve-rollout processes, one after the other (never both on the 2 cores at once): the bf16
engine from the model directory (--dtype bfloat16) and the FP8 engine from modelopt's export of it
(export_fp8_checkpoint: 128 x 128 block FP8 weights, weight-only, nothing to calibrate; --dtype
bfloat16 for the unquantized tensors, as exported). Prompts: the synthetic addition task through the tiny byte
tokenizer's chat
template (or the model's own tokenizer with --model). Rows go to <--results-dir>/rollout_quant.csv in
the rollout benchmark's columns (provider = engine_bf16 | engine_fp8).

On CPU there is no FP8 GEMM kernel: the FP8 engine computes SGLang's block-FP8 GEMM numerics in plain
torch (cpu_engine/fp8_gemm.py: activations quantized per token x 128, each 128-wide tile's dot summed exactly
in float64), so its tokens/s says nothing about an FP8 kernel; its weight bytes are what an FP8 engine
holds, and its mismatch carries the weight and the activation error an SGLang FP8 engine has.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import torch

from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.rollout import CSV_FIELDS, _row, serve_rollout
from dapo_megatron.benchmarks.run import append_rows, results_csv
from dapo_megatron.data.synthetic import synthetic_train_eval
from dapo_megatron.data.tiny_model import build_tiny_tokenizer
from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
from dapo_megatron.rollout.client import EngineClient


def _random_model(out_dir: str, *, hidden: int, layers: int, vocab: int, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = build_tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=max(vocab, len(tok)),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def _prompts(model_dir: str, num: int, seed: int) -> tuple[list[str], list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    train, _ = synthetic_train_eval(num_train=num, num_eval=1, difficulty=2, seed=seed, style="compact")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": r.prompt}], add_generation_prompt=True, tokenize=False)
        for r in train
    ]
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": r.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for r in train
    ]
    return texts, ids


async def _measure(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list]:
    async with EngineClient(url) as c:
        info = await c.server_info()
        params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
        await c.generate(input_ids=prompts[:2], sampling_params=params)  # warm-up (first-call allocations)
        tic = time.perf_counter()
        outs = await asyncio.gather(
            *(
                c.generate(input_ids=p, return_logprob=True, sampling_params={**params, "sampling_seed": i})
                for i, p in enumerate(prompts)
            )
        )
        seconds = time.perf_counter() - tic
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "weight_bytes": info["cpu_engine"]["resident_memory_bytes"]["weights"],
        "tokens_per_s": tokens / seconds,
    }, outs


def _mismatch(model_dir: str, prompts: list[list[int]], outs: list) -> tuple[float, float]:
    """|log p_engine - log p_trainer| over every sampled token; the trainer is the fp32 model (float64 softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o["output_ids"]])
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(p) - 1 : -1]
            ref = logp.gather(-1, torch.tensor(o["output_ids"])[:, None])[:, 0]
            eng = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
            diffs.append((eng - ref).abs())
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max())


def run(model_dir: str, *, num_prompts: int, new_tokens: int, seed: int, tmp: str) -> list[dict]:
    _, prompts = _prompts(model_dir, num_prompts, seed)
    fp8_dir = str(export_fp8_checkpoint(model_dir, os.path.join(tmp, "fp8")))
    results = {}
    for label, path in (("bf16", model_dir), ("fp8", fp8_dir)):
        threads = str(torch.get_num_threads())
        with serve_rollout(
            path, os.path.join(tmp, f"engines_{label}"), "--dtype", "bfloat16", "--threads", threads
        ) as url:
            stats, outs = asyncio.run(_measure(url, prompts, new_tokens))
        stats["mismatch_mean"], stats["mismatch_max"] = _mismatch(model_dir, prompts, outs)
        results[label] = stats
    print(f"{'engine':>8} {'weights MB':>11} {'tokens/s':>9} {'mismatch mean':>14} {'mismatch max':>13}")
    rows = []
    for label, s in results.items():
        print(
            f"{label:>8} {s['weight_bytes'] / 1e6:>11.2f} {s['tokens_per_s']:>9.1f} {s['mismatch_mean']:>14.3e} "
            f"{s['mismatch_max']:>13.3e}"
        )
        mode = f"prompts={num_prompts},new_tokens={new_tokens}"
        rows += [
            _row("rollout_quant", f"engine_{label}", mode, "weight_bytes", "B", num_prompts, s["weight_bytes"]),
            _row("rollout_quant", f"engine_{label}", mode, "tokens_per_s", "tok/s", num_prompts, s["tokens_per_s"]),
            _row(
                "rollout_quant",
                f"engine_{label}",
                mode,
                "logprob_mismatch_mean",
                "nat",
                num_prompts,
                s["mismatch_mean"],
            ),
            _row(
                "rollout_quant", f"engine_{label}", mode, "logprob_mismatch_max", "nat", num_prompts, s["mismatch_max"]
            ),
        ]
    ratio = results["fp8"]["weight_bytes"] / results["bf16"]["weight_bytes"]
    print(
        f"fp8 / bf16 weight bytes: {ratio:.3f}; tokens/s ratio: "
        f"{results['fp8']['tokens_per_s'] / results['bf16']['tokens_per_s']:.3f}"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = parsers.rollout_quant()  # torch-free: `bench rollout-quant --help` answers at once
    args = ap.parse_args(argv)
    if args.model and not os.path.isdir(args.model):
        raise SystemExit(f"--model: no such directory '{args.model}'")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            model_dir = os.path.join(tmp, "model")
            _random_model(model_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab, seed=args.seed)
            print(
                f"random Qwen2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                f"torch threads {torch.get_num_threads()}\n"
            )
        rows = run(model_dir, num_prompts=args.prompts, new_tokens=args.new_tokens, seed=args.seed, tmp=tmp)
    append_rows(results_csv(args, name="rollout_quant"), rows, fields=CSV_FIELDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

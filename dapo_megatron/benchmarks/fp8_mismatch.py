"""Measure what FP8 rollout weights cost and save: weight bytes (bf16 vs modelopt fp8) and the per-token
log-prob mismatch of the fp8-weight model against the fp32 model, on the synthetic task's answers.

    python -m dapo_megatron.benchmarks.fp8_mismatch --model out/tiny_model/warm --results results/quant_fp8.csv

Prints a table and appends one CSV row per metric to --results (outside the package source). The fp8
model is the modelopt export (export_fp8_checkpoint: 128 x 128 block FP8) with each fp8 weight
dequantized per block (dequantize_block_fp8) into an fp32 copy of the model: weight error only,
activations in fp32, which is what the CPU engine computes (docs/fp8.md).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import tempfile
from pathlib import Path

import torch

from dapo_megatron.data.synthetic import synthetic_train_eval
from dapo_megatron.data.tiny_model import sft_batch
from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
from dapo_megatron.quant.fp8_format import dequantize_block_fp8


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _answer_logprobs(model, tokenizer, prompts, answers) -> torch.Tensor:
    batch = sft_batch(tokenizer, prompts, answers)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return logp[keep]


def measure(*, model_dir: str, num_prompts: int, seed: int) -> dict[str, float]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, _ = synthetic_train_eval(num_train=num_prompts, num_eval=1, difficulty=2, seed=seed, style="compact")
    prompts, answers = [r.prompt for r in train], [r.ground_truth for r in train]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        out = export_fp8_checkpoint(model_dir, Path(tmp) / "fp8")
        fp8_sd = {}
        for f in sorted(out.glob("*.safetensors")):
            fp8_sd.update(load_file(str(f)))
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16_bytes = _bytes({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    fp8_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = fp8_model.state_dict()
    quantized = [k for k, v in fp8_sd.items() if v.dtype == torch.float8_e4m3fn]
    with torch.no_grad():
        for name in quantized:
            state[name].copy_(
                dequantize_block_fp8(fp8_sd[name], fp8_sd[name.removesuffix(".weight") + ".weight_scale_inv"])
            )
    ref = _answer_logprobs(fp32, tokenizer, prompts, answers)
    got = _answer_logprobs(fp8_model, tokenizer, prompts, answers)
    diff = (got - ref).abs()
    lin_bf16 = sum(state[k].numel() * 2 for k in quantized)
    lin_fp8 = sum(
        fp8_sd[k].numel() + 4 * fp8_sd[k.removesuffix(".weight") + ".weight_scale_inv"].numel() for k in quantized
    )  # 1 byte per weight + one fp32 scale per block
    return {
        "weights_bytes_bf16": bf16_bytes,
        "weights_bytes_fp8_export": _bytes(fp8_sd),
        "linear_bytes_bf16": lin_bf16,
        "linear_bytes_fp8": lin_fp8,
        "logprob_mismatch_mean": diff.mean().item(),
        "logprob_mismatch_max": diff.max().item(),
        "tokens": float(diff.numel()),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory (e.g. <output_dir>/tiny_model/warm)")
    ap.add_argument("--results", required=True, help="CSV file to append rows to")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    row = measure(model_dir=args.model, num_prompts=args.num_prompts, seed=args.seed)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    for k, v in row.items():
        print(f"{k:28s} {v:.6g}")
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "machine", "model", "metric", "value"])
        for k, v in row.items():
            w.writerow([when, machine, args.model, k, v])


if __name__ == "__main__":
    main()

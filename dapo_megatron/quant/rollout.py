"""rollout.quantization=fp8 in a run: the engines' start checkpoint and the per-sync conversion.

    engine_dir = prepare_fp8_rollout(cfg, model_dir)   # launcher, before the engines start
    conv = fp8_converter(cfg)                          # driver: the same checkpoint's layout
    named = conv.convert(named)                        # every sync (Driver.push_weights)

The checkpoint is the base model exported by modelopt (export_fp8_checkpoint: FP8_DEFAULT_CFG, max
calibration) into <trainer.output_dir>/rollout_fp8, calibrated on the first CALIB_PROMPTS training
prompts as the engine sees them (the tokenizer's chat template). Its input scales stay those of the
base model for the whole run (a sync has no activations: fp8_sync.py).
"""

from __future__ import annotations

from pathlib import Path

CALIB_PROMPTS = 64


def fp8_rollout_dir(cfg) -> Path:
    return Path(cfg.trainer.output_dir) / "rollout_fp8"


def calibration_texts(cfg, model_dir: str | Path, num: int = CALIB_PROMPTS) -> list[str]:
    """The first `num` training prompts, as the sampler sends them (chat template when the tokenizer has one)."""
    from transformers import AutoTokenizer

    from dapo_megatron.data.datasets import train_and_eval_records

    train, _ = train_and_eval_records(cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = []
    for record in train[:num]:
        chat = record.chat() if hasattr(record, "chat") else record.prompt
        if isinstance(chat, str) or not getattr(tokenizer, "chat_template", None):
            texts.append(chat if isinstance(chat, str) else record.prompt)
        else:
            texts.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    return texts


def prepare_fp8_rollout(cfg, model_dir: str | Path) -> Path:
    """Export the base model at `model_dir` with modelopt FP8 into fp8_rollout_dir(cfg) (each launch:
    the base model and its calibration are fixed, so the export is the same; seconds for the tiny model)."""
    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint

    return export_fp8_checkpoint(model_dir, fp8_rollout_dir(cfg), calib_texts=calibration_texts(cfg, model_dir))


def fp8_converter(cfg):
    """The per-sync converter for the engines' checkpoint; ValueError naming it when it is missing."""
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

    path = fp8_rollout_dir(cfg)
    if not (path / "hf_quant_config.json").is_file():
        raise ValueError(f"rollout.quantization=fp8: no modelopt FP8 checkpoint in {path} (the launcher exports it "
                         "before starting the engines; engines of rollout.engine_urls must be started from it too)")
    return Fp8SyncConverter.from_checkpoint(path)

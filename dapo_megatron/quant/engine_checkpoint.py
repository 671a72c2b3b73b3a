"""rollout.quantization=fp8 in a run: the engines' start checkpoint and the per-sync conversion.

    out = fp8_rollout_dir(output_dir)                  # <trainer.output_dir>/rollout_fp8
    engine_dir = prepare_fp8_rollout(model_dir, out, engine=..., engine_tp=...)   # launcher, before the engines
    conv = fp8_converter(out)                          # driver / colocated ranks / the QAT actor: its layout
    named = conv.convert(named)                        # every sync (Driver.push_weights, ColocatedPlacement)

    python -m dapo_megatron.launch.slurm.fp8_export CONFIG [key=value ...]  # the export alone (slurm/fp8_export.sbatch)

The checkpoint is the base model exported by modelopt (export_fp8_checkpoint: 128 x 128 block FP8 weights,
weight-only, so no calibration data) into <trainer.output_dir>/rollout_fp8, in the layout SGLang's `fp8`
engines and the CPU engine both load (fp8_format.py).
"""

from __future__ import annotations

import json
from pathlib import Path


def fp8_rollout_dir(output_dir: str | Path) -> Path:
    """Where a run's FP8 engine checkpoint lives: <trainer.output_dir>/rollout_fp8."""
    return Path(output_dir) / "rollout_fp8"


def prepare_fp8_rollout(model_dir: str | Path, out_dir: str | Path, *, engine: str, engine_tp: int) -> Path:
    """Export the base model at `model_dir` into out_dir (fp8_rollout_dir; each launch: the base model is
    fixed, so the export is the same; seconds for the tiny model). For SGLang engines (rollout.engine),
    the model's projection sizes are checked first against SGLang's block-shape rule at
    rollout.engine_tp (ValueError naming one)."""
    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
    from dapo_megatron.quant.fp8_format import check_sglang_block_shapes

    if engine == "sglang":
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        check_sglang_block_shapes(hf_config, tp_size=engine_tp)
    return export_fp8_checkpoint(model_dir, out_dir)


def fp8_converter(checkpoint_dir: str | Path):
    """The per-sync converter for the engines' checkpoint (fp8_rollout_dir); ValueError naming it when it
    is missing."""
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

    path = Path(checkpoint_dir)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"rollout.quantization=fp8: no FP8 rollout checkpoint in {path} (the launcher exports it "
            "before starting the engines; engines of rollout.engine_urls must be started from it too)"
        )
    return Fp8SyncConverter.from_checkpoint(path)

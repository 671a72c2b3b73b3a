"""rollout.quantization=fp8 in a run: the engines' start checkpoint and the per-sync conversion.

    engine_dir = prepare_fp8_rollout(cfg, model_dir)   # launcher, before the engines start
    conv = fp8_converter(cfg)                          # driver / colocated ranks: the same checkpoint's layout
    named = conv.convert(named)                        # every sync (Driver.push_weights, ColocatedPlacement)

    python -m dapo_megatron.quant.engine_checkpoint CONFIG [key=value ...]   # the export alone (slurm/fp8_export.sbatch)
    python -m dapo_megatron.quant.engine_checkpoint CONFIG ... --colocated-only  # only for colocated engines (_trainer_launch.sh)

The checkpoint is the base model exported by modelopt (export_fp8_checkpoint: 128 x 128 block FP8 weights,
weight-only, so no calibration data) into <trainer.output_dir>/rollout_fp8, in the layout SGLang's `fp8`
engines and the CPU engine both load (fp8_format.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fp8_rollout_dir(cfg) -> Path:
    return Path(cfg.trainer.output_dir) / "rollout_fp8"


def prepare_fp8_rollout(cfg, model_dir: str | Path) -> Path:
    """Export the base model at `model_dir` into fp8_rollout_dir(cfg) (each launch: the base model is fixed,
    so the export is the same; seconds for the tiny model). For SGLang engines, the model's projection
    sizes are checked first against SGLang's block-shape rule at rollout.engine_tp (ValueError naming one)."""
    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
    from dapo_megatron.quant.fp8_format import check_sglang_block_shapes

    if cfg.rollout.engine == "sglang":
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        check_sglang_block_shapes(hf_config, tp_size=cfg.rollout.engine_tp)
    return export_fp8_checkpoint(model_dir, fp8_rollout_dir(cfg))


def fp8_converter(cfg):
    """The per-sync converter for the engines' checkpoint; ValueError naming it when it is missing."""
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

    path = fp8_rollout_dir(cfg)
    if not (path / "config.json").is_file():
        raise ValueError(f"rollout.quantization=fp8: no FP8 rollout checkpoint in {path} (the launcher exports it "
                         "before starting the engines; engines of rollout.engine_urls must be started from it too)")
    return Fp8SyncConverter.from_checkpoint(path)


def main(argv: list[str] | None = None) -> int:
    """Export the FP8 rollout checkpoint of a config's base model; prints its directory."""
    import contextlib

    from dapo_megatron.config import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    colocated_only = "--colocated-only" in argv
    argv = [a for a in argv if a != "--colocated-only"]
    if not argv:
        print("usage: python -m dapo_megatron.quant.engine_checkpoint CONFIG [key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    r = cfg.rollout
    if colocated_only and not (r.quantization == "fp8" and r.placement == "colocated" and not r.engine_urls):
        print("")  # the trainer job starts no engines that need it (disaggregated: the fp8_export job)
        return 0
    if cfg.rollout.quantization != "fp8":
        print(f"rollout: error: config key 'rollout.quantization' is {cfg.rollout.quantization!r}; nothing to export",
              file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the directory (a caller may capture it)
        if cfg.tiny.enabled:
            from dapo_megatron.data.tiny_model import prepare_tiny_model

            model_dir = prepare_tiny_model(cfg)
        elif cfg.model.path:
            model_dir = cfg.model.path
        else:
            raise ValueError("config key 'model.path' is empty: name a HF checkpoint directory")
        out = prepare_fp8_rollout(cfg, model_dir)
    print(out)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as err:
        print(f"rollout: error: {err}", file=sys.stderr)
        raise SystemExit(2)

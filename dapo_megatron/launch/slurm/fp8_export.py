"""rollout.quantization=fp8: export a config's base model into the engines' FP8 checkpoint
(quant/engine_checkpoint.py) and print its directory.

    python -m dapo_megatron.launch.slurm.fp8_export CONFIG [key=value ...]                 # slurm/fp8_export.sbatch
    python -m dapo_megatron.launch.slurm.fp8_export CONFIG ... --colocated-only            # slurm/_trainer_launch.sh
"""

from __future__ import annotations

import contextlib
import sys

from dapo_megatron.config import load_config
from dapo_megatron.launch.prepare import tiny_model_dir
from dapo_megatron.launch.script_entry import run_as_script
from dapo_megatron.quant.engine_checkpoint import fp8_rollout_dir, prepare_fp8_rollout


def main(argv: list[str] | None = None) -> int:
    """Export the FP8 rollout checkpoint of a config's base model; prints its directory."""

    argv = list(sys.argv[1:] if argv is None else argv)
    colocated_only = "--colocated-only" in argv
    argv = [a for a in argv if a != "--colocated-only"]
    if not argv:
        print("usage: python -m dapo_megatron.launch.slurm.fp8_export CONFIG [key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    r = cfg.rollout
    if colocated_only and not (r.quantization == "fp8" and r.placement == "colocated" and not r.engine_urls):
        print("")  # the trainer job starts no engines that need it (disaggregated: the fp8_export job)
        return 0
    if cfg.rollout.quantization != "fp8":
        print(
            f"rollout: error: config key 'rollout.quantization' is {cfg.rollout.quantization!r}; nothing to export",
            file=sys.stderr,
        )
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the directory (a caller may capture it)
        if cfg.tiny.enabled:
            model_dir = tiny_model_dir(cfg)
        elif cfg.model.path:
            model_dir = cfg.model.path
        else:
            raise ValueError("config key 'model.path' is empty: name a HF checkpoint directory")
        out = prepare_fp8_rollout(
            model_dir, fp8_rollout_dir(cfg.trainer.output_dir), engine=r.engine, engine_tp=r.engine_tp
        )
    print(out)
    return 0


if __name__ == "__main__":
    run_as_script(main, "rollout: error:")

"""Build the embedded tiny model of a config once per job, before the engines and ranks load it.

    MODEL_DIR=$(python -m dapo_megatron.launch.prepare CONFIG)     # slurm/_trainer_launch.sh

Prints the directory to pass as `model.path=...` when the config uses the embedded tiny model
(tiny.enabled, which takes the place of model.path: built, or reused from its cache under
trainer.output_dir), and an empty line otherwise (clusters: model.path names the checkpoint).
"""

from __future__ import annotations

import contextlib
import sys

from dapo_megatron.config import Config, load_config
from dapo_megatron.launch.script_entry import run_as_script
from dapo_megatron.trainer.progress_line import ProgressLine


def tiny_model_dir(cfg: Config) -> str:
    """The embedded tiny model of a config (tiny.enabled): built, or reused from its cache."""
    from dapo_megatron.data.tiny_model import prepare_tiny_model

    r = cfg.rollout
    # a warm start takes a minute or more on a laptop: its count, rate and time left (a cached model: none)
    progress = ProgressLine("[train] model: warm start", total=cfg.tiny.warm_start_steps)
    try:
        return prepare_tiny_model(
            cfg.tiny,
            cfg.data.synthetic,
            out_dir=cfg.trainer.output_dir,
            seed=cfg.trainer.seed,
            max_positions=r.max_prompt_length + r.max_response_length,
            on_step=progress.update,
        )
    finally:
        progress.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m dapo_megatron.launch.prepare CONFIG [key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    if not cfg.tiny.enabled:
        print("")
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the directory (the caller captures it)
        model_dir = tiny_model_dir(cfg)
    print(model_dir)
    return 0


if __name__ == "__main__":
    run_as_script(main, "prepare: error:")

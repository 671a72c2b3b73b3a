"""STAND-IN for `dapo-megatron eval CONFIG --checkpoint DIR --output FILE` in the Slurm tests, named as
such: it writes a result derived from the checkpoint's step (avg@k = step / 100, pass@k = step / 50)
so the eval array -> afterok gather -> table path can be checked value by value.

    python tests/integration/slurm_eval_stand_in.py CONFIG --checkpoint DIR --output FILE
"""

import argparse
import json
from pathlib import Path

from dapo_megatron.config import load_config

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--checkpoint", required=True)
ap.add_argument("--output", required=True)
args = ap.parse_args()
load_config(args.config)  # the frozen config must load
step = json.loads((Path(args.checkpoint) / "trainer_state.json").read_text())["step"]
Path(args.output).write_text(json.dumps({"step": step, "avg@4": step / 100, "pass@4": step / 50}))

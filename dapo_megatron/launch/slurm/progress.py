"""Is a run finished? Exit 0 when its latest complete checkpoint is at trainer.total_steps, else 1.

    python -m dapo_megatron.launch.slurm.progress CONFIG [key=value ...]     # prints "<step>/<total_steps>"

slurm/_trainer_launch.sh asks this after a preemption request: a run that reached its last step in
the meantime is not requeued; one that stopped early (checkpointed for the requeue, or crashed) is.
"""

from __future__ import annotations

import sys

from dapo_megatron.config import load_config
from dapo_megatron.trainer.checkpoint.files import list_checkpoints


def checkpointed_step(output_dir: str) -> int:
    found = list_checkpoints(output_dir)
    return found[-1][0] if found else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m dapo_megatron.launch.slurm.progress CONFIG [key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    step, total = checkpointed_step(cfg.trainer.output_dir), cfg.trainer.total_steps
    print(f"{step}/{total}")
    return 0 if step >= total else 1


if __name__ == "__main__":
    raise SystemExit(main())

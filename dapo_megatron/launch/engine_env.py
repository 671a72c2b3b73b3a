"""The environment a rollout engine starts with, beside the trainer's ranks: the local launcher's CPU
engines (launch/local/launcher.py) and the colocated engines of a Slurm job (launch/slurm/colocated.py).
On the shared level of launch/ because both launchers use it.
"""

from __future__ import annotations

# Set for the trainer's ranks by the batch script (slurm/_trainer_launch.sh exports them before it starts
# this process in the same allocation), not for an inference server: CUDA_DEVICE_MAX_CONNECTIONS=1 gives a
# process ONE hardware work queue, which Megatron wants (TP communication overlaps compute in issue order)
# and which would funnel all of an engine's CUDA streams into one queue.
TRAINER_ONLY_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def engine_environment(trainer_env: dict[str, str]) -> dict[str, str]:
    """The environment a colocated engine starts with: the trainer's, less its trainer-only variables."""
    return {k: v for k, v in trainer_env.items() if k not in TRAINER_ONLY_ENV}

"""dapo-megatron: DAPO reinforcement learning with a Megatron-Core actor, SGLang rollout engines,
fused Triton kernels and Slurm launchers."""

__version__ = "0.1.0"

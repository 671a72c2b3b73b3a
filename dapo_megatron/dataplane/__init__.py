"""The data plane of a step: the rollout batch as tensors, its per-DP-share scatter, rank roles."""

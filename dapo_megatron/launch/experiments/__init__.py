"""Experiments over many runs: the ablation ladder run on this machine, its summary, and the table
gathered from per-checkpoint eval results."""

"""Runs on a Slurm cluster: the sbatch files rendered from a config, their submission and its guard,
`slurm status`, and the entry points the batch scripts call (run lock, colocated engines, FP8 export,
progress)."""

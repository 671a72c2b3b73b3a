"""What `dapo-megatron train` and `eval` start on one machine: the launcher, its engines and torchrun,
their supervision, the stop request and the lifeline that leaves no orphans."""

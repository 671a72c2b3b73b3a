"""`dapo-megatron preflight`: the checks a run assumes, made on its allocation (the command, one node's
worker, the checks across nodes, the link measurements, the report)."""

"""dapo_kernels: fused Triton kernels for DAPO (installed from the folder kernels/)."""

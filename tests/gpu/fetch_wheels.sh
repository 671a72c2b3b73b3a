#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels tests/gpu/run_all.sh needs on the GPU machine
# (Python 3.12, x86-64, no package registry there), liger-kernel included (the kernel benchmark's peer). Its image already has torch, triton,
# transformers, safetensors, tokenizers, psutil, pyarrow, pyyaml, tqdm and pytest: only what is
# missing travels, into .whl/ (git-ignored; pass it in the device tool's `carry`).
#
#   bash tests/gpu/fetch_wheels.sh          # then: run(command="bash tests/gpu/run_all.sh $OUT", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for spec in "megatron-core==0.16.1" "liger-kernel"; do  # liger-kernel: pure py3 wheel, the benchmark's peer column
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec"
done
ls -la .whl

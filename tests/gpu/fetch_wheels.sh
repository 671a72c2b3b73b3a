#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels the GPU machine's image lacks, into .gpu/whl/
# (git-ignored; the device tool carries .gpu/). tests/gpu/run_all.sh installs them there with --no-deps.
#
#   bash tests/gpu/fetch_wheels.sh          # usually through tests/gpu/prepare.sh
#
# What the GPU image has (/work/.library/device/KINDS.md, 2026-11-17: Python 3.12, torch 2.11.0+cu130,
# triton 3.6.0, transformers 5.17.0, safetensors, tokenizers, numpy, pyyaml, pyarrow, aiohttp, psutil, tqdm,
# matplotlib, pytest, packaging) covers every dependency of pyproject.toml except these two:
#   megatron-core 0.16.1   the actor (pure Python; its own requirements torch, numpy, packaging are there)
#   liger-kernel           the kernel benchmark's peer column (pure Python; torch and triton are there)
# wandb is not carried: every GPU step runs with WANDB_MODE=disabled (trainer/metrics_log.py imports it only then).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(megatron-core==0.16.1 liger-kernel==0.8.5)
mkdir -p .gpu/whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  if compgen -G ".gpu/whl/${name//-/_}-${spec##*==}-*.whl" > /dev/null; then continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .gpu/whl "$spec"
done
# one version of each: two would stop the whole install there
ls .gpu/whl | sed 's/-[0-9].*//' | sort | uniq -d | while read -r dup; do
  echo "fetch_wheels: two versions of $dup in .gpu/whl: remove the old one" >&2; exit 1
done
du -sh .gpu/whl

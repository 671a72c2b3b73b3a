#!/usr/bin/env bash
# Everything the GPU check needs that the GPU machine cannot make in its budget, made here on the CPU
# machine into .gpu/ (git-ignored), which the device tool carries (carry=[".gpu"]):
#   .gpu/whl/        the wheels the GPU image lacks (tests/gpu/fetch_wheels.sh)
#   .gpu/tiny/       the warm-started tiny Qwen2 of configs/runs/tiny_cpu.yaml (the dense e2e steps)
#   .gpu/tiny_moe/   the warm-started tiny Qwen3-MoE of configs/runs/tiny_cpu_moe.yaml (e2e_moe)
# The e2e steps run with tiny.require_cached=true: a model that does not match their config stops them at
# once, instead of warm-starting on the GPU machine's clock. Built once; a second run reuses the cache
# (about 4 minutes the first time on a 2-core machine: two 1000-step warm starts).
#
#   bash tests/gpu/prepare.sh            # then: run(command="bash tests/gpu/run_all.sh --call 1 $OUT", carry=[".gpu"])
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
MAX_MIB=48   # the device tool carries at most 64 MiB with the working tree (tracked files ~3 MiB)

bash tests/gpu/fetch_wheels.sh
# every e2e step of the plan, with its own config and overrides (run_all.sh's e2e table): build, then check
# that each finds its model as the GPU step will look for it (tiny.require_cached=true)
E2E=$(bash tests/gpu/run_all.sh --e2e-args)
while read -r step args; do
  # shellcheck disable=SC2086  # the overrides are words
  $PY -m dapo_megatron.launch.prepare $args > /dev/null
done <<< "$E2E"
while read -r step args; do
  # shellcheck disable=SC2086
  echo "$step: $($PY -m dapo_megatron.launch.prepare $args tiny.require_cached=true)"
done <<< "$E2E"
size=$(du -sm .gpu | cut -f1)
echo ".gpu: ${size} MiB"
if [ "$size" -gt "$MAX_MIB" ]; then
  echo "prepare: .gpu is ${size} MiB, over the ${MAX_MIB} MiB this check allows itself of the device tool's 64 MiB" >&2
  exit 1
fi

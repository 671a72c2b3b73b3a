#!/usr/bin/env bash
# GPU checks of every component, run where a GPU is lent (one H100/H200; no internet there).
#
#   tests/gpu/run_all.sh OUT_DIR          # from anywhere; OUT_DIR gets logs, junit XML and CSVs
#   SECTIONS="kernels" tests/gpu/run_all.sh OUT_DIR     # only some sections
#   BENCH_ARGS="--quick" tests/gpu/run_all.sh OUT_DIR   # flags for `bench kernels` (default --quick)
#
# The GPU machine has python3 with torch + triton + pytest but not megatron-core/transformers:
# wheels carried in .whl/ are installed with --no-deps into /tmp/site. The repo is used in place
# through PYTHONPATH (dapo_megatron from the root; dapo_kernels through a shim folder whose
# dapo_kernels entry is a symlink to kernels/), so nothing needs building there.
#
# Adding a check: copy a section below (one function per landed GPU check), add its name to
# SECTIONS' default, write its outputs under "$OUT/<name>/". The exit status is non-zero if any
# section failed; every section runs regardless.
set -u -o pipefail

OUT=${1:?usage: tests/gpu/run_all.sh OUT_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-"env kernels actor sglang_fp8"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"

# ---- environment -----------------------------------------------------------------------------
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip_wheels.log" 2>&1 \
    || echo "warning: some carried wheels failed to install (see $OUT/pip_wheels.log)"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
SHIM=/tmp/dapo_shim
mkdir -p "$SHIM" && ln -sfn "$ROOT/kernels" "$SHIM/dapo_kernels"
export PYTHONPATH="$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
unset TRITON_INTERPRET

FAILED=()
run_section() {  # run_section NAME COMMAND...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "==== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "---- $name: ok"; else echo "---- $name: FAILED (rc $?)"; FAILED+=("$name"); fi
  tail -n 30 "$OUT/$name.log"
}

# ---- section: env (what the machine is) -------------------------------------------------------
section_env() {
  run_section env bash -c "nvidia-smi; $PY -c 'import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'"
}

# ---- section: kernels (issue 3: dapo_kernels; issue 17: the CPU suite's kernel tests, compiled) ----
section_kernels() {
  mkdir -p "$OUT/kernels"
  run_section kernels_tests $PY -m pytest -m gpu tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/kernels/junit.xml"
  # tests/kernels: the same assertions the CPU suite runs in the interpreter, on CUDA tensors and
  # compiled kernels (the vocab-parallel case needs 2 GPUs and is skipped on one)
  run_section kernels_suite $PY -m pytest tests/kernels -q -p no:cacheprovider \
    --junitxml="$OUT/kernels/junit_suite.xml"
  # shellcheck disable=SC2086
  run_section kernels_bench $PY -m dapo_kernels.bench.run ${BENCH_ARGS:---quick} --csv "$OUT/kernels/results.csv"
}

# ---- section: actor (issue 4: Megatron actor in bf16 + NCCL; issue 17: the fused kernels inside it,
# fused vs plain-torch actor and check-parity --fused-logprob; needs megatron-core + transformers wheels) --
section_actor() {
  mkdir -p "$OUT/actor"
  run_section actor_tests $PY -m pytest -m gpu tests/gpu/test_actor_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/actor/junit.xml"
  # Qwen2.5-1.5B-shaped random model, 4K and 16K tokens per micro-batch: table + CSV
  run_section actor_bench $PY -m dapo_megatron.benchmarks.actor --tokens 4096 16384 --csv "$OUT/actor/actor_bench.csv" \
    --checkpoint-dir /tmp/dapo_bench_qwen25_1.5b
}

# ---- section: sglang_fp8 (issue 14: rollout.quantization=fp8 on a real SGLang engine: start-up from the
# block-FP8 export, in-place reload of syncs; skipped inside pytest when sglang 0.5.21 + sgl_kernel or
# nvidia-modelopt are not installed on the GPU machine) ----
section_sglang_fp8() {
  mkdir -p "$OUT/sglang_fp8"
  run_section sglang_fp8_tests $PY -m pytest -m gpu tests/gpu/test_sglang_fp8_gpu.py -q -s -p no:cacheprovider \
    --junitxml="$OUT/sglang_fp8/junit.xml"
}

for section in $SECTIONS; do
  "section_$section"
done

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED sections: ${FAILED[*]}"
  exit 1
fi
echo "all sections passed: $SECTIONS"

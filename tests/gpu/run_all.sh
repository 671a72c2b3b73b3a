#!/usr/bin/env bash
# GPU checks of every component, run where a GPU is lent (one H100/H200; no internet there).
#
#   tests/gpu/run_all.sh OUT_DIR          # from anywhere; OUT_DIR gets logs, junit XML and CSVs
#   SECTIONS="kernels" tests/gpu/run_all.sh OUT_DIR     # only some sections
#   BENCH_ARGS="--quick" tests/gpu/run_all.sh OUT_DIR   # flags for `bench kernels` (default --quick)
#
# Each device call runs at most 10 minutes, so the sections go in three calls (measured 2026-11-25 on an
# H100: env + kernels + actor took 8 minutes):
#   SECTIONS="env kernels transfer"   SECTIONS="actor"   SECTIONS="e2e sglang_fp8"
# Issue 27's full kernel table (every target; --quick has the 7B rows only) takes two more calls,
# appending to one CSV that kernels_targets judges:
#   SECTIONS="kernels" BENCH_ARGS="--models 7b --providers fused,fused_cublas,fused_rowchunk,liger"
#   SECTIONS="kernels" BENCH_ARGS="--models 32b --providers fused,fused_cublas,fused_rowchunk,liger"
# (actor runs the 1.5B bench at 4K/16K/32K tokens twice, sdpa and flex; e2e five tiny runs of 30 steps;
# sglang_fp8 skips in seconds where SGLang's GPU kernels are not installed)
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
SECTIONS=${SECTIONS:-"env kernels actor transfer e2e sglang_fp8"}
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
  # issue 27's targets judged from those rows: PASS / FAIL / NOT MEASURED each (fails until all hold)
  run_section kernels_targets $PY -m dapo_kernels.bench.targets "$OUT/kernels/results.csv"
}

# ---- section: actor (issue 4: Megatron actor in bf16 + NCCL; issue 17: the fused kernels inside it,
# fused vs plain-torch actor and check-parity --fused-logprob; needs megatron-core + transformers wheels) --
section_actor() {
  mkdir -p "$OUT/actor"
  run_section actor_tests $PY -m pytest -m gpu tests/gpu/test_actor_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/actor/junit.xml"
  # the O(T) torch attention on CUDA: lower-right flash chunks, FlexAttention fwd+bwd, linear saved bytes (issue 26)
  run_section actor_attention $PY -m pytest -m gpu tests/gpu/test_attention_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/actor/junit_attention.xml"
  # Qwen2.5-1.5B-shaped random model, 4K / 16K / 32K tokens per micro-batch (issue 26: 32K must fit, MFU >= 35%
  # without TE), per-document SDPA then FlexAttention: table + CSV
  run_section actor_bench $PY -m dapo_megatron.benchmarks.actor --tokens 4096 16384 32768 --csv "$OUT/actor/actor_bench.csv" \
    --checkpoint-dir /tmp/dapo_bench_qwen25_1.5b
  run_section actor_bench_flex $PY -m dapo_megatron.benchmarks.actor --tokens 4096 16384 32768 --attention-kernel flex \
    --csv "$OUT/actor/actor_bench.csv" --checkpoint-dir /tmp/dapo_bench_qwen25_1.5b
}

# ---- section: transfer (issue 24: collectives on the backend's device with NCCL and gloo; the CPU engine on
# the GPU: CUDA IPC payloads from the trainer, release/resume of real device memory, gloo weight group
# from CUDA buckets) ----
section_transfer() {
  mkdir -p "$OUT/transfer"
  run_section transfer_tests $PY -m pytest -m gpu tests/gpu/test_transfer_gpu.py -q -s -p no:cacheprovider \
    --junitxml="$OUT/transfer/junit.xml"
}

# ---- section: e2e (issue 24: the tiny DAPO run on one GPU, 1 rank, as a user runs it; each run must raise
# held-out avg@8 by >= 30 points within 30 steps; the dense runs share one warm-started tiny model) ----
section_e2e() {
  mkdir -p "$OUT/e2e"
  local common="actor.world_size=1 trainer.total_steps=30 trainer.eval_every=10 \
trainer.wandb_mode=disabled tiny.cache_dir=/tmp/dapo_e2e_tiny"
  local fused="actor.fused_logprob=true actor.fused_policy_loss=true"
  e2e_run() {  # e2e_run NAME CONFIG OVERRIDES...
    local name=$1 config=$2; shift 2
    run_section "e2e_$name" bash -c "$PY -m dapo_megatron.cli train $config $* $common \
trainer.output_dir=$OUT/e2e/$name --overwrite && $PY tests/gpu/e2e_learning.py $OUT/e2e/$name --min-gain 0.30"
  }
  e2e_run fp32_fused configs/runs/tiny_cpu.yaml $fused
  e2e_run bf16_fused configs/runs/tiny_cpu.yaml $fused actor.precision=bf16
  e2e_run overlapped configs/runs/tiny_cpu.yaml $fused rollout.max_staleness=1 algorithm.tis_cap=2
  # trainer rank and engine on the one GPU: CUDA IPC weight payloads, engine release/resume of device memory
  e2e_run colocated configs/runs/tiny_cpu_colocated.yaml $fused rollout.cpu_engine_device=cuda
  # MoE without Transformer Engine (megatron's torch router path: actor/compat.bind_missing_te_gemm)
  e2e_run moe configs/runs/tiny_cpu_moe.yaml actor.ep=1
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

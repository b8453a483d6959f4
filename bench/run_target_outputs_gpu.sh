#!/usr/bin/env bash
# Target outputs (EAGLE-3's target distribution) on one H200, in as few device calls as
# possible. Build and bundle here first (an sm_90a tree keeps the bundle small):
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release \
#     -DDRAFTFEED_CUDA_ARCHS="90a-real;90-virtual"
#   cmake --build build-h200 --target draftfeed-target draftfeed-bench draftfeed-e2e-bench \
#     draftfeed-bench-kernels target_outputs_cuda_test cuda_target_outputs_test \
#     target_outputs_goldens_test cuda_engine_test cuda_moe_engine_test cuda_fp8_weights_test
#   BUILD_DIR=build-h200 BINS="draftfeed-target draftfeed-bench draftfeed-e2e-bench ..." \
#     bash bench/run_gpu_checks.sh bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=goldens,tests bash bench/run_target_outputs_gpu.sh   # goldens from transformers, suites
#   PART=speed bash bench/run_target_outputs_gpu.sh           # the feed beside hidden-only
# PART=goldens runs tests/data/make_target_output_goldens.py (transformers, fp32 on the CPU)
# and leaves its files in tests/data for the suites and in $OUT/goldens-outputs.tar to bring
# back and commit.
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -d .bundle ]] || tar -xJf .bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 DRAFTFEED_SOURCE_DIR=$PWD
OUT=${OUT:-/tmp/draftfeed-out}
mkdir -p "$OUT"
part=",${PART:-tests},"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
summary() { grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|Expected|Which is|error while loading|No such file|rror:" || true; }
if [[ $part == *,goldens,* ]]; then
  rm -rf /tmp/goldens-outputs
  (cd tests/data && PYTHONUNBUFFERED=1 timeout 300 python3 make_target_output_goldens.py \
     --out /tmp/goldens-outputs) 2>&1 | tail -40
  cp /tmp/goldens-outputs/* tests/data/ && tar -C /tmp/goldens-outputs -cf "$OUT/goldens-outputs.tar" .
fi
if [[ $part == *,tests,* ]]; then
  for t in ${TESTS:-target_outputs_cuda_test cuda_target_outputs_test target_outputs_goldens_test \
           cuda_engine_test cuda_moe_engine_test cuda_fp8_weights_test}; do
    echo "== $t"
    timeout 300 .bundle/bin/$t 2>&1 | summary
  done
fi
if [[ $part == *,speed,* ]]; then
  timeout 120 .bundle/bin/draftfeed-bench-kernels --benchmark_filter=TargetOutputs 2>&1 | tail -8
  for m in random:qwen3.6-27b random:qwen3.6-35b-a3b; do
    # EAGLE-3's feed: three layers, a 32,000-id draft vocabulary and the argmax.
    timeout 300 .bundle/bin/draftfeed-bench engine --model $m --tokens 49152 --capture 3 \
      --draft_vocab 32000 --argmax --iters ${ITERS:-3} 2>&1 | grep -v "^  "
  done
  timeout 400 .bundle/bin/draftfeed-e2e-bench --model random:qwen3.6-27b --tokens 49152 --capture 3 \
    --draft_vocab 32000 --argmax --batches 3 --repeats 3 --warmup 1 2>&1 | tail -8
fi

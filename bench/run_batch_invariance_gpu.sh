#!/usr/bin/env bash
# Batch invariance on one H200. Build and bundle here first, in an sm_90a tree:
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_CUDA_ARCHS=90a-real
#   cmake --build build-h200 --target draftfeed-bench gemm_batch_invariance_cuda_test \
#     cuda_batch_invariance_test
#   bash scripts/make-bundle.sh .bundle build-h200/bin/draftfeed-bench build-h200/tests/...
#   tar -cJf .bundle.tar.xz .bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=gemms bash bench/run_batch_invariance_gpu.sh     # each GEMM, rows alone vs packed
#   PART=engines bash bench/run_batch_invariance_gpu.sh   # every family at real shapes
#   PART=speed bash bench/run_batch_invariance_gpu.sh     # 49,152-token engine rate, before/after
# FILTER narrows the engine suite (a gtest filter, e.g. '*27b_fp8*').
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_bundle.sh
part=",${PART:-gemms},"
summary() {
  grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|^\[       OK|Failure\$|differ|rror:" || true
}
if [[ $part == *,gemms,* ]]; then
  for t in gemm_batch_invariance_cuda_test kernel_batch_invariance_cuda_test \
           kernel_batch_invariance_moe_cuda_test; do
    echo "== $t"
    timeout 400 .bundle/bin/$t 2>&1 | summary
  done
fi
if [[ $part == *,engines,* ]]; then
  timeout 560 .bundle/bin/cuda_batch_invariance_test --gtest_filter="${FILTER:-*}" 2>&1 | summary
fi
if [[ $part == *,speed,* ]]; then
  # Side by side in one run: draftfeed-bench-before* built from the code
  # before each change (those the bundle has), alternated with this one.
  for m in ${MODELS:-random:qwen3.6-27b-fp8 random:qwen3.6-35b-a3b}; do
    for round in 1 2; do
      for b in .bundle/bin/draftfeed-bench-before* .bundle/bin/draftfeed-bench; do
        [[ -x $b ]] || continue
        echo "== ${b##*/} $m (round $round)"
        $b engine --model "$m" --tokens 49152 --iters 5 2>&1 | grep -E "^engine:|rror"
      done
    done
  done
fi

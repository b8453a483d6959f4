#!/usr/bin/env bash
# The FP8 path's fused activation quantization on one H200. Build and bundle
# here first, in an sm_90a tree (the test and bench binaries named below):
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_CUDA_ARCHS=90a-real
#   cmake --build build-h200 --target draftfeed-bench draftfeed-bench-kernels \
#     fp8_fused_quantize_cuda_test ...
#   bash scripts/make-bundle.sh .bundle build-h200/bin/... ; tar -cJf .bundle.tar.xz .bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=tests bash bench/run_fp8_fusion_gpu.sh     # the kernel and engine suites it touches
#   PART=kernels bash bench/run_fp8_fusion_gpu.sh   # fused against unfused, old against new
#   PART=speed bash bench/run_fp8_fusion_gpu.sh     # 49,152-token engines, before and after
# draftfeed-bench-before / draftfeed-bench-kernels-before in the bundle are
# the same benches built from the code before the change, run alternately.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_bundle.sh
part=",${PART:-tests},"
summary() {
  grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|differ|rror:|got |Expected|Which is" |
    head -40 || true
}
if [[ $part == *,tests,* ]]; then
  for t in ${TESTS:-fp8_fused_quantize_cuda_test fp8_gemm_cuda_test moe_fp8_cuda_test \
           small_ops_cuda_test kernel_batch_invariance_moe_cuda_test cuda_fp8_weights_test \
           cuda_fp8_capture_test cuda_engine_test cuda_moe_engine_test cuda_chunked_prefill_test \
           cuda_tensor_parallel_test}; do
    [[ -x .bundle/bin/$t ]] || continue
    echo "== $t"
    # The MoE kernel invariance suite needs more than 300 s on an H200.
    timeout 480 .bundle/bin/$t 2>&1 | summary
  done
  echo "== cuda_batch_invariance_test ${FILTER:-*fp8*}"
  timeout 400 .bundle/bin/cuda_batch_invariance_test --gtest_filter="${FILTER:-*fp8*}" 2>&1 |
    summary
fi
if [[ $part == *,kernels,* ]]; then
  before_and_after draftfeed-bench-kernels "${KFILTER:-Quantize|SwiGlu|BM_AddRmsNormF32|BM_GatedRmsNorm|BM_SigmoidGateMul|BM_DeviceCopy}" 2
fi
if [[ $part == *,speed,* ]]; then
  for m in ${MODELS:-random:qwen3.6-27b-fp8 random:qwen3.6-35b-a3b-fp8 random:qwen3-30b-a3b-fp8}; do
    for round in $(seq "${ROUNDS:-2}"); do
      for b in .bundle/bin/draftfeed-bench-before .bundle/bin/draftfeed-bench; do
        [[ -x $b ]] || continue
        echo "== ${b##*/} $m (round $round)"
        $b engine --model "$m" --tokens 49152 --iters 5 2>&1 |
          grep -E "^engine:|^  (norm|fp8_quant|elementwise|gemm|expert_gemm) |rror"
      done
    done
  done
fi

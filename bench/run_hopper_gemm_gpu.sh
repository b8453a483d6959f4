#!/usr/bin/env bash
# Our Hopper GEMM (kernels/hopper_gemm*.cuh: the FP8 block-scaled dense GEMM
# and the MoE experts' grouped GEMMs, bf16 and FP8) on one H200. Build and
# bundle here first, in an sm_90a tree:
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_CUDA_ARCHS=90a-real
#   cmake --build build-h200 --target draftfeed-bench draftfeed-bench-kernels fp8_gemm_cuda_test \
#     moe_cuda_test moe_fp8_cuda_test kernel_batch_invariance_moe_cuda_test \
#     gemm_batch_invariance_cuda_test cuda_moe_engine_test cuda_fp8_weights_test \
#     cuda_batch_invariance_test goldens_test fp8_goldens_test
#   bash scripts/make-bundle.sh .bundle build-h200/bin/... ; tar -cJf .bundle.tar.xz .bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=tests bash bench/run_hopper_gemm_gpu.sh    # the suites that run the kernel
#   PART=kernels bash bench/run_hopper_gemm_gpu.sh  # its benchmarks, before and after
#   PART=engine bash bench/run_hopper_gemm_gpu.sh   # 49,152-token engines (MODELS), before and after
#   PART=ncu bash bench/run_hopper_gemm_gpu.sh      # one MoE down GEMM under Nsight Compute
# draftfeed-bench(-kernels)-before in the bundle are the same programs built
# from the code before the change; the two run alternately. The engine rows
# print the GEMM op families of the profiled run.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_bundle.sh
part=",${PART:-tests},"
out=${OUT:-/tmp}
if [[ $part == *,tests,* ]]; then
  for t in ${TESTS:-fp8_gemm_cuda_test moe_cuda_test moe_fp8_cuda_test \
      gemm_batch_invariance_cuda_test kernel_batch_invariance_moe_cuda_test \
      cuda_moe_engine_test cuda_fp8_weights_test cuda_batch_invariance_test}; do
    [[ -x .bundle/bin/$t ]] || continue
    echo "== $t"
    timeout 300 .bundle/bin/$t 2>&1 |
      grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|rror:|Expected|Which is" | head -40
  done
  run_goldens
fi
if [[ $part == *,kernels,* ]]; then
  before_and_after draftfeed-bench-kernels \
    "${KFILTER:-(Moe(GateUp|Down)|Fp8OwnBlockGemm|Fp8BlockGemm).*/49152}" "${ROUNDS:-2}"
fi
if [[ $part == *,engine,* ]]; then
  for m in ${MODELS:-random:qwen3.6-35b-a3b random:qwen3.6-35b-a3b-fp8 random:qwen3-30b-a3b}; do
    for round in $(seq "${ROUNDS:-1}"); do
      for b in .bundle/bin/draftfeed-bench-before .bundle/bin/draftfeed-bench; do
        [[ -x $b ]] || continue
        echo "== ${b##*/} $m ${ENGINE_ARGS:-} (round $round)"
        $b engine --model "$m" --tokens 49152 --iters 5 ${ENGINE_ARGS:-} 2>&1 |
          grep -E "^engine:|^  (gemm|expert_gemm|moe_combine) |rror"
      done
    done
  done
fi
if [[ $part == *,ncu,* ]]; then
  # The MoE benchmarks' set-up runs gate_up first (the FP8 ones bf16 and FP8
  # gate_up): NCU_SKIP HopperGemm launches pass before the one profiled.
  f=${NCU_BENCH:-BM_MoeDown_Qwen36_35B_A3B/49152}
  for b in draftfeed-bench-kernels-before draftfeed-bench-kernels; do
    [[ -x .bundle/bin/$b ]] || continue
    echo "== ncu $b $f"
    timeout 240 "${NCU:-/usr/local/cuda/bin/ncu}" --clock-control none -k regex:HopperGemm \
      --launch-skip "${NCU_SKIP:-1}" -c 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
      --section SchedulerStats -o "$out/$b" -f .bundle/bin/$b --benchmark_filter="^$f" \
      --benchmark_min_time=0.01 > /dev/null 2>&1
    "${NCU:-/usr/local/cuda/bin/ncu}" -i "$out/$b.ncu-rep" --print-summary none 2>&1 |
      grep -E "Duration|Throughput|Stall|Issued Warp|Eligible|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued|Sectors|Requests" |
      head -60 | tee "$out/$b.txt"
  done
fi

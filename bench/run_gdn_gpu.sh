#!/usr/bin/env bash
# The chunked gated delta rule on one H200. Build and bundle here first, in an
# sm_90a tree:
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_CUDA_ARCHS=90a-real
#   cmake --build build-h200 --target draftfeed-bench-kernels gdn_cuda_test gdn_carry_cuda_test \
#     kernel_paths_cuda_test kernel_batch_invariance_cuda_test
#   bash scripts/make-bundle.sh .bundle build-h200/bin/... ; tar -cJf .bundle.tar.xz .bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=tests bash bench/run_gdn_gpu.sh     # the GDN correctness suites
#   PART=kernels bash bench/run_gdn_gpu.sh   # the rule's benchmarks, before and after
#   PART=ncu bash bench/run_gdn_gpu.sh       # per-kernel time and stall reasons (Nsight Compute)
#   PART=engine bash bench/run_gdn_gpu.sh    # 49,152-token engines (MODELS), before and after
# PART=tests also runs the engine suites that cover the rule (cuda_engine_test,
# cuda_chunked_prefill_test, cuda_batch_invariance_test, the *Cuda* goldens)
# where they are bundled.
# draftfeed-bench-kernels-before in the bundle is the same benchmark built
# from the code before the change; the two run alternately.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_bundle.sh
part=",${PART:-tests},"
out=${OUT:-/tmp}
if [[ $part == *,tests,* ]]; then
  for t in ${TESTS:-gdn_cuda_test gdn_carry_cuda_test kernel_paths_cuda_test attention_cuda_test \
      cuda_engine_test cuda_chunked_prefill_test cuda_batch_invariance_test}; do
    [[ -x .bundle/bin/$t ]] || continue
    echo "== $t"
    timeout 300 .bundle/bin/$t 2>&1 |
      grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|rror:|Expected|Which is|max " |
      grep -v "of tolerance" | head -40
  done
  if [[ -x .bundle/bin/kernel_batch_invariance_cuda_test ]]; then
    echo "== kernel_batch_invariance_cuda_test *Gdn*:*DeltaRule*"
    timeout 300 .bundle/bin/kernel_batch_invariance_cuda_test --gtest_filter='*Gdn*:*DeltaRule*' 2>&1 |
      grep -E "^\[  PASSED|^\[  FAILED|Failure\$|differ" | grep -v " 0 rows differ" | head -20
  fi
  run_goldens
fi
if [[ $part == *,kernels,* ]]; then
  before_and_after draftfeed-bench-kernels "${KFILTER:-GatedDeltaRule}" 3
fi
if [[ $part == *,engine,* ]]; then
  for m in ${MODELS:-random:qwen3.6-27b-fp8 random:qwen3.6-35b-a3b-fp8}; do
    for round in $(seq "${ROUNDS:-1}"); do
      for b in .bundle/bin/draftfeed-bench-before .bundle/bin/draftfeed-bench; do
        [[ -x $b ]] || continue
        echo "== ${b##*/} $m (round $round)"
        $b engine --model "$m" --tokens 49152 --iters 5 2>&1 | grep -E "^engine:|^  gdn_|rror"
      done
    done
  done
fi
if [[ $part == *,ncu,* ]]; then
  for f in ${NCU_BENCHES:-BM_GatedDeltaRule_1x8192 BM_GatedDeltaRule_Mixed16384}; do
    echo "== ncu $f"
    timeout 240 "${NCU:-/usr/local/cuda/bin/ncu}" --clock-control none -k regex:Gdn -c 2 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
      -o "$out/$f" -f .bundle/bin/draftfeed-bench-kernels --benchmark_filter="^$f/" \
      --benchmark_min_time=0.01 > /dev/null 2>&1
    "${NCU:-/usr/local/cuda/bin/ncu}" -i "$out/$f.ncu-rep" --print-summary none 2>&1 |
      grep -E "Gdn|Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Stall|Issued Warp|Eligible|Active Warps Per|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc A|Warp Cycles Per Issued|Dynamic Shared|Waves" |
      tee "$out/$f.txt"
  done
fi

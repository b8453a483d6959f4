#!/usr/bin/env bash
# Every GPU suite and the one-GPU speed checks, for one call on a one-H200
# machine (device time is scarce). Build and bundle here first:
#   bash bench/run_gpu_checks.sh bundle      (makes .bundle.tar.xz, ~27 MB)
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=tests bash bench/run_gpu_checks.sh     # correctness suites
#   PART=speed bash bench/run_gpu_checks.sh     # engine, kernels, gRPC, end to end
#   PART=moe bash bench/run_gpu_checks.sh       # MoE suites, MoE engines beside transformers
#   PART=fp8 bash bench/run_gpu_checks.sh       # FP8 suites, FP8 GEMMs, FP8 engines beside bf16
#   PART=tp bash bench/run_gpu_checks.sh        # tensor parallelism with the ranks on one GPU
#   PART=portable bash bench/run_gpu_checks.sh  # a B200's and an RTX PRO 6000's kernels on this GPU
# BUILD_DIR (default build) names the build tree the bundle is made from; BINS (names
# under bin/ or tests/) bundles only those, when the whole set is past the carry limit.
# The default build holds sm_90a, sm_100a and sm_120a code (about twice the device code of
# sm_90a alone); an H200 needs only sm_90a, whose code also holds the other GPUs' variants that
# PART=portable runs, so a tree configured with -DDRAFTFEED_CUDA_ARCHS="90a-real;90-virtual"
# makes a bundle of the old size.
set -uo pipefail
cd "$(dirname "$0")/.."
b=${BUILD_DIR:-build}
bins=($b/bin/draftfeed-target $b/bin/draftfeed-bench $b/bin/draftfeed-bench-kernels
      $b/bin/draftfeed-grpc-bench $b/bin/draftfeed-e2e-bench
      $b/tests/server/model/cuda_engine_test $b/tests/server/model/goldens_test
      $b/tests/server/service/service_test $b/tests/server/service/transport_test
      $b/tests/kernels/cuda/small_ops_cuda_test $b/tests/kernels/cuda/gdn_cuda_test
      $b/tests/kernels/cuda/attention_cuda_test $b/tests/common/payload_checksum_test
      $b/tests/kernels/cuda/moe_cuda_test $b/tests/server/model/cuda_moe_engine_test
      $b/tests/kernels/cuda/fp8_gemm_cuda_test $b/tests/server/model/cuda_fp8_weights_test
      $b/tests/kernels/cuda/moe_fp8_cuda_test $b/tests/server/model/fp8_goldens_test
      $b/tests/kernels/cuda/capture_fp8_cuda_test $b/tests/server/model/cuda_fp8_capture_test
      $b/tests/server/model/fp8_model_test $b/tests/kernels/cuda/moe_cublas_cuda_test
      $b/tests/server/model/cuda_tensor_parallel_test $b/bin/draftfeed-tp-bench
      $b/bin/draftfeed-fp8-distance
      $b/tests/kernels/cuda/kernel_paths_cuda_test $b/tests/server/model/cuda_device_test)
if [[ -n ${BINS:-} ]]; then
  picked=()
  for want in $BINS; do
    for p in "${bins[@]}" $b/bin/$want; do
      [[ $(basename "$p") == "$want" && -x $p ]] && { picked+=("$p"); break; }
    done
  done
  bins=("${picked[@]}")
fi
if [[ ${1:-} == bundle ]]; then
  rm -rf .bundle
  bash scripts/make-bundle.sh .bundle "${bins[@]}"
  # Device code makes the binaries large; stripped and packed they travel
  # within the device tool's carry limit.
  strip --strip-unneeded .bundle/bin/*
  tar -cJf .bundle.tar.xz .bundle
  ls -la .bundle.tar.xz
  exit
fi
[[ -d .bundle ]] || tar -xJf .bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 DRAFTFEED_SOURCE_DIR=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
summary() { grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|Expected|Which is|error while loading|No such file" || true; }
if [[ ${PART:-tests} == tests ]]; then
  for t in small_ops_cuda_test gdn_cuda_test attention_cuda_test payload_checksum_test \
           moe_cuda_test cuda_engine_test cuda_moe_engine_test; do
    echo "== $t"; timeout 240 .bundle/bin/$t 2>&1 | summary
  done
  echo "== goldens_test *Cuda*"
  timeout 240 .bundle/bin/goldens_test --gtest_filter='*Cuda*' 2>&1 | summary
  echo "== service_test CudaService*"
  timeout 240 .bundle/bin/service_test --gtest_filter='CudaService*' 2>&1 | summary
  echo "== transport_test (two-GPU cases skip on one GPU)"
  timeout 240 .bundle/bin/transport_test 2>&1 | summary
elif [[ $PART == fp8 ]]; then
  for t in fp8_gemm_cuda_test moe_fp8_cuda_test capture_fp8_cuda_test cuda_fp8_weights_test \
           cuda_fp8_capture_test fp8_goldens_test; do
    echo "== $t"; timeout 240 .bundle/bin/$t 2>&1 | summary
  done
  timeout 240 .bundle/bin/draftfeed-bench-kernels --benchmark_filter='Fp8|Bf16Gemm|SwiGluQuant' \
    --benchmark_min_time=0.1 2>&1 | grep -v WARNING
  # The FP8 engines beside their bf16 models, same seed, same call.
  for m in ${FP8_MODELS:-qwen3.6-27b qwen3.6-35b-a3b qwen3-30b-a3b}; do
    for v in "$m-fp8" "$m"; do
      timeout 300 .bundle/bin/draftfeed-bench engine --model "random:$v" --tokens 49152 \
        --iters "${ITERS:-5}"
    done
  done
elif [[ $PART == portable ]]; then
  # Every mode in one process, then the suites and the engine under each other GPU's kernels
  # (DRAFTFEED_PORTABLE_KERNELS, kernels/kernel_paths.cuh): sm100 = no wgmma, sm120 = no wgmma
  # and 99 KB of shared memory a block.
  for t in kernel_paths_cuda_test cuda_device_test; do
    echo "== $t"; out=$(timeout 240 .bundle/bin/$t 2>&1)
    echo "$out" | grep -E "^attention|^GDN"; echo "$out" | summary
  done
  for mode in sm100 sm120; do
    for t in attention_cuda_test gdn_cuda_test small_ops_cuda_test moe_cuda_test \
             moe_fp8_cuda_test cuda_engine_test cuda_moe_engine_test; do
      echo "== DRAFTFEED_PORTABLE_KERNELS=$mode $t"
      DRAFTFEED_PORTABLE_KERNELS=$mode timeout 240 .bundle/bin/$t 2>&1 | summary
    done
    echo "== DRAFTFEED_PORTABLE_KERNELS=$mode goldens_test *Cuda*"
    DRAFTFEED_PORTABLE_KERNELS=$mode timeout 240 .bundle/bin/goldens_test --gtest_filter='*Cuda*' \
      2>&1 | summary
  done
  # The engine on the 27B and 35B-A3B shapes under each GPU's kernels (the line naming them first).
  for mode in 0 sm100 sm120; do
    for m in qwen3.6-27b qwen3.6-35b-a3b; do
      DRAFTFEED_PORTABLE_KERNELS=$mode timeout 300 .bundle/bin/draftfeed-bench engine \
        --model "random:$m" --tokens 16384 --iters "${ITERS:-3}" 2>&1 |
        grep -E "draftfeed: cuda|tokens/s"
    done
  done
elif [[ $PART == tp ]]; then
  # Every architecture sharded at tp 2 and 4 on one GPU against the unsharded engine.
  echo "== cuda_tensor_parallel_test"
  timeout 300 .bundle/bin/cuda_tensor_parallel_test 2>&1 | summary
  # Which MoE strategy gives a rank less work: both ranks share the GPU, so the time is
  # about twice one rank's plus the sums.
  for moe in ep split; do
    timeout 300 .bundle/bin/draftfeed-tp-bench --model random:qwen3.6-35b-a3b --tokens 49152 \
      --tp 2 --moe_parallel $moe --devices 0,0 --iters "${ITERS:-3}"
  done
  timeout 300 .bundle/bin/draftfeed-tp-bench --model random:qwen3.6-27b --tokens 16384 --tp 2 \
    --devices 0,0 --iters "${ITERS:-3}"
  # The service over gRPC from a tensor-parallel target (ranks sharing the GPU).
  timeout 300 .bundle/bin/draftfeed-e2e-bench --model random:qwen3.6-35b-a3b --device cuda:0 \
    --tokens 16384 --capture 5 --warmup 1 --batches 4 --repeats 2 --target_devices 0,0 \
    --target_args=--tp=2 --target_bin .bundle/bin/draftfeed-target
  echo "e2e (tp 2 target) exit status $?"
  for tp in 1 2 4 8; do
    .bundle/bin/draftfeed-target --model random:qwen3.5-122b-a10b --tp $tp --print_plan 2>&1 | head -3
  done
elif [[ $PART == moe ]]; then
  for t in moe_cuda_test moe_cublas_cuda_test cuda_moe_engine_test; do
    echo "== $t"; timeout 240 .bundle/bin/$t 2>&1 | summary
  done
  echo "== goldens_test *Moe*"
  timeout 240 .bundle/bin/goldens_test --gtest_filter='*Moe*' 2>&1 | summary
  # The MoE kernels, the dense ceiling and cuBLAS's grouped GEMM (BM_MoeVsCublas*).
  timeout 240 .bundle/bin/draftfeed-bench-kernels --benchmark_filter='Moe|DenseCeiling' \
    --benchmark_min_time=0.1 2>&1 | grep -v WARNING
  for m in ${MOE_MODELS:-qwen3.6-35b-a3b qwen3-30b-a3b}; do
    out=$(timeout 300 .bundle/bin/draftfeed-bench engine --model "random:$m" --tokens 49152 \
      --iters "${ITERS:-5}")
    echo "$out"
    rate=$(echo "$out" | sed -n 's/.* = \([0-9]*\) tokens\/s.*/\1/p' | head -1)
    if [[ ${TRANSFORMERS:-1} == 1 ]]; then
      timeout 300 python3 bench/transformers_prefill.py --model "$m" --tokens 49152 --iters 2 \
        --draftfeed-tokens-per-s "${rate:-0}"
    fi
  done
else
  for t in ${TOKENS:-16384 49152}; do
    timeout 300 .bundle/bin/draftfeed-bench engine --tokens "$t" --iters "${ITERS:-5}"
  done
  timeout 120 .bundle/bin/draftfeed-bench-kernels --benchmark_min_time=0.1 2>&1 | grep -v WARNING
  timeout 120 .bundle/bin/draftfeed-grpc-bench --batches 15 --repeats 5
  timeout 420 .bundle/bin/draftfeed-e2e-bench --model random:qwen3.6-27b --device cuda:0 \
    --tokens 16384 --min_len 512 --max_len 8192 --capture 5 --warmup 2 --batches 6 \
    --repeats 3 --target_bin .bundle/bin/draftfeed-target --min_ratio 0.95
  echo "e2e exit status $? (1: ratio below 0.95)"
fi

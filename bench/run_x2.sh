#!/usr/bin/env bash
# Issue 5 on the two-GPU machine (nvidia-h200-x2), in one device call: the GPU
# tests (payload checksum kernel, NCCL transport, CUDA engine, the CUDA
# service; GOLDENS=1 adds the goldens), NCCL transport vs raw ncclSend/Recv, the
# gRPC data plane vs raw TCP on this host's cores, and the end-to-end bench
# (bench/run_e2e_h200.sh).
# Bundle, made here first:
#   bash scripts/make-bundle.sh .bundle build/bin/draftfeed-target build/bin/draftfeed-e2e-bench \
#     build/bin/draftfeed-nccl-bench build/bin/draftfeed-grpc-bench \
#     build/tests/server/service/transport_test build/tests/server/service/service_test \
#     build/tests/server/model/cuda_engine_test build/tests/server/model/goldens_test \
#     build/tests/server/service/checksum_test
# THREADS=1 (default) samples per-thread CPU while 2 gRPC connections stream
# (bench/thread_cpu.py); E2E=0 skips the end-to-end bench.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NVLink multicast (NVLS) stays off: on a host whose GPUs others share, a program that uses it
# can put them out of service for a day or more.
export NCCL_NVLS_ENABLE=0
export DRAFTFEED_SOURCE_DIR=$PWD
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
summary='^\[  (     OK|FAILED|  PASSED|SKIPPED)|Failure|Expected|Which is|rms|cosine'
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 60 .bundle/bin/checksum_test 2>&1 | grep -E "$summary"
  timeout 180 .bundle/bin/transport_test 2>&1 | grep -E "$summary"
  timeout 180 .bundle/bin/cuda_engine_test --gtest_filter='CudaEngineAsync.*' 2>&1 | grep -E "$summary"
  timeout 120 .bundle/bin/service_test --gtest_filter='CudaServiceTest.*' 2>&1 | grep -E "$summary"
  if [[ ${GOLDENS:-0} == 1 ]]; then
    timeout 180 .bundle/bin/goldens_test --gtest_filter='*Cuda*' 2>&1 | grep -E "$summary"
  fi
fi
echo "== NCCL transport vs raw ncclSend/ncclRecv"
timeout 300 .bundle/bin/draftfeed-nccl-bench --sizes_mib "${NCCL_SIZES:-64,128,256,512,1024}" \
  --repeats 5 --transfers 8
echo "== gRPC data plane vs raw TCP (this host's cores)"
for conns in 1 2; do
  timeout 120 .bundle/bin/draftfeed-grpc-bench --batches 20 --repeats 5 --connections $conns
done
timeout 120 .bundle/bin/draftfeed-grpc-bench --batches 20 --repeats 5 --target_checksum host
if [[ ${THREADS:-1} == 1 ]]; then
  # Which threads are busy while 2 connections stream (gRPC alone, no TCP rounds):
  # the first process listed is the trainer, the second the target (forked).
  echo "== per-thread CPU, 2 connections"
  .bundle/bin/draftfeed-grpc-bench --batches 60 --repeats 3 --connections 2 --tcp=false &
  bench_pid=$!
  python3 bench/thread_cpu.py draftfeed-grpc --delay 4 --seconds 3
  wait $bench_pid
fi
if [[ ${E2E:-1} == 1 ]]; then
  echo "== end to end"
  bash bench/run_e2e_h200.sh
fi

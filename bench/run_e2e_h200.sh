#!/usr/bin/env bash
# Issue 5 on one H200, in one call: the double-buffering GPU tests, then the
# end-to-end benchmark (engine alone vs a trainer in another process fed by
# draftfeed-target over gRPC). Expects the bundle made by
#   bash scripts/make-bundle.sh .bundle build/bin/draftfeed-target build/bin/draftfeed-e2e-bench \
#     build/tests/server/model/cuda_engine_test build/tests/server/service/service_test
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 180 .bundle/bin/cuda_engine_test 2>&1 | grep -E "^\[  (     OK|FAILED|  PASSED)|Failure|Expected|Which is"
  timeout 120 .bundle/bin/service_test --gtest_filter='CudaServiceTest.*' 2>&1 | grep -E "OK|FAILED|PASSED"
fi
# 27B shape, 5 layers, 16,384-token batches of 512..8,192-token sequences:
# 2 warm-up batches then 3 windows of 6 (about 80 s of GPU time in all).
timeout 420 .bundle/bin/draftfeed-e2e-bench --model random:qwen3.6-27b --device cuda:0 \
  --tokens 16384 --min_len 512 --max_len 8192 --capture 5 --warmup 2 --batches "${BATCHES:-6}" \
  --repeats "${REPEATS:-3}" --target_bin .bundle/bin/draftfeed-target --min_ratio 0.95
echo "e2e exit status $? (1: ratio below 0.95)"

#!/usr/bin/env bash
# The issue-4 measurements on one H200, in one call (device time is scarce):
# CUDA engine tests, the cuBLASLt ceiling, the engine at 16,384 and 49,152
# tokens, and transformers on the same shape. Expects the bundle made by
#   bash scripts/make-bundle.sh .bundle build/bin/draftfeed-bench build/tests/server/model/cuda_engine_test
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[[ ${SKIP_TESTS:-0} == 1 ]] || timeout 120 .bundle/bin/cuda_engine_test 2>&1 | grep -E "id |OK|FAILED|PASSED"
timeout 60 .bundle/bin/draftfeed-bench gemm --tokens 16384
rate16k=0
for t in ${TOKENS:-16384 49152}; do
  out=$(timeout 240 .bundle/bin/draftfeed-bench engine --tokens "$t" --iters "${ITERS:-5}")
  echo "$out"
  if [[ $t == 16384 ]]; then
    rate16k=$(echo "$out" | sed -n 's/.* = \([0-9]*\) tokens\/s.*/\1/p' | head -1)
  fi
done
if [[ ${TRANSFORMERS:-1} == 1 ]]; then
  timeout 300 python3 bench/transformers_prefill.py --tokens 16384 --iters 2 \
    --draftfeed-tokens-per-s "${rate16k:-0}"
fi

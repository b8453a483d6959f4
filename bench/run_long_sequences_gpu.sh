#!/usr/bin/env bash
# Chunked prefill (sequences longer than one forward) on one H200. Build and
# bundle here first, in an sm_90a tree:
#   cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_CUDA_ARCHS=90a-real
#   cmake --build build-h200 --target draftfeed-bench attention_cuda_test gdn_cuda_test \
#     gdn_carry_cuda_test cuda_chunked_prefill_test cuda_engine_test
#   bash scripts/make-bundle.sh .bundle build-h200/bin/draftfeed-bench build-h200/tests/...
#   tar -cJf .bundle.tar.xz .bundle
# then on the GPU machine, from the repository root (carrying .bundle.tar.xz):
#   PART=tests bash bench/run_long_sequences_gpu.sh      # kernel and engine suites
#   PART=speed27 bash bench/run_long_sequences_gpu.sh    # Qwen3.6-27B shape, 64K/128K/256K
#   PART=speed35 bash bench/run_long_sequences_gpu.sh    # Qwen3.6-35B-A3B shape, 128K
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_bundle.sh
part=",${PART:-tests},"
summary() { grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$|Expected|Which is|values differ|vs CPU|error while loading|rror:" || true; }
bench=.bundle/bin/draftfeed-bench
if [[ $part == *,tests,* ]]; then
  for t in ${TESTS:-attention_cuda_test gdn_cuda_test gdn_carry_cuda_test cuda_chunked_prefill_test \
           cuda_engine_test}; do
    echo "== $t"
    timeout 300 .bundle/bin/$t 2>&1 | summary
  done
fi
if [[ $part == *,speed27,* ]]; then
  # Chunked against one pass at 65,536 (the one-pass engine's workspace is
  # sized for the whole sequence), then 131,072 and 262,144 in forwards of
  # 16,384 (the default --max_batch_tokens).
  $bench long --model random:qwen3.6-27b --sequence_tokens 65536 --forward_tokens 16384 \
    --one_pass --iters 2
  $bench long --model random:qwen3.6-27b --sequence_tokens 131072 --forward_tokens 16384 --iters 2
  $bench long --model random:qwen3.6-27b --sequence_tokens 262144 --forward_tokens 16384 --iters 1
fi
if [[ $part == *,speed35,* ]]; then
  $bench long --model random:qwen3.6-35b-a3b --sequence_tokens 131072 --forward_tokens 16384 \
    --iters 2
fi

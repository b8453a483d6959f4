#!/usr/bin/env bash
# Issue 21 item 5 on one H200, in one call (about 3-6 minutes, within 9): the
# staged upload's CUDA tests, then a real-size random checkpoint of the
# Qwen3-8B shape (36 layers, hidden 4096, untied head: 16.4 GB of bf16 in 4
# shards, a quarter of the host's 64 GiB disk; the 27B's 54 GB would not leave
# room) written to that disk, then the cold-load benchmark: per repeat, the
# files evicted from the page cache and read raw in parallel, evicted again and
# loaded onto the GPU through LoadModel + CudaEngine::Create; medians and
# their ratio. Build and bundle here first:
#   BUILD_DIR=build bash bench/run_load_gpu.sh bundle   (makes .bundle-load.tar.xz)
# then on the GPU machine, from the repository root (carrying .bundle-load.tar.xz):
#   bash bench/run_load_gpu.sh
# Knobs: SHAPE (random:qwen3-8b), SHARDS (4), REPEATS (3), LOAD_THREADS and
# READ_THREADS (0 = the default), CHECKPOINT_DIR (on the disk, not tmpfs),
# BUNDLE (.bundle-load).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(realpath -m "${BUNDLE:-.bundle-load}")
if [[ ${1:-} == bundle ]]; then
  b=${BUILD_DIR:-build}
  rm -rf "$bundle"
  bash scripts/make-bundle.sh "$bundle" "$b/bin/draftfeed-bench" \
    "$b/tests/server/model/cuda_upload_test"
  # Device code makes the binaries large; stripped and packed they travel
  # within the device tool's carry limit.
  strip --strip-unneeded "$bundle"/bin/*
  tar -cJf "$bundle.tar.xz" -C "$(dirname "$bundle")" "$(basename "$bundle")"
  ls -la "$bundle.tar.xz"
  exit
fi
[[ -d $bundle ]] || tar -xJf "$bundle.tar.xz" -C "$(dirname "$bundle")" || exit 1
export LD_LIBRARY_PATH=$bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ck=${CHECKPOINT_DIR:-$PWD/.load-checkpoint}
mkdir -p "$ck"
df -hT "$ck" | tail -1
if [[ $(df --output=fstype "$ck" | tail -1) == tmpfs ]]; then
  echo "warning: $ck is on tmpfs: neither eviction nor disk speed can be measured there"
fi
avail_gb=$(($(df --output=avail -B1 "$ck" | tail -1) / 1000000000))
if ((avail_gb < 20)); then
  echo "error: $avail_gb GB free under $ck; the checkpoint needs about 17" >&2
  exit 1
fi
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  timeout 90 "$bundle"/bin/cuda_upload_test 2>&1 |
    grep -E "^\[  (     OK|FAILED|  PASSED|SKIPPED)|Failure|Expected|Which is"
fi
timeout 150 "$bundle"/bin/draftfeed-bench write-random --model "${SHAPE:-random:qwen3-8b}" \
  --out "$ck" --shards "${SHARDS:-4}" || exit 1
timeout 280 "$bundle"/bin/draftfeed-bench load --model "$ck" --device 0 \
  --repeats "${REPEATS:-3}" --load_threads "${LOAD_THREADS:-0}" --read_threads "${READ_THREADS:-0}"
status=$?
rm -rf "$ck"
exit $status

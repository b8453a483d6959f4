#!/usr/bin/env bash
# Smoke run of the Google Benchmark programs (bench/micro/): each one briefly,
# so CI notices one that no longer builds, crashes or reports an error. The
# figures of so short a run are not measurements; run a program without
# flags for those. Usage: [BUILD_DIR=build] scripts/run_micro_benchmarks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MIN_TIME=${MIN_TIME:-0.01}

# CPU programs must exist; the kernel program exists where CUDA compiled,
# and without a GPU it says so and exits 0.
required=(draftfeed-bench-checksum draftfeed-bench-pool draftfeed-bench-codec
          draftfeed-bench-cpu-attention)
optional=(draftfeed-bench-kernels)

failed=0
run() {
  local bin="$BUILD_DIR/bin/$1" out
  echo "== $1"
  # A benchmark that calls SkipWithError still exits 0: its "ERROR OCCURRED" line is the failure.
  if ! out=$("$bin" --benchmark_min_time="$MIN_TIME" 2>&1); then
    echo "$out"
    echo "FAILED: $1 exited non-zero"
    failed=1
  elif grep -q "ERROR OCCURRED" <<<"$out"; then
    echo "$out"
    echo "FAILED: $1 reported an error"
    failed=1
  else
    echo "$out" | grep -v '^\*\*\*WARNING' || true
  fi
}

for name in "${required[@]}"; do
  if [[ ! -x "$BUILD_DIR/bin/$name" ]]; then
    echo "FAILED: $BUILD_DIR/bin/$name is missing (build it first)"
    failed=1
    continue
  fi
  run "$name"
done
for name in "${optional[@]}"; do
  [[ -x "$BUILD_DIR/bin/$name" ]] && run "$name"
done
exit "$failed"

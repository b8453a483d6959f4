#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/, clang with ASan and UBSan) in
# build-fuzz and runs each for a time budget over its committed seed corpus
# (tests/fuzz/corpus/<target>/); what each run adds stays in
# build-fuzz/corpus/<target>/, so later runs resume from it.
# Usage: scripts/run_fuzzers.sh [SECONDS_PER_TARGET] [TARGET...]
#   default 60 s per target and every target (fuzz_safetensors, fuzz_config,
#   fuzz_stream_request, fuzz_chunk); give more seconds for a longer hunt.
# A crash, leak, sanitizer report or broken invariant fails the run; the
# input is kept in build-fuzz/crashes/ and its path is printed. Reproduce with
# build-fuzz/fuzz/<target> <input>; make it a unit test before fixing it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-60}
shift || true
TARGETS=("$@")
if (( ${#TARGETS[@]} == 0 )); then
  TARGETS=(fuzz_safetensors fuzz_config fuzz_stream_request fuzz_chunk)
fi
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${BUILD_JOBS:-$(nproc)}

command -v clang++ >/dev/null ||
  { echo "run_fuzzers: clang++ not found (apt-get install clang)" >&2; exit 1; }
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
LAUNCHER=()
if command -v ccache >/dev/null; then LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
if [[ ! -f $BUILD/CMakeCache.txt ]]; then
  cmake -S . -B "$BUILD" "${GEN[@]}" "${LAUNCHER[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DDRAFTFEED_ENABLE_CUDA=OFF \
    -DDRAFTFEED_BUILD_FUZZERS=ON -DDRAFTFEED_BUILD_PYTHON=OFF -DDRAFTFEED_BUILD_BENCH=OFF \
    -DDRAFTFEED_BUILD_TESTS=OFF >/dev/null
fi
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
mkdir -p "$BUILD/crashes"
failed=()
summary=()
for t in "${TARGETS[@]}"; do
  name=${t#fuzz_}
  work="$BUILD/corpus/$name"
  mkdir -p "$work"
  log="$BUILD/$t.log"
  echo "== $t: ${SECONDS_PER_TARGET} s (log: $log)"
  # -timeout: one input running 10 s is a hang; -rss_limit_mb: memory that
  # one input can make the parser take is part of what is fuzzed.
  if "$BUILD/fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
      -max_len=4096 -print_final_stats=1 -artifact_prefix="$BUILD/crashes/$t-" \
      "$work" "tests/fuzz/corpus/$name" >"$log" 2>&1; then
    stats=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
    summary+=("$t: ok, ${stats:-?} inputs, $cov, corpus $(ls "$work" | wc -l)")
  else
    tail -n 40 "$log"
    failed+=("$t")
    summary+=("$t: FAILED (see $log; input in $BUILD/crashes/)")
  fi
done
printf '%s\n' "${summary[@]}"
if (( ${#failed[@]} > 0 )); then
  echo "run_fuzzers: ${failed[*]} failed" >&2
  exit 1
fi

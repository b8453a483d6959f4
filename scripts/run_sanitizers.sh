#!/usr/bin/env bash
# The CPU path under the sanitizers.
#   ASan+UBSan (build-asan): the service and client suites (service_test,
#     transport_test, the common codec and pool tests) and the Python client
#     tests, whose targets are the ASan draftfeed-target; the Python module
#     loads under ASan with libasan (and libstdc++) preloaded into
#     /usr/bin/python3; LeakSanitizer is off there (the interpreter keeps its
#     allocations to exit).
#   TSan (build-tsan): the scheduler suite (scheduler_test). The feed suites
#     (service_test, transport_test: the C++ feed against real targets) run
#     too with TSAN_GRPC_SUITES=1, but only mean something against a gRPC
#     built with TSan: Debian's is not instrumented, so every hand-off that its
#     completion queues order (an op's tag written by the thread that starts
#     it, read by the one that takes its completion) reads as a race (34
#     reports in service_test, all in such hand-offs).
# Usage: scripts/run_sanitizers.sh [asan|tsan|all] (default all). Any report
# fails the run (halt_on_error); the exit code is nonzero on the first failure.
# BUILD_JOBS sets the build's parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH=${1:-all}
JOBS=${BUILD_JOBS:-$(nproc)}
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
LAUNCHER=()
if command -v ccache >/dev/null; then LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
SUPP="$PWD/scripts/sanitizer_suppressions"

configure() {  # configure DIR FLAGS
  cmake -S . -B "$1" "${GEN[@]}" "${LAUNCHER[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DDRAFTFEED_ENABLE_CUDA=OFF -DDRAFTFEED_BUILD_BENCH=OFF \
    "-DCMAKE_CXX_FLAGS=$2 -O1 -g -fno-omit-frame-pointer" \
    "-DCMAKE_C_FLAGS=$2 -O1 -g -fno-omit-frame-pointer" \
    "-DCMAKE_EXE_LINKER_FLAGS=$2" "-DCMAKE_SHARED_LINKER_FLAGS=$2" \
    "-DCMAKE_MODULE_LINKER_FLAGS=$2" >/dev/null
}

run_suites() {  # run_suites DIR BINARY...: each GoogleTest binary, all its tests
  local dir=$1
  shift
  for t in "$@"; do
    local bin
    bin=$(find "$dir/tests" -name "$t" -type f -perm -u+x | head -n1)
    echo "== $bin"
    DRAFTFEED_SOURCE_DIR="$PWD" "$bin" --gtest_brief=1
  done
}

run_asan() {
  local start=$SECONDS
  configure build-asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined"
  cmake --build build-asan -j"$JOBS" --target draftfeed-target service_test transport_test \
    chunk_envelope_test host_buffer_pool_test payload_checksum_test _draftfeed
  # Leaks are checked in the C++ suites; Python's interpreter keeps its own
  # allocations to exit, so LeakSanitizer is off under python3.
  export ASAN_OPTIONS="halt_on_error=1:abort_on_error=0:detect_leaks=1:strict_string_checks=1"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
  export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
  run_suites build-asan service_test transport_test chunk_envelope_test host_buffer_pool_test \
    payload_checksum_test
  # libstdc++ is preloaded beside libasan so that ASan's __cxa_throw
  # interceptor finds the real one (python3 itself does not link libstdc++;
  # without it the first C++ exception in the module aborts). Reports go to
  # files: pytest captures the test's stderr, and a report would die with it.
  # The DDP example is left out: under the preload one of its two
  # torch.distributed ranks exited at start-up, leaving the other waiting.
  local preload logs=build-asan/python-sanitizer-reports
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
  rm -rf "$logs" && mkdir -p "$logs"
  ASAN_OPTIONS="halt_on_error=1:detect_leaks=0:log_path=$PWD/$logs/asan" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$PWD/$logs/ubsan" \
    LD_PRELOAD="$preload" DRAFTFEED_BUILD_DIR="$PWD/build-asan" PYTHONPATH=build-asan/python \
    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/client/python \
    --ignore=tests/client/python/test_ddp_example.py ||
    { cat "$logs"/* 2>/dev/null | head -n 80; return 1; }
  if compgen -G "$logs/*" >/dev/null; then
    cat "$logs"/* | head -n 80
    echo "asan+ubsan: sanitizer reports from the Python tests (in $logs)" >&2
    return 1
  fi
  echo "asan+ubsan: clean in $((SECONDS - start)) s"
}

run_tsan() {
  local start=$SECONDS
  configure build-tsan "-fsanitize=thread"
  local suites=(scheduler_test) extra=()
  if [[ ${TSAN_GRPC_SUITES:-0} == 1 ]]; then
    suites+=(service_test transport_test)
    extra=(draftfeed-target)
  fi
  cmake --build build-tsan -j"$JOBS" --target "${extra[@]}" "${suites[@]}"
  # gRPC, protobuf and Abseil are Debian's uninstrumented builds: accesses
  # inside them are not checked (ignore_noninstrumented_modules) and races
  # whose top frame is gRPC's inline code are suppressed (tsan.supp).
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$SUPP/tsan.supp"
  run_suites build-tsan "${suites[@]}"
  echo "tsan: clean in $((SECONDS - start)) s"
}

case "$WHICH" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  all) run_asan && run_tsan ;;
  *) echo "usage: $0 [asan|tsan|all]" >&2; exit 2 ;;
esac

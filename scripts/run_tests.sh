#!/usr/bin/env bash
# Every test: install deps, build everything, run the C++ suites (ctest), the
# Python tests (pytest, against real target processes on loopback), a brief
# run of each Google Benchmark program (it must run and report no error; its
# figures are not measurements), the layering checks, which also build a
# trainer's client alone, the install test (cmake --install and pip) and a
# short run of every fuzzer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --for-tests
# ON, not the defaults (on where GoogleTest and Google Benchmark are installed): a tree the main
# job configured first has them off.
bash scripts/build.sh -DDRAFTFEED_BUILD_TESTS=ON -DDRAFTFEED_BUILD_BENCH=ON
ctest --test-dir build --output-on-failure -j"$(nproc)"
# A hung test fails the run instead of stalling it (pytest-timeout, python3-pytest-timeout): past
# 300 s (the slowest test takes a fraction of that) it prints every thread's stack and ends
# pytest. The thread method, not SIGALRM: a hung test's threads can hold locks that its teardown
# (the feed's close) then waits on, so failing just the test would hang again right after.
PYTEST_TIMEOUT=(--timeout=300 --timeout-method=thread)
DRAFTFEED_BUILD_DIR="$PWD/build" PYTHONPATH=build/python /usr/bin/python3 -m pytest -q \
  "${PYTEST_TIMEOUT[@]}" tests
# The client API's tests again on the pure-Python client (pip grpcio + protobuf), as a trainer
# image without the compiled module runs them.
DRAFTFEED_TRANSPORT=grpcio DRAFTFEED_BUILD_DIR="$PWD/build" PYTHONPATH=build/python \
  /usr/bin/python3 -m pytest -q "${PYTEST_TIMEOUT[@]}" tests/client/python \
  tests/server/service/test_security.py
bash scripts/run_micro_benchmarks.sh > build/micro_benchmarks.log 2>&1 ||
  { cat build/micro_benchmarks.log; exit 1; }
echo "micro-benchmarks: every program ran (log: build/micro_benchmarks.log)"
bash scripts/check_layering.sh
# The clients installed as users install them: cmake --install + an external
# find_package consumer, and pip install into a fresh venv.
CLIENT_BUILD_DIR=build-client bash tests/install/test_install.sh
# Each libFuzzer target for 15 s over its committed corpus (a clang ASan+UBSan
# build of the parsers, the service's request checks and the chunk decoder).
bash scripts/run_fuzzers.sh 15

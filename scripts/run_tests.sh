#!/usr/bin/env bash
# Every test: install deps, build everything, run the C++ suites (ctest) and the
# Python client's tests (pytest, against real target processes on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
DRAFTFEED_BUILD_DIR="$PWD/build" PYTHONPATH=build/python /usr/bin/python3 -m pytest -q tests

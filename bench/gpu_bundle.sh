# Sourced by the bench/run_*_gpu.sh scripts on the GPU machine: from the
# repository root, unpack the bundle they carry (.bundle.tar.xz, made by
# scripts/make-bundle.sh), put its libraries first, keep NVLink multicast off,
# name the GPU, and time builds of the code before and after side by side.
[[ -d .bundle ]] || tar -xJf .bundle.tar.xz
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 DRAFTFEED_SOURCE_DIR=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader

# before_and_after BENCH FILTER ROUNDS: .bundle/bin/BENCH-before (the code
# before the change, where bundled) and BENCH alternately, ROUNDS times, over
# the Google Benchmark FILTER; prints the result rows.
before_and_after() {
  local bench=$1 filter=$2 rounds=$3 round b
  for round in $(seq "$rounds"); do
    for b in ".bundle/bin/$bench-before" ".bundle/bin/$bench"; do
      [[ -x $b ]] || continue
      echo "== ${b##*/} (round $round)"
      "$b" --benchmark_filter="$filter" --benchmark_min_time=0.2 2>&1 | grep -E "^BM_|rror"
    done
  done
}

# run_goldens: the bundled goldens suites' CUDA cases (goldens_test,
# fp8_goldens_test), each one's summary lines.
run_goldens() {
  local t
  for t in goldens_test fp8_goldens_test; do
    [[ -x .bundle/bin/$t ]] || continue
    echo "== $t *Cuda*"
    timeout 300 .bundle/bin/$t --gtest_filter='*Cuda*' 2>&1 |
      grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure\$" | head -20
  done
}

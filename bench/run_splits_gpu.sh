#!/usr/bin/env bash
# The split benchmark on GPUs (issues 7, 8 and 16): one device call per machine kind.
#
# Here, on the build machine, once before the calls:
#   BUILD_DIR=build-warm bash bench/run_splits_gpu.sh bundle
# builds the Python client for the GPU host's Python 3.12 (build-py312/, the CUDA/NCCL options
# of $BUILD_DIR; a module built for this machine's 3.11 does not import there) and packs
# $BUNDLE (default .bundle-splits/, beside the test bundle .bundle/ of run_gpu_checks.sh):
# bin/draftfeed-target from $BUILD_DIR (default build), lib/ (the non-system libraries of both),
# python/draftfeed; stripped and packed as $BUNDLE.tar.xz (~10 MB, within the device carry).
# Then on the GPU host (device `run`, carry [".bundle-splits.tar.xz"]; unpacked on first use):
#   bash bench/run_splits_gpu.sh smoke $OUT/splits-1gpu   # nvidia-h200
#   bash bench/run_splits_gpu.sh two   $OUT/splits-2gpu   # nvidia-h200-x2
#   bash bench/run_splits_gpu.sh eight $OUT/splits-8gpu   # nvidia-h200-x8
# Each writes DIR/calibration.json (as soon as the calibration is measured, so a call cut
# short still leaves it), DIR/splits.json, DIR/splits.png and DIR/log; copy DIR back to
# bench/results/splits-h200-{1,2,8}gpu/. Any of the calibrations predicts every split of N GPUs:
#   python3 bench/splits.py --predict 8 --calibration DIR/calibration.json
# (a one-GPU calibration has no NCCL measurement; splits.py derives its NCCL rates).
#
# Sizes, chosen so each call ends well inside the device's 10-minute limit (the target's
# 49,152-token batch takes ~4 s on an H200 for the 27B shape, README "Performance"; a random
# 27B model ~10-20 s to make per GPU, once per call since targets are reused across splits):
#   smoke  1 GPU shared, 1-1, gRPC, 16,384-token batches, a 1-layer wide drafter (target and
#          drafter share 141 GB), 8 measured batches + 1 warm-up: ~2-3 min.
#   two    1-1 over gRPC then NCCL, 49,152-token batches, 5 captured layers, 5-layer drafter;
#          calibration 4 batches per transport, then per split 1 warm-up + 8 measured batches
#          (393,216 tokens, ~35 s): ~4-5 min.
#   eight  6-2,5-3,4-4,3-5 over $TRANSPORT (default nccl; "both" would double the splits and
#          not fit one call), 48 measured batches per split (2,359,296 tokens: 8 rounds of
#          the 6 targets, so the steady-state window is 7 rounds), 2 warm-up: ~6-8 min.
# The Qwen3.6-35B-A3B shape (64 GiB of bf16 weights, ~72 GiB at 49,152 tokens) leaves room on
# one GPU for the 8-GPU run's own drafter, so its smoke calibration measures that:
#   MODEL=random:qwen3.6-35b-a3b BATCH_TOKENS=49152 DRAFTER_LAYERS=5 \
#     bash bench/run_splits_gpu.sh smoke $OUT/splits-1gpu-35b
# Overrides: MODEL; LAYERS (default dflash:5, DFlash's 5 layers of whatever depth the target
# has: 1,16,31,46,61 of the 27B's 64, 1,10,19,28,37 of the 35B-A3B's 40); BATCH_TOKENS (smoke);
# DRAFTER_LAYERS; TRANSPORT (eight); PY (the Python with CUDA torch); BUNDLE; TIMEOUT_S (580).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: run_splits_gpu.sh bundle|smoke|two|eight [OUT_DIR]}
bundle=${BUNDLE:-.bundle-splits}

if [[ $mode == bundle ]]; then
  set -e
  b=${BUILD_DIR:-build}
  py312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
  [[ -x $b/bin/draftfeed-target ]] || { echo "build $b/bin/draftfeed-target first" >&2; exit 1; }
  cuda=$(sed -n 's/^DRAFTFEED_ENABLE_CUDA:BOOL=//p' "$b/CMakeCache.txt")
  nccl=$(sed -n 's/^DRAFTFEED_ENABLE_NCCL:BOOL=//p' "$b/CMakeCache.txt")
  cmake -S . -B build-py312 -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py312" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache \
    -DDRAFTFEED_ENABLE_CUDA="${cuda:-ON}" -DDRAFTFEED_ENABLE_NCCL="${nccl:-ON}" \
    -DDRAFTFEED_BUILD_TESTS=OFF -DDRAFTFEED_BUILD_BENCH=OFF >/dev/null
  cmake --build build-py312 -j2 --target _draftfeed
  so=$(ls build-py312/python/draftfeed/_draftfeed.cpython-312-*.so)
  rm -rf "$bundle" "$bundle.tar.xz"
  bash scripts/make-bundle.sh "$bundle" "$b/bin/draftfeed-target" "$so"
  rm -f "$bundle"/bin/_draftfeed*.so
  mkdir -p "$bundle/python"
  cp -r build-py312/python/draftfeed "$bundle/python/"
  rm -rf "$bundle"/python/draftfeed/__pycache__
  # Device code makes the target large; stripped and packed it travels within the carry limit.
  strip --strip-unneeded "$bundle"/bin/* "$bundle"/python/draftfeed/_draftfeed*.so
  tar -cJf "$bundle.tar.xz" "$bundle"
  du -sh "$bundle"
  ls -la "$bundle.tar.xz"
  exit 0
fi

out=${2:?OUT_DIR}
if [[ ! -d $bundle ]]; then
  [[ -f $bundle.tar.xz ]] || { echo "no $bundle/ or $bundle.tar.xz: run bundle" >&2; exit 1; }
  tar -xJf "$bundle.tar.xz"
fi
bundle=$(cd "$bundle" && pwd)
mkdir -p "$out"
export LD_LIBRARY_PATH=$bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$bundle/python PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) stays off in NCCL, PyTorch and NVSHMEM: on a host whose GPUs others
# share, a program that uses it can put them out of service for a day or more.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PY:-python3}
model=${MODEL:-random:qwen3.6-27b}
common=(--device cuda --model "$model" --layers "${LAYERS:-dflash:5}" --drafter dflash-full
        --binary "$bundle/bin/draftfeed-target" --out "$out"
        --save_calibration "$out/calibration.json")
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/log"
case $mode in
  smoke)
    smoke_batch=${BATCH_TOKENS:-16384}
    args=(--gpus 1 --splits 1-1 --transport grpc --max-batch-tokens "$smoke_batch"
          --drafter-layers "${DRAFTER_LAYERS:-1}"
          --tokens-per-split $(( smoke_batch > 131072 / 3 ? 3 * smoke_batch : 131072 ))
          --warmup-tokens "$smoke_batch" --calibrate-s 3) ;;
  two)
    args=(--gpus 2 --splits 1-1 --transport both --max-batch-tokens 49152
          --drafter-layers "${DRAFTER_LAYERS:-5}" --tokens-per-split 393216
          --warmup-tokens 49152 --calibrate-tokens 196608 --calibrate-s 5) ;;
  eight)
    args=(--gpus 8 --splits 6-2,5-3,4-4,3-5 --transport "${TRANSPORT:-nccl}"
          --max-batch-tokens 49152 --drafter-layers "${DRAFTER_LAYERS:-5}"
          --tokens-per-split 2359296 --warmup-tokens 98304 --calibrate-tokens 196608
          --calibrate-s 5) ;;
  *) echo "run_splits_gpu.sh: unknown mode $mode (bundle, smoke, two, eight)" >&2; exit 2 ;;
esac
timeout "${TIMEOUT_S:-580}" "$py" bench/splits.py "${common[@]}" "${args[@]}" 2>&1 |
  tee -a "$out/log"

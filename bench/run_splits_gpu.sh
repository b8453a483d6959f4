#!/usr/bin/env bash
# The split benchmark on GPUs (issues 7 and 8): one device call per machine kind.
#
# Here, on the build machine, once before the calls:
#   bash bench/run_splits_gpu.sh bundle
# builds the Python client for the GPU host's Python 3.12 (build-py312/, the CUDA/NCCL options
# of build/; the module in build/python is for this machine's 3.11 and does not import there)
# and packs .bundle/: bin/draftfeed-target, lib/ (the non-system libraries of both),
# python/draftfeed. Then on the GPU host (device `run`, carry [".bundle"]):
#   bash bench/run_splits_gpu.sh smoke $OUT/splits-1gpu   # nvidia-h200
#   bash bench/run_splits_gpu.sh two   $OUT/splits-2gpu   # nvidia-h200-x2
#   bash bench/run_splits_gpu.sh eight $OUT/splits-8gpu   # nvidia-h200-x8
# Each writes DIR/splits.json, DIR/splits.png and DIR/log (3 files); copy DIR back to
# bench/results/splits-h200-{1,2,8}gpu/.
#
# Sizes, chosen so each call ends well inside the device's 10-minute limit (the target's
# 49,152-token batch takes ~4 s on an H200, README "Performance"; a random 27B model ~10-20 s
# to make per GPU, once per call since targets are reused across splits):
#   smoke  1 GPU shared, 1-1, gRPC, 16,384-token batches, a 1-layer wide drafter (target and
#          drafter share 141 GB), 8 measured batches + 1 warm-up: ~2-3 min.
#   two    1-1 over gRPC then NCCL, 49,152-token batches, 5 captured layers, 5-layer drafter;
#          calibration 4 batches per transport, then per split 1 warm-up + 8 measured batches
#          (393,216 tokens, ~35 s): ~4-5 min.
#   eight  6-2,5-3,4-4,3-5 over $TRANSPORT (default nccl; "both" would double the splits and
#          not fit one call), 48 measured batches per split (2,359,296 tokens: 8 rounds of
#          the 6 targets, so the steady-state window is 7 rounds), 2 warm-up: ~6-8 min.
# Overrides: MODEL, DRAFTER_LAYERS, TRANSPORT (eight), PY (the Python with CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: run_splits_gpu.sh bundle|smoke|two|eight [OUT_DIR]}

if [[ $mode == bundle ]]; then
  set -e
  py312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
  cuda=$(sed -n 's/^DRAFTFEED_ENABLE_CUDA:BOOL=//p' build/CMakeCache.txt)
  nccl=$(sed -n 's/^DRAFTFEED_ENABLE_NCCL:BOOL=//p' build/CMakeCache.txt)
  cmake -S . -B build-py312 -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py312" \
    -DDRAFTFEED_ENABLE_CUDA="${cuda:-ON}" -DDRAFTFEED_ENABLE_NCCL="${nccl:-ON}" \
    -DDRAFTFEED_BUILD_TESTS=OFF -DDRAFTFEED_BUILD_BENCH=OFF >/dev/null
  cmake --build build-py312 -j2 --target _draftfeed
  # build/ is the tree's main build (the lead's): built there, not here.
  [[ -x build/bin/draftfeed-target ]] || { echo "build build/bin/draftfeed-target first" >&2; exit 1; }
  so=$(ls build-py312/python/draftfeed/_draftfeed.cpython-312-*.so)
  bash scripts/make-bundle.sh .bundle build/bin/draftfeed-target "$so"
  rm -f .bundle/bin/_draftfeed*.so
  rm -rf .bundle/python && mkdir -p .bundle/python
  cp -r build-py312/python/draftfeed .bundle/python/
  du -sh .bundle
  exit 0
fi

out=${2:?OUT_DIR}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.bundle/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$PWD/.bundle/python PYTHONUNBUFFERED=1
# NVLink multicast (NVLS) stays off in NCCL, PyTorch and NVSHMEM: on a host whose GPUs others
# share, a program that uses it can put them out of service for a day or more.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PY:-python3}
model=${MODEL:-random:qwen3.6-27b}
layers=1,16,31,46,61  # 5 captured layers spread over the 64, as DFlash takes them
common=(--device cuda --model "$model" --layers "$layers" --drafter dflash-full
        --binary .bundle/bin/draftfeed-target --out "$out")
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/log"
case $mode in
  smoke)
    args=(--gpus 1 --splits 1-1 --transport grpc --max-batch-tokens 16384
          --drafter-layers "${DRAFTER_LAYERS:-1}" --tokens-per-split 131072
          --warmup-tokens 16384 --calibrate-s 3) ;;
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
timeout 580 "$py" bench/splits.py "${common[@]}" "${args[@]}" 2>&1 | tee -a "$out/log"

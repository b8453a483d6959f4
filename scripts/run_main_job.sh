#!/usr/bin/env bash
# The main job: install deps, build, start a target server (the built-in tiny
# random model on the CPU unless MODEL/DEVICE say otherwise), run a
# trainer-shaped Python client over a few hundred batches, shut down cleanly.
#   MODEL=tiny-random BATCHES=300 bash scripts/run_main_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-tiny-random}
DEVICE=${DEVICE:-cpu}
BATCHES=${BATCHES:-300}
export BUILD_DIR=${BUILD_DIR:-build}
bash scripts/install-deps.sh
BUILD_TARGETS="draftfeed-target _draftfeed" bash scripts/build.sh

workdir=$(mktemp -d)
target_pid=""
cleanup() {
  if [[ -n "$target_pid" ]] && kill -0 "$target_pid" 2>/dev/null; then kill -KILL "$target_pid"; fi
  rm -rf "$workdir"
}
trap cleanup EXIT

"$BUILD_DIR"/bin/draftfeed-target --model "$MODEL" --device "$DEVICE" --listen 127.0.0.1:0 \
  --port_file "$workdir/port" &
target_pid=$!
for _ in $(seq 1 600); do
  [[ -f "$workdir/port" ]] && break
  kill -0 "$target_pid" 2>/dev/null || { echo "main job: target exited during start-up" >&2; exit 1; }
  sleep 0.1
done
[[ -f "$workdir/port" ]] || { echo "main job: target did not start within 60s" >&2; exit 1; }
port=$(cat "$workdir/port")

PYTHONPATH="$BUILD_DIR"/python /usr/bin/python3 client/python/examples/synthetic_trainer.py \
  --target "127.0.0.1:$port" --batches "$BATCHES" "$@"

kill -TERM "$target_pid"
wait "$target_pid"
target_pid=""
echo "main job: target shut down cleanly"

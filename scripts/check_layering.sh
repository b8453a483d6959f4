#!/usr/bin/env bash
# The layering rules the code relies on, checked rather than hoped for:
#  - nothing under client/ includes anything under server/;
#  - kernels/ includes nothing of the project's other layers, gRPC, protobuf or Abseil;
#  - DRAFTFEED_HAVE_NCCL appears only in the NCCL transport's files, their
#    registration and CMake (the service and the feed never ask which transport
#    they hold);
#  - a client-only build (DRAFTFEED_BUILD_SERVER=OFF, CUDA off) compiles no engine
#    or model kernel and links neither CUDA nor NCCL.
# Usage: scripts/check_layering.sh [--no-build]   (CLIENT_BUILD_DIR=build-client)
set -euo pipefail
cd "$(dirname "$0")/.."
failed=0
fail() { echo "layering: $*" >&2; failed=1; }

if hits=$(grep -rn '#include "server/' client/); then
  fail "client/ includes server internals:"$'\n'"$hits"
fi
if hits=$(grep -rnE '#include [<"](proto/|server/|client/|common/|draftfeed/|absl/|grpc|google/protobuf)' kernels/); then
  fail "kernels/ includes a framework or another layer:"$'\n'"$hits"
fi
# The NCCL switch: files named for NCCL, the transport registrations and CMake.
if hits=$(grep -rln DRAFTFEED_HAVE_NCCL server/ client/ common/ kernels/ proto/ |
          grep -vE "(nccl[^/]*|transport_registry[^/]*|client/src/transports\.cc|CMakeLists\.txt)\$"); then
  fail "DRAFTFEED_HAVE_NCCL outside the NCCL transport's files:"$'\n'"$hits"
fi

if [[ ${1:-} != --no-build ]]; then
  dir=${CLIENT_BUILD_DIR:-build-client}
  gen=()
  if command -v ninja >/dev/null; then gen=(-G Ninja); fi
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDRAFTFEED_BUILD_SERVER=OFF \
    -DDRAFTFEED_ENABLE_CUDA=OFF -DDRAFTFEED_ENABLE_NCCL=OFF >/dev/null
  cmake --build "$dir" -j"$(nproc)" >/dev/null
  if objs=$(find "$dir" -name '*.o' | grep -E 'kernels|server/'); then
    fail "the client-only build compiled server or kernel code:"$'\n'"$objs"
  fi
  module=$(find "$dir/python" -name '_draftfeed*.so' | head -1)
  [[ -n $module ]] || fail "the client-only build made no Python module"
  if [[ -n $module ]] && ldd "$module" | grep -E 'libcudart|libnccl|libcublas'; then
    fail "the client-only Python module links CUDA or NCCL"
  fi
  ctest --test-dir "$dir" --output-on-failure -j"$(nproc)" >/dev/null ||
    fail "the client-only build's tests failed (ctest --test-dir $dir)"
fi

if (( failed )); then exit 1; fi
echo "layering: client/server/kernels boundaries hold; the client-only build has no engine, CUDA or NCCL"

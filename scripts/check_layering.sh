#!/usr/bin/env bash
# The layering rules the code relies on, checked rather than hoped for:
#  - nothing under client/ includes anything under server/;
#  - kernels/ includes nothing of the project's other layers, gRPC, protobuf or Abseil;
#  - one folder per transport on each side, as a plugin would have
#    (server/service/transports/<name>/, client/src/transports/<name>/, each
#    with its CMakeLists.txt), and NCCL only under transports/nccl/: nothing
#    else of server/service/ or client/src/ includes nccl.h or common/nccl/,
#    calls NCCL or includes that folder's headers, but the registrations
#    (server/service/transport_registry.cc, client/src/transports.cc);
#  - DRAFTFEED_HAVE_NCCL appears only there, in common/nccl/ and in CMake (the
#    service and the feed never ask which transport they hold);
#  - no two units of server/service/ (a.h with a.cc, subfolders included)
#    include each other's headers: a stream reaches the service through what
#    it is handed, not back through the service's header;
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
# The transports: a folder each, NCCL in its own.
registrations='^(server/service/transport_registry\.cc|client/src/transports\.cc)$'
for side in server/service client/src; do
  for dir in "$side"/transports/*/; do
    [[ -f $dir/CMakeLists.txt ]] || fail "transport folder ${dir%/} has no CMakeLists.txt"
  done
  [[ -d $side/transports/nccl ]] || fail "$side/transports/nccl/ is missing"
  if hits=$(grep -rlE '#include [<"](nccl\.h|common/nccl/)|\bnccl[A-Z][A-Za-z]*\(' "$side" |
            grep -v "^$side/transports/nccl/"); then
    fail "NCCL used in $side outside $side/transports/nccl/:"$'\n'"$hits"
  fi
  if hits=$(grep -rlE "#include \"$side/transports/nccl/" "$side" |
            grep -v "^$side/transports/nccl/" | grep -vE "$registrations"); then
    fail "$side/transports/nccl/ headers included outside it and its registration:"$'\n'"$hits"
  fi
done
if hits=$(grep -rln DRAFTFEED_HAVE_NCCL server/ client/ common/ kernels/ proto/ |
          grep -vE '^(server/service|client/src)/transports/nccl/|^common/nccl/|CMakeLists\.txt$' |
          grep -vE "$registrations"); then
  fail "DRAFTFEED_HAVE_NCCL outside transports/nccl/, common/nccl/ and the registrations:"$'\n'"$hits"
fi

# Mutual includes among server/service/'s units: a unit is a.h with a.cc.
declare -A includes
while IFS= read -r file; do
  unit=${file%.*}
  includes[$unit]+=" $( (grep -oE '^#include "server/service/[^"]+\.h"' "$file" || true) |
    sed -E 's/^#include "(.*)\.h"$/\1/' | tr '\n' ' ')"
done < <(find server/service -name '*.h' -o -name '*.cc')
for a in "${!includes[@]}"; do
  for b in ${includes[$a]}; do
    if [[ $a < $b && " ${includes[$b]:-} " == *" $a "* ]]; then
      fail "server/service units include each other: $a and $b"
    fi
  done
done

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
echo "layering: client/server/kernels boundaries hold; NCCL only under transports/nccl/;" \
  "the client-only build has no engine, CUDA or NCCL"

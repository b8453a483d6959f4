#!/usr/bin/env bash
# Installs draftfeed the ways a user would and runs the installed copies
# against a target of the main build:
#  - C++: `cmake --install` of a client-only tree (no server, no CUDA) into a
#    prefix; tests/install/consumer, a project of its own, finds it with
#    find_package(draftfeed), links draftfeed::client and streams a batch
#    whose checksum and bytes must equal what the build tree's client gets;
#  - Python: `pip install ./client/python` into a fresh venv, then the client
#    API's tests run under that venv's interpreter, importing draftfeed from it.
# The venv sees Debian's site-packages (--system-site-packages) because
# numpy, pytest and torch come from Debian here: no package index is
# reachable, so pip can neither fetch them nor a build backend
# (--no-build-isolation uses Debian's setuptools).
# Usage: tests/install/test_install.sh
#   BUILD_DIR=build                  the main build (bin/draftfeed-target, python/)
#   CLIENT_BUILD_DIR=build-client    the client-only tree (scripts/check_layering.sh
#                                    builds it; configured here when missing)
#   INSTALL_TEST_DIR=$CLIENT_BUILD_DIR/install-test   prefix, venv, consumer build
#   PIP_CMAKE_BUILD_DIR=$CLIENT_BUILD_DIR/pip-cmake   pip's CMake tree, kept between runs
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
build=$(realpath -m "${BUILD_DIR:-build}")
client=$(realpath -m "${CLIENT_BUILD_DIR:-build-client}")
work=$(realpath -m "${INSTALL_TEST_DIR:-$client/install-test}")
pip_cmake=$(realpath -m "${PIP_CMAKE_BUILD_DIR:-$client/pip-cmake}")
target_bin=$build/bin/draftfeed-target
fail() { echo "install test: $*" >&2; exit 1; }
[[ -x $target_bin ]] || fail "no $target_bin: build the main tree first (scripts/build.sh)"
gen=()
if command -v ninja >/dev/null; then gen=(-G Ninja); fi
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
jobs=$(nproc)
rm -rf "$work"
mkdir -p "$work"

# A target on a free loopback port, stopped when this script ends.
target_pid=""
cleanup() { if [[ -n $target_pid ]]; then kill "$target_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT
"$target_bin" --model=tiny-random --device=cpu --threads=1 --listen=127.0.0.1:0 \
  --port_file="$work/port" >"$work/target.log" 2>&1 &
target_pid=$!
for _ in $(seq 600); do
  [[ -f $work/port ]] && break
  kill -0 "$target_pid" 2>/dev/null || fail "the target exited: $(cat "$work/target.log")"
  sleep 0.1
done
[[ -f $work/port ]] || fail "the target did not start in 60 s"
addr=127.0.0.1:$(cat "$work/port")

# C++: install the client-only tree, build the consumer against the prefix.
if [[ ! -f $client/CMakeCache.txt ]]; then
  cmake -S . -B "$client" "${gen[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DDRAFTFEED_BUILD_SERVER=OFF -DDRAFTFEED_ENABLE_CUDA=OFF -DDRAFTFEED_ENABLE_NCCL=OFF >/dev/null
fi
cmake --build "$client" -j"$jobs" --target draftfeed_client >/dev/null
cmake --install "$client" --prefix "$work/prefix" >"$work/install.log"
prefix=$work/prefix
[[ -f $prefix/include/draftfeed/client.h ]] || fail "client.h was not installed"
config=$(find "$prefix" -name draftfeedConfig.cmake)
[[ -n $config ]] || fail "no draftfeedConfig.cmake under $prefix"
[[ -f $(dirname "$config")/draftfeedConfigVersion.cmake ]] || fail "no version file beside $config"
if grep -l 'CUDA::\|libnccl' "$(dirname "$config")"/*.cmake; then
  fail "the client-only install refers to CUDA or NCCL"
fi
cmake -S tests/install/consumer -B "$work/consumer" "${gen[@]}" "${launcher[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/consumer" -j"$jobs" >/dev/null
got=$("$work/consumer/draftfeed_consumer" "$addr")
# The same batch through the build tree's Python client.
want=$(PYTHONPATH=$build/python /usr/bin/python3 - "$addr" <<'PY'
import sys
import numpy as np
import draftfeed
tokens = np.array([(i * 7 + 3) % 4096 for i in range(64)], dtype=np.int32)
with draftfeed.Feed(targets=[sys.argv[1]], layers=[0, -1]) as feed:
    feed.submit(tokens, [40, 24])
    r = feed.next()
fnv = 1469598103934665603
for b in r.hidden_bits.tobytes():
    fnv = ((fnv ^ b) * 1099511628211) % (1 << 64)
print(f"T={r.num_tokens} K={r.num_layers} H={r.hidden_size} checksum={r.checksum:016x} "
      f"fnv={fnv:016x}")
PY
)
[[ $got == "$want" ]] || fail "the installed C++ client got '$got', the build tree's '$want'"
echo "install test: C++ consumer of the installed client: $got"

# Python: a fresh venv, pip install, the client tests from there.
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
py=$work/venv/bin/python
DRAFTFEED_CMAKE_BUILD_DIR=$pip_cmake CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
  "$py" -m pip install --no-build-isolation --no-index -q ./client/python >"$work/pip.log" 2>&1 ||
  { cat "$work/pip.log"; fail "pip install ./client/python failed"; }
(cd "$work" && env -u PYTHONPATH "$py" -c '
import sys, draftfeed
assert draftfeed.__file__.startswith(sys.prefix), (draftfeed.__file__, sys.prefix)
print("install test: draftfeed", draftfeed.__file__)') ||
  fail "draftfeed is not imported from the venv"
# The tests of the client's API; the failover and DDP suites exercise the
# same module under more processes and stay with the main run.
tests=(test_client.py test_frictions.py test_torch_adapter.py test_layers.py test_packing.py)
(cd "$work" && env -u PYTHONPATH DRAFTFEED_BUILD_DIR="$build" \
  "$py" -m pytest -q -p no:cacheprovider \
    "${tests[@]/#/$repo/tests/client/python/}") ||
  fail "the client tests failed under the venv's pip-installed draftfeed"
echo "install test: the pip-installed package passes the client tests"

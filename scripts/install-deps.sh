#!/usr/bin/env bash
# Installs the Debian packages draftfeed needs, for one of three uses:
#   bash scripts/install-deps.sh               the main job (scripts/run_main_job.sh): build
#                                              draftfeed-target and the Python module, run them
#   bash scripts/install-deps.sh --for-tests   also what scripts/run_tests.sh needs: GoogleTest,
#                                              Google Benchmark, clang's libFuzzer, pytest and
#                                              the client's test packages, Slurm, promtool,
#                                              plotting
#   DRAFTFEED_DEPS=target bash scripts/install-deps.sh
#                                              building draftfeed-target alone (the container's
#                                              build stage)
# --list prints the packages of that use, one a line, and installs nothing.
# Idempotent: packages already present are skipped, and `apt-get update` runs only when
# something is missing.
set -euo pipefail

for_tests=0
list=0
for arg in "$@"; do
  case "$arg" in
    --for-tests) for_tests=1 ;;
    --list) list=1 ;;
    *) echo "install-deps: unknown argument '$arg' (expected --for-tests and/or --list)" >&2
       exit 2 ;;
  esac
done

# Building draftfeed-target.
TARGET_BUILD=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libssl-dev zlib1g-dev libzstd-dev libcpp-httplib-dev
)
# The main job: the target, the Python module (_draftfeed) and the synthetic trainer.
MAIN=(
  "${TARGET_BUILD[@]}"
  pybind11-dev python3-dev python3-numpy
)
# scripts/run_tests.sh on top of the main job's.
TESTS=(
  libgtest-dev libgmock-dev libbenchmark-dev  # ctest suites, bench/micro
  clang libclang-rt-14-dev                    # scripts/run_fuzzers.sh: libFuzzer, ASan, UBSan
  python3-pytest python3-grpcio python3-protobuf python3-tqdm  # pytest; the pure-Python client
  python3-pytest-timeout                      # run_tests.sh: a hung test fails, not stalls
  python3-venv python3-pip python3-setuptools python3-wheel    # tests/install: pip into a venv
  openssl                                     # test_security.py makes its certificates
  python3-yaml slurm-wlm munge                # tests/deploy: the manifests, a local Slurm
  prometheus                                  # promtool check metrics on /metrics
  python3-matplotlib                          # bench/splits.py's plots
)
# The tests of the client's torch hand-off (DLPack) run when the archive has torch; the main
# job does not need it.
OPTIONAL=()

if [[ "${DRAFTFEED_DEPS:-all}" == target ]]; then
  PACKAGES=("${TARGET_BUILD[@]}")
elif (( for_tests )); then
  PACKAGES=("${MAIN[@]}" "${TESTS[@]}")
  OPTIONAL=(python3-torch)
else
  PACKAGES=("${MAIN[@]}")
fi

if (( list )); then
  printf '%s\n' "${PACKAGES[@]}"
  if (( ${#OPTIONAL[@]} > 0 )); then printf '%s (optional)\n' "${OPTIONAL[@]}"; fi
  exit 0
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
opt_missing=()
for p in "${OPTIONAL[@]}"; do installed "$p" || opt_missing+=("$p"); done

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

if (( ${#missing[@]} + ${#opt_missing[@]} > 0 )); then
  echo "install-deps: installing ${missing[*]} ${opt_missing[*]}"
  $SUDO apt-get update -qq
  export DEBIAN_FRONTEND=noninteractive
  if (( ${#missing[@]} > 0 )); then
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    # The tests want prometheus's promtool, not a Prometheus server on port 9090: where
    # systemd started the one just installed, stop it and keep it off.
    if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null &&
       systemctl is-enabled prometheus.service >/dev/null 2>&1; then
      $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
  fi
  if (( ${#opt_missing[@]} > 0 )); then
    $SUDO apt-get install -y -qq --no-install-recommends "${opt_missing[@]}" ||
      echo "install-deps: optional ${opt_missing[*]} not installed (torch hand-off disabled)"
  fi
else
  echo "install-deps: all packages present"
fi

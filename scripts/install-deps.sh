#!/usr/bin/env bash
# Installs every Debian package draftfeed needs to build, test and run its main job.
# Idempotent: packages already present are skipped by apt-get, and `apt-get update`
# runs only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libabsl-dev libssl-dev openssl zlib1g-dev libzstd-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev  # scripts/run_fuzzers.sh: libFuzzer with ASan and UBSan
  pybind11-dev python3-dev python3-numpy python3-pytest python3-grpcio python3-protobuf
  python3-matplotlib
  python3-venv python3-pip python3-setuptools python3-wheel python3-tqdm
  python3-yaml slurm-wlm munge  # tests/deploy: the manifests' checks and the local Slurm
)
# torch is optional for the client (DLPack hand-off); installed when the archive has it.
OPTIONAL=(python3-torch)
# DRAFTFEED_DEPS=target: only what building draftfeed-target needs (the container's build stage).
if [[ "${DRAFTFEED_DEPS:-all}" == target ]]; then
  PACKAGES=(
    build-essential cmake ninja-build pkg-config
    libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
    libabsl-dev libssl-dev zlib1g-dev libzstd-dev libcpp-httplib-dev
  )
  OPTIONAL=()
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
opt_missing=()
for p in "${OPTIONAL[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || opt_missing+=("$p")
done

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

if (( ${#missing[@]} + ${#opt_missing[@]} > 0 )); then
  echo "install-deps: installing ${missing[*]} ${opt_missing[*]}"
  $SUDO apt-get update -qq
  export DEBIAN_FRONTEND=noninteractive
  if (( ${#missing[@]} > 0 )); then
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  if (( ${#opt_missing[@]} > 0 )); then
    $SUDO apt-get install -y -qq --no-install-recommends "${opt_missing[@]}" ||
      echo "install-deps: optional ${opt_missing[*]} not installed (torch hand-off disabled)"
  fi
else
  echo "install-deps: all packages present"
fi

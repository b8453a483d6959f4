#!/usr/bin/env bash
# Packs binaries and their non-system shared libraries into a relocatable
# folder for GPU hosts without the build tools (a binary built here runs there
# when its non-CUDA shared libraries travel beside it):
#   bash scripts/make-bundle.sh .bundle build/bin/draftfeed-bench build/tests/...
# Run there with LD_LIBRARY_PATH=<bundle>/lib. glibc, the compiler runtime and
# CUDA's own libraries are left out: the GPU host has newer ones.
set -euo pipefail
out=$1
shift
mkdir -p "$out/bin" "$out/lib"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvJitLink)'
for bin in "$@"; do
  cp -f "$bin" "$out/bin/"
  ldd "$bin" | awk '/=> \//{print $1" "$3}' | while read -r name path; do
    if [[ ! $name =~ $skip ]]; then cp -fL "$path" "$out/lib/$name"; fi
  done
done
du -sh "$out"
